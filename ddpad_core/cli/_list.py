"""``ddpad list``: every adapter, whether its model package is installed, and how to install it."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ._common import _quiet_prints, _verbose_option


def _package_version(requires: Sequence[str], owners: Mapping[str, Sequence[str]] | None = None) -> str:
    """The version of the first of ``requires`` (import names, the model
    package's first) whose distribution is installed; ``owners`` is
    ``importlib.metadata.packages_distributions()``, looked up once by the caller."""
    owners = importlib.metadata.packages_distributions() if owners is None else owners
    for module in requires:
        dist = owners.get(module.split(".")[0])
        if dist:
            try:
                return importlib.metadata.version(dist[0])
            except importlib.metadata.PackageNotFoundError:
                continue
    return "-"


def cmd_list(args: argparse.Namespace) -> int:
    """Every adapter with its status, model-package version and install hint."""
    from ddpad import adapters

    rows = []
    owners = importlib.metadata.packages_distributions()
    for name in adapters.available():
        with _quiet_prints(getattr(args, "verbose", False)):  # status imports the model package
            info = adapters.status(name)
        requires = info.get("requires") or []
        state = info["state"]  # installed only when its packages import; broken when one fails to
        version = _package_version(requires, owners) if state in ("installed", "broken") else "-"
        error = " ".join((info["error"] or "").split())
        rows.append((name, info["kind"], state, version, info.get("install_hint") or "", error))
    if args.json:
        keys = ("name", "kind", "status", "version", "install", "error")
        print(json.dumps([dict(zip(keys, row)) for row in rows], indent=2))
        return 0
    print(f"{'adapter':<10} {'kind':<10} {'status':<12} {'version':<10} install")
    for name, kind, state, version, hint, error in rows:
        print(f"{name:<10} {kind:<10} {state:<12} {version:<10} {hint}")
        if error and state != "missing":
            print(f"{'':<10} {error}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``list`` command's parser, under ``sub``."""
    p_list = sub.add_parser("list", help="adapters, whether their model package is installed, install hints",
                            description="Every adapter, whether its model package is installed, and how to install it.")
    p_list.add_argument("--json", action="store_true", help="machine-readable output (default: a table)")
    _verbose_option(p_list, argparse.SUPPRESS)
    p_list.set_defaults(func=cmd_list)
