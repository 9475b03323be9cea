"""Atomic writes of files and folders, with fsync: the one way dpbert replaces what is on disk.

Guarantees:
- A reader of `path` sees the old content or the new, never a part of either: everything is written
  under a temporary name in the same folder (same file system), fsynced, then renamed into place.
- When a call returns, the new content and its name are on disk (the file, then its folder, fsynced).
- On any error (a full disk, KeyboardInterrupt) the temporary files are removed and the old content is
  kept. A process killed mid-write can leave a temporary sibling (`.NAME.*.partial-PID`); the next
  `replace_dir` of the same path removes it once that process is gone.
- A folder swap moves the old folder aside before renaming the new one in: `path` is the old whole
  folder, briefly absent, or the new whole folder, never a half-written or half-deleted one. If the
  process dies between the two renames, the next `replace_dir` of `path` puts the old folder back first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_PARTIAL = "partial"
_OLD = "old"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(folder)


def write_text(path: str | os.PathLike[str], text: str, *, private: bool = False) -> None:
    """Write `text` (UTF-8) to `path` atomically (module guarantees).

    The file gets the usual permissions (0666 less the umask), so released folders are readable like
    any other download; with `private` it keeps mkstemp's 0600 (owner only) from its first byte on.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".{_PARTIAL}-{os.getpid()}")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not private:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], obj: Any, *, sort_keys: bool = True) -> None:
    """`write_text` of `obj` as indented JSON with a final newline."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def _leftovers(path: Path, kind: str) -> list[tuple[Path, int]]:
    """Temporary siblings of `path` of `kind`, with the id of the process that made them."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.[A-Za-z0-9_]{{8}}\.{kind}-(\d+)$")
    out = []
    for leftover in path.parent.iterdir():
        match = pattern.match(leftover.name)
        if match:
            out.append((leftover, int(match.group(1))))
    return sorted(out)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _recover(path: Path) -> None:
    """Undo what a killed writer of `path` left: an old folder moved aside is put back when `path` is
    missing (else removed), and temporary files and folders are removed."""
    for kind in (_OLD, _PARTIAL):
        for leftover, pid in _leftovers(path, kind):
            if _alive(pid):
                continue
            if kind == _OLD and not path.exists():
                os.replace(leftover, path)
            else:
                _remove(leftover)


@contextmanager
def replace_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary sibling folder of `path`; when the block ends normally, its whole tree
    is fsynced and it replaces `path` (an old folder is moved aside, then removed). On any error the
    temporary folder is removed and the old folder, if any, is kept (module guarantees)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".{_PARTIAL}-{os.getpid()}"))
    old = None
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".{_OLD}-{os.getpid()}"))
            os.replace(path, old)  # `old` is an empty folder, which a rename may replace
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if old is not None and not path.exists():
            os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def replace_files(folder: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary folder inside the existing `folder`; when the block ends normally, each
    file written there is fsynced and renamed over the file of the same name in `folder` (each file
    atomically, other files of `folder` kept). On any error nothing in `folder` changes."""
    folder = Path(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".replace.", suffix=f".{_PARTIAL}-{os.getpid()}"))
    try:
        yield tmp
        names = sorted(p.name for p in tmp.iterdir())
        if any((tmp / name).is_dir() for name in names):
            raise ValueError(f"{folder}: replace_files replaces files only, not folders ({names})")
        _fsync_tree(tmp)
        for name in names:
            os.replace(tmp / name, folder / name)
        fsync_dir(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
