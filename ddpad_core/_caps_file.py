"""Caps files: the caps of a run, written atomically and checked when read back."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ._fs import atomic_write

__all__ = ["cached_caps_path", "caps_fitted", "load_caps", "save_caps"]

_CAPS_FORMAT = "ddpad-caps/1"


def load_caps(
    source: Mapping[str, int] | str | os.PathLike[str],
    *,
    adapter: str | None = None,
    ceilings: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Caps from a dict or a JSON file written by :func:`save_caps`.

    Parameters
    ----------
    source
        A mapping or the path of a caps file.
    adapter
        When given, the adapter recorded in the file must be this one.
    ceilings
        Per-key ceilings: a cap beyond its ceiling is rejected.

    Raises
    ------
    ValueError
        When the file cannot be read or parsed, is not a ddpad caps file, was
        written for another adapter, or holds a cap that is not a positive
        integer or exceeds its ceiling; the message names the file.
    """
    origin = "caps"
    if isinstance(source, Mapping):
        caps: Any = dict(source)
    else:
        origin = f"caps file {os.fspath(source)!r}"
        try:
            with open(source, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {origin}: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != _CAPS_FORMAT:
            raise ValueError(f"{origin} is not a ddpad caps file (format {_CAPS_FORMAT!r})")
        recorded = doc.get("adapter")
        if adapter is not None and recorded is not None and recorded != adapter:
            raise ValueError(f"{origin} holds caps of adapter {recorded!r}, not {adapter!r}")
        caps = doc.get("caps")
    if not isinstance(caps, dict):
        raise ValueError(f"{origin}: caps must be a mapping of key -> int, got {type(caps).__name__}")
    for key, value in caps.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{origin}: cap {key!r} must be a positive integer, got {value!r}")
        limit = (ceilings or {}).get(key)
        if limit is not None and value > limit:
            raise ValueError(f"{origin}: cap {key!r} = {value} exceeds its ceiling {limit}")
    return dict(caps)


def caps_fitted(source: Mapping[str, int] | str | os.PathLike[str]) -> bool:
    """Whether preset caps are already fitted (``cap_policy="tight"`` keeps
    them instead of fitting them again): a mapping is taken as given; a caps
    file says so when a tight run wrote it after its fit (a file of a
    head-room run, or of an older ddpad, does not). Call after
    :func:`load_caps` accepted ``source``."""
    if isinstance(source, Mapping):
        return True
    with open(source, encoding="utf-8") as fh:
        return json.load(fh).get("fitted") is True


def save_caps(caps: Mapping[str, int], path: str | os.PathLike[str], **meta: Any) -> None:
    """Write caps to ``path`` as JSON (with optional metadata, e.g. the adapter).

    Atomic: written to a temporary file beside ``path``, then renamed over it,
    so readers and concurrent writers never see a partial file.
    """
    doc = {"format": _CAPS_FORMAT, "caps": dict(caps), **meta}
    atomic_write(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), prefix=".ddpad-caps-")


def cached_caps_path(folder: str | os.PathLike[str], adapter: str, fingerprint: str, formula: str,
                     pbc: Sequence[bool]) -> str:
    """The caps file under ``folder`` of a model on a system, as ``ddpad run``
    keeps them between runs: keyed by the model's architecture
    (``fingerprint``: :func:`ddpad._store.model_fingerprint`, not its weights), the
    system's ``formula`` (species and atom count) and periodicity, so runs of
    other models or systems neither read nor overwrite it."""
    key = {"model": fingerprint, "formula": formula, "pbc": [bool(p) for p in pbc]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:12]
    return os.path.join(os.fspath(folder), f"{adapter}-{formula[:40]}-{digest}.json")
