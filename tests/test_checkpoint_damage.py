"""A damaged checkpoint costs a step range, not the run.

A tiny private run (tests/tiny_run.py: 2 layers x hidden 32, 4 steps, a checkpoint after every
step, the newest 3 kept) with an auditor's secret, then its checkpoint files cut in half as a
full disk or a killed copy leaves them:
- the newest damaged: the resume names it, restores the one before, moves the damaged folder
  aside, replays the step in between with the same keys and ends with the uninterrupted run's
  parameters and ledger (each step counted once);
- all damaged: `dpbert pretrain --resume` exits 1 with one error line naming the folder, and
  no traceback (Orbax's reads still in flight after the first failure used to print "Event loop
  is closed" tracebacks from TensorStore's threads).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tiny_run import persistent_compilation_cache, seed_file, write_recipe

from dpbert.privacy import PrivacyLedger
from dpbert.train.checkpoint import CheckpointStore
from dpbert.train.metrics import read_metrics
from dpbert.train.pretrain import pretrain

STEPS = 4
OVERRIDES = [f"schedule.0.steps={STEPS}", "train.keep_checkpoints=3"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("damage")
    recipe = write_recipe(root, checkpoint_every=1)
    return {"root": root, "recipe": recipe, "seed": seed_file(root), "cache": root / "jax_cache"}


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(workspace):
    """One persistent XLA cache for the reference run, the resumed run and the CLI's subprocess."""
    with persistent_compilation_cache(workspace["cache"]):
        yield


@pytest.fixture(scope="module")
def reference_run(workspace):
    """The uninterrupted run: checkpoints 2, 3 and 4 kept."""
    run_dir = workspace["root"] / "ref"
    pretrain(
        workspace["recipe"],
        run_dir,
        overrides=OVERRIDES,
        progress=False,
        log=lambda s: None,
        noise_seed_file=workspace["seed"],
        show_fill_mask=False,
    )
    assert CheckpointStore(run_dir / "checkpoints").steps() == [4, 3, 2]
    return run_dir


def copy_run(ref_dir: Path, run_dir: Path) -> Path:
    shutil.copytree(ref_dir, run_dir)
    shutil.rmtree(run_dir / "hf")  # the resumed run must write its own
    return run_dir


def cut_largest_array_file(step_dir: Path) -> Path:
    """Truncate the largest file of the checkpoint's arrays to half its size."""
    largest = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    return largest


def test_damaged_newest_checkpoint_resumes_from_the_one_before_and_replays_exactly(workspace, reference_run, tmp_path):
    run_dir = copy_run(reference_run, tmp_path / "run")
    ckpts = run_dir / "checkpoints"
    cut_largest_array_file(ckpts / "4")

    lines: list[str] = []
    result = pretrain(
        workspace["recipe"],
        run_dir,
        overrides=OVERRIDES,
        resume=True,
        progress=False,
        log=lines.append,
        noise_seed_file=workspace["seed"],
    )
    text = "\n".join(lines)
    damaged = [line for line in lines if "is damaged" in line]
    assert len(damaged) == 1, text
    assert damaged[0].startswith(f"checkpoint at step 4 ({ckpts / '4'}) is damaged and does not restore: ")
    assert "OUT_OF_RANGE" in damaged[0]  # the error's first line: TensorStore's, naming the array
    assert f"moved the damaged checkpoint of step 4 aside to {ckpts / '4.damaged'}" in text
    assert "resumed from step 3, the newest checkpoint that restores: step 4 will be replayed exactly" in text
    assert "spends no privacy twice" in text

    # Same parameters, same ledger as the uninterrupted run; every step counted and logged once.
    assert result.steps_done == STEPS and not result.stopped_early
    ref, got = (
        load_file(str(reference_run / "hf" / "model.safetensors")),
        load_file(str(run_dir / "hf" / "model.safetensors")),
    )
    assert ref.keys() == got.keys()
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-6, err_msg=name)
    ledger = json.loads((run_dir / "privacy.json").read_text())
    assert ledger == json.loads((reference_run / "privacy.json").read_text())
    assert PrivacyLedger.from_dict(ledger).total_steps == STEPS
    train = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train == list(range(1, STEPS + 1))

    # Step 4 was saved anew beside the damaged folder, which Orbax no longer takes for a step.
    assert (ckpts / "4.damaged").is_dir()
    store = CheckpointStore(ckpts)
    assert store.steps() == [4, 3, 2]
    lines.clear()
    again = pretrain(workspace["recipe"], run_dir, overrides=OVERRIDES, resume=True, progress=False, log=lines.append)
    assert again.steps_done == STEPS and "resumed from step 4" in lines


def test_all_checkpoints_damaged_is_one_clean_error(workspace, reference_run, tmp_path):
    run_dir = copy_run(reference_run, tmp_path / "run")
    ckpts = run_dir / "checkpoints"
    cut_largest_array_file(ckpts / "4")
    (ckpts / "3" / "meta" / "metadata").write_text("{not json")  # unreadable metadata counts as damage too
    cut_largest_array_file(ckpts / "2")

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpbert.cli",
            "pretrain",
            str(workspace["recipe"]),
            "--output-dir",
            str(run_dir),
            "--resume",
            "--noise-seed-file",
            str(workspace["seed"]),
            *(arg for o in OVERRIDES for arg in ("--set", o)),
        ],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(workspace["cache"])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("dpbert pretrain: error:")]
    assert error.startswith(f"dpbert pretrain: error: no checkpoint in {ckpts} restores"), error
    assert error.endswith("start a fresh run in a new run folder (another --output-dir, without --resume)")
    for step in (4, 3, 2):
        assert f"step {step} ({ckpts / str(step)}): " in error
        assert f"checkpoint at step {step} ({ckpts / str(step)}) is damaged" in proc.stdout
    # Nothing was moved or written: the folder is left as found.
    assert sorted(p.name for p in ckpts.iterdir()) == ["2", "3", "4", "noise_secret"]
