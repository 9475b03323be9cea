"""Atomic writes: whole files and folders, fsynced, with ordinary permissions; a failure or a killed writer
leaves the previous content."""

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dpbert.atomic import replace_dir, write_json, write_text


def test_written_file_is_whole_and_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "sub" / "a.json", {"b": 1, "a": 2})
    finally:
        os.umask(old)
    path = tmp_path / "sub" / "a.json"
    assert json.loads(path.read_text()) == {"a": 2, "b": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's private 0600
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "card.md"
    write_text(path, "old")

    with pytest.raises(TypeError):
        write_text(path, 123)  # type: ignore[arg-type]  # not text: refused midway
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.md"]


def test_replace_dir_swaps_whole_folders_and_keeps_the_old_one_on_error(tmp_path):
    out = tmp_path / "release"
    with replace_dir(out) as tmp:
        (tmp / "a.txt").write_text("one")
    assert (out / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError, match="boom"), replace_dir(out) as tmp:
        (tmp / "b.txt").write_text("half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release"]  # no temporary left behind
    with replace_dir(out) as tmp:
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]


def test_a_write_is_fsynced_before_its_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b))[1])

    write_text(tmp_path / "a.txt", "new")
    assert events == ["fsync", "rename", "fsync"]  # the data, the rename, the folder entry

    events.clear()
    with replace_dir(tmp_path / "folder") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"weights")
    # w.bin, sub/, the temporary folder; the rename; the parent folder
    assert events == ["fsync", "fsync", "fsync", "rename", "fsync"]
    assert (tmp_path / "folder" / "sub" / "w.bin").read_bytes() == b"weights"


def test_a_failure_between_the_two_renames_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "release"
    with replace_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
    real_replace = os.replace

    def fail_on_the_second(src, dst):
        if ".partial-" in Path(src).name and Path(dst) == out:  # the new folder's rename
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_second)
    with pytest.raises(OSError, match="I/O error"), replace_dir(out) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release"]


_KILLED_WRITER = """
import os, sys
from pathlib import Path
from dpbert import atomic

out = Path(sys.argv[1])
real_replace = os.replace
if sys.argv[2] == "between-renames":
    def replace(src, dst):
        real_replace(src, dst)
        if Path(dst).name.startswith(".release.") and Path(dst).name.split(".")[-1].startswith("old-"):
            os._exit(9)  # killed after moving the old folder aside, before renaming the new one in
    os.replace = replace
with atomic.replace_dir(out) as tmp:
    (tmp / "a.txt").write_text("half")
    if sys.argv[2] == "mid-write":
        os._exit(9)
"""


@pytest.mark.parametrize("when", ["mid-write", "between-renames"])
def test_a_killed_writer_leaves_the_old_folder_recoverable(tmp_path, when):
    out = tmp_path / "release"
    with replace_dir(out) as tmp:
        (tmp / "a.txt").write_text("old")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(out), when], env=env)
    assert proc.wait(timeout=120) == 9
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "release")
    kinds = ["partial"] if when == "mid-write" else ["old", "partial"]
    assert sorted(name.rsplit(".", 1)[-1] for name in leftovers) == [f"{k}-{proc.pid}" for k in kinds], leftovers
    if when == "mid-write":
        assert (out / "a.txt").read_text() == "old"  # the old folder was never touched
    else:
        assert not out.exists()  # the old folder sits aside, whole

    with replace_dir(out) as tmp:  # the next writer recovers first: puts the old folder back, then swaps
        assert (out / "a.txt").read_text() == "old"
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release"]


def test_replace_files_replaces_each_file_and_keeps_the_others(tmp_path):
    from dpbert.atomic import replace_files

    (tmp_path / "keep.txt").write_text("tokenizer")
    (tmp_path / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), replace_files(tmp_path) as tmp:
        (tmp / "config.json").write_text("half")
        raise RuntimeError("boom")
    assert (tmp_path / "config.json").read_text() == "old"
    with replace_files(tmp_path) as tmp:
        (tmp / "config.json").write_text("new")
        (tmp / "model.safetensors").write_bytes(b"w")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {
        "keep.txt": b"tokenizer",
        "config.json": b"new",
        "model.safetensors": b"w",
    }
