"""A newcomer's reading path: from `dpbert pretrain` to the noise addition in at most three dpbert
modules after `cli.py` (issue: the DP step within three files).

A real (tiny) `dpbert pretrain` runs in-process; the noise function is wrapped to record the Python
call stack the first time it runs, and the dpbert modules on that stack between `dpbert.cli` and the
call are counted.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import tiny_run

from dpbert import cli
from dpbert.privacy import dp_step

PACKAGE = Path(dp_step.__file__).resolve().parent.parent


def _module(filename: str) -> str | None:
    path = Path(filename).resolve()
    if PACKAGE not in path.parents:
        return None
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_pretrain_reaches_the_noise_within_three_modules_after_the_cli(tmp_path, monkeypatch):
    stacks: list[list[str]] = []
    privatize = dp_step.privatize

    def recording(*args, **kwargs):
        if not stacks:
            stacks.append([m for m in (_module(f.filename) for f in traceback.extract_stack()) if m])
        return privatize(*args, **kwargs)

    monkeypatch.setattr(dp_step, "privatize", recording)
    recipe = tiny_run.write_recipe(tmp_path)
    args = ["pretrain", str(recipe), "--output-dir", str(tmp_path / "run")]
    args += [
        "--noise-seed-file",
        str(tiny_run.seed_file(tmp_path)),
        "--set",
        "schedule=[{steps: 1, expected_batch_size: 8}]",
    ]
    assert cli.main(args) == 0
    (stack,) = stacks
    # Collapse repeats (a module calling itself) and keep what lies after the CLI.
    path = [m for i, m in enumerate(stack) if i == 0 or m != stack[i - 1]]
    after_cli = path[path.index("dpbert.cli") + 1 :]
    # cli -> pretrain (builds the step) -> engine (the loop calls it) -> dp_step (clip, noise once).
    assert list(dict.fromkeys(after_cli)) == ["dpbert.train.pretrain", "dpbert.train.engine", "dpbert.privacy.dp_step"]
    assert privatize.__module__ == "dpbert.privacy.noise"
