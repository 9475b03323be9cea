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
