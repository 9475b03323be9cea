"""Atomic writes: whole files with ordinary permissions, nothing left behind on failure."""

import json
import os
import stat

import pytest

from dpbert.atomic import write_json, write_text


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
    from dpbert.atomic import replace_dir

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
