"""dpbert's wheel, built from this checkout offline, as `pip install .` builds it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "dpbert", "model_cards")  # all that building the wheel reads


def build_wheel(tmp_path: Path) -> Path:
    """Build the wheel under `tmp_path` from a copy of SOURCES (so the checkout gets no build/ or
    egg-info, and no stale build output reaches the wheel), with this interpreter's pip and
    setuptools, offline and without build isolation; returns the wheel's path."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-index",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "-q",
        "-w",
        str(tmp_path / "wheels"),
        str(source),
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, f"pip wheel exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    (wheel,) = (tmp_path / "wheels").glob("dpbert-*.whl")
    return wheel
