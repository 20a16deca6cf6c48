"""Files: the user cache folder, and atomic writes (the one way ddpad writes
a file others may read at once: compile-store entries, caps files).
Standard library only (the command line's ``-h`` imports it)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import tempfile

__all__ = ["atomic_write", "cache_dir"]


def cache_dir() -> pathlib.Path:
    """ddpad's folder in the user's cache: ``$XDG_CACHE_HOME/ddpad``
    (``~/.cache/ddpad``); ``~/Library/Caches/ddpad`` on macOS,
    ``%LOCALAPPDATA%\\ddpad`` on Windows."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
    elif sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return pathlib.Path(base) / "ddpad"


def atomic_write(path: str | os.PathLike[str], data: bytes, prefix: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it
    (``prefix``), fsync, rename; readers and concurrent writers never see a
    partial file, and a failed write leaves the old one."""
    path = pathlib.Path(os.path.abspath(os.fspath(path)))
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
