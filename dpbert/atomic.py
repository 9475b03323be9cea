"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike[str], text: str, *, private: bool = False) -> None:
    """Write `text` to a temporary sibling of `path`, then rename it over `path`.

    The file gets the usual permissions (0666 less the umask), so released folders are readable
    like any other download; with `private` it keeps mkstemp's 0600 (owner only) from its first
    byte on. On any error nothing is left behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if not private:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], obj: Any, *, sort_keys: bool = True) -> None:
    """`write_text` of `obj` as indented JSON with a final newline."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


@contextmanager
def replace_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary sibling folder of `path`; when the block ends normally it
    replaces `path` (any old folder is removed first). On any error nothing is left behind
    and the old folder, if any, is kept."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
