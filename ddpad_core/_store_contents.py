"""What a compile store holds, and keeping it to a size: the listing,
pruning and clearing behind ``ddpad cache`` and ``CompileStore(max_size=)``.

A store's top-level folders are keys: a model's key (``model.json`` and
one ``<graph>.bin`` per compiled graph, ``late-*.bin`` for lazily compiled
parts) or a model key and weights digest (``<key>-<digest>``, its
ahead-of-time packages ``aot-*.bin``). An entry set aside is
``<entry>.<corrupt|foreign|refused>`` with its reason in ``.txt`` beside
it; an entry refused on one host and process setting only keeps its place,
with ``<entry>.refused-<setting>.txt`` beside it. An entry's modification time is its last use: reading it touches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
import shutil
import time
from typing import Any

__all__ = ["Item", "KeyFolder", "clear", "describe", "listing", "parse_size", "prune"]

_SET_ASIDE = ("corrupt", "foreign", "refused")
_HERE = "refused on one host and setting"  # a local refusal: the entry stays for the others
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass
class Item:
    """One file of a key folder: an entry, a package or a set-aside entry."""

    path: pathlib.Path
    size: int
    used: float  # its modification time: written or last read
    kind: str  # "entry", "package", "late" or a set-aside kind
    reason: str = ""  # why it was set aside


@dataclasses.dataclass
class KeyFolder:
    """One top-level folder of a store, and what its ``model.json`` says."""

    path: pathlib.Path
    adapter: str | None
    items: list[Item]

    @property
    def size(self) -> int:
        return sum(item.size for item in self.items)

    @property
    def used(self) -> float:
        return max((item.used for item in self.items), default=0.0)

    def count(self, *kinds: str) -> int:
        return sum(item.kind in kinds for item in self.items)


def parse_size(text: str) -> int:
    """Bytes of ``"5G"``, ``"500M"``, ``"1.5T"`` or ``"1000"`` (powers of 1024).

    Raises
    ------
    ValueError
        Text that is not a size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"{text!r} is not a size: give a number of bytes, or one with K, M, G or T (5G)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _kind(path: pathlib.Path) -> str | None:
    if ".refused-" in path.name and path.suffix == ".txt":
        return _HERE
    if path.suffix == ".bin":
        return "late" if path.name.startswith("late-") else "package" if path.name.startswith("aot-") else "entry"
    return path.suffix.lstrip(".") if path.suffix.lstrip(".") in _SET_ASIDE else None


def _adapter(folder: pathlib.Path) -> str | None:
    """The adapter ``model.json`` names (a package folder's is its model key's)."""
    for name in (folder.name, folder.name.split("-", 1)[0]):
        with contextlib.suppress(OSError, ValueError):
            return json.loads((folder.parent / name / "model.json").read_text()).get("adapter")
    return None


def listing(root: str | pathlib.Path) -> list[KeyFolder]:
    """Every key folder of the store at ``root`` with its entries, packages
    and set-aside entries (with their reasons), most recently used first."""
    root = pathlib.Path(root).expanduser()
    folders = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        items = []
        for path in sorted(folder.iterdir()):
            kind = _kind(path)
            if kind is None:
                continue
            with contextlib.suppress(OSError):
                stat = path.stat()
                reason = ""
                if kind in _SET_ASIDE or kind == _HERE:
                    with contextlib.suppress(OSError):
                        reason = (path if kind == _HERE else path.with_suffix(f".{kind}.txt")).read_text().strip()
                items.append(Item(path, stat.st_size, stat.st_mtime, kind, reason))
        if items:
            folders.append(KeyFolder(folder, _adapter(folder), items))
    return sorted(folders, key=lambda f: -f.used)


def _remove(item: Item) -> None:
    with contextlib.suppress(OSError):
        item.path.unlink()
    with contextlib.suppress(OSError):
        item.path.with_suffix(f".{item.kind}.txt" if item.kind in _SET_ASIDE else ".refused.txt").unlink()


def _tidy(root: pathlib.Path) -> None:
    """Remove key folders left with nothing but their ``model.json`` and
    whose packages' folders are gone too."""
    for folder in list(root.iterdir()) if root.is_dir() else []:
        rest = [p for p in folder.iterdir() if p.name != "model.json"] if folder.is_dir() else [folder]
        if folder.is_dir() and not rest and not any(root.glob(f"{folder.name}-*")):
            shutil.rmtree(folder, ignore_errors=True)


def prune(root: str | pathlib.Path, *, older_than: float | None = None, max_size: int | None = None,
          now: float | None = None) -> list[Item]:
    """Remove the entries, packages and set-aside entries of the store at
    ``root`` not used for ``older_than`` seconds, then the least recently
    used until the store holds at most ``max_size`` bytes. Returns what was
    removed. A process that needs a removed entry compiles it again."""
    root = pathlib.Path(root).expanduser()
    items = sorted((i for f in listing(root) for i in f.items), key=lambda i: i.used)
    now = time.time() if now is None else now
    removed = [i for i in items if older_than is not None and now - i.used > older_than]
    kept = [i for i in items if i not in removed]
    if max_size is not None:
        total = sum(i.size for i in kept)
        while kept and total > max_size:
            item = kept.pop(0)
            removed.append(item)
            total -= item.size
    for item in removed:
        _remove(item)
    _tidy(root)
    return removed


def clear(root: str | pathlib.Path, model: str) -> list[KeyFolder]:
    """Remove every key folder of the store at ``root`` of ``model``: an
    adapter's name (all its models) or a key (a prefix of one will do).
    Returns what was removed.

    Raises
    ------
    ValueError
        No folder matches ``model`` (the message lists what the store holds).
    """
    root = pathlib.Path(root).expanduser()
    folders = listing(root)
    chosen = [f for f in folders if f.adapter == model or f.path.name.startswith(model)]
    if not chosen:
        held = sorted({f.adapter or f.path.name.split("-")[0] for f in folders})
        raise ValueError(f"the store {root} holds nothing of {model!r}: give an adapter or a key "
                         f"({', '.join(held) if held else 'it is empty'})")
    for folder in chosen:
        shutil.rmtree(folder.path, ignore_errors=True)
    _tidy(root)
    return chosen


def describe(folder: KeyFolder) -> dict[str, Any]:
    """One key folder as the listing prints it (and ``--json`` gives it)."""
    return {
        "key": folder.path.name, "adapter": folder.adapter, "entries": folder.count("entry", "late"),
        "packages": folder.count("package"), "size": folder.size,
        "last_use": time.strftime("%Y-%m-%d %H:%M", time.localtime(folder.used)),
        "set_aside": [{"file": i.path.name, "kind": i.kind, "reason": i.reason}
                      for i in folder.items if i.kind in _SET_ASIDE or i.kind == _HERE],
    }
