"""``ddpad cache``: what the compile store holds; prune it by age or to a size; clear a model."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ._common import CliError, _cache_dir, _verbose_option


def _size(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} G"


def cmd_cache(args: argparse.Namespace) -> int:
    """List the store, or prune or clear it (``args.action``)."""
    from ddpad._store_contents import clear, describe, listing, parse_size, prune

    root = args.compile_cache
    if args.action == "prune":
        if args.older_than is None and args.max_size is None:
            raise CliError("cache prune: give --older-than DAYS, --max-size SIZE (5G), or both")
        try:
            bound = parse_size(args.max_size) if args.max_size is not None else None
        except ValueError as exc:
            raise CliError(f"cache prune --max-size: {exc}") from None
        age = args.older_than * 86400.0 if args.older_than is not None else None
        removed = prune(root, older_than=age, max_size=bound)
        print(f"ddpad cache: removed {len(removed)} file(s), {_size(sum(i.size for i in removed))}, from {root}")
        return 0
    if args.action == "clear":
        try:
            folders = clear(root, args.model)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        print(f"ddpad cache: removed {len(folders)} key folder(s) of {args.model!r}, "
              f"{_size(sum(f.size for f in folders))}, from {root}")
        return 0
    rows: list[dict[str, Any]] = [describe(f) for f in listing(root)]
    if args.json:
        print(json.dumps({"store": str(root), "keys": rows}, indent=1))
        return 0
    if not rows:
        print(f"ddpad cache: {root} holds nothing")
        return 0
    print(f"{'key':<34} {'adapter':<10} {'entries':>7} {'packages':>8} {'size':>9}  last use")
    for row in rows:
        print(f"{row['key'][:34]:<34} {row['adapter'] or '-':<10} {row['entries']:>7} {row['packages']:>8} "
              f"{_size(row['size']):>9}  {row['last_use']}")
        for aside in row["set_aside"]:
            label = aside["kind"] if aside["kind"].startswith("refused on") else f"set aside ({aside['kind']})"
            print(f"  {label}: {aside['file']}: {aside['reason'] or 'no reason recorded'}")
    print(f"{len(rows)} key(s), {_size(sum(r['size'] for r in rows))} in {root}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``cache`` command's parser, under ``sub``."""
    default = os.path.join(_cache_dir(), "compile")
    p_cache = sub.add_parser(
        "cache", help="list the compile store; prune it by age or to a size; clear a model",
        description="The compile store: 'ddpad cache' lists its models (key, adapter, entries, packages, size, "
                    "last use) and the entries set aside with their reasons; 'ddpad cache prune' removes what "
                    "was not used for --older-than DAYS, then the least recently used down to --max-size; "
                    "'ddpad cache clear MODEL' removes an adapter's models, or one key. A run that needs a "
                    "removed entry compiles it again.")
    p_cache.add_argument("action", nargs="?", choices=["list", "prune", "clear"], default="list",
                         help="list (default), prune or clear")
    p_cache.add_argument("model", nargs="?", help="clear: an adapter's name (all its models) or a key (or prefix)")
    p_cache.add_argument("--compile-cache", metavar="DIR", default=default,
                         help=f"the store (default: {default})")
    p_cache.add_argument("--older-than", type=float, metavar="DAYS", help="prune: what was not used for DAYS days")
    p_cache.add_argument("--max-size", metavar="SIZE", help="prune: down to SIZE (5G, 500M), least recently used "
                                                            "first")
    p_cache.add_argument("--json", action="store_true", help="list: machine-readable output")
    _verbose_option(p_cache, argparse.SUPPRESS)
    p_cache.set_defaults(func=_checked)


def _checked(args: argparse.Namespace) -> int:
    if args.action == "clear" and not args.model:
        raise CliError("cache clear: name the model: an adapter (mace) or a key from 'ddpad cache'")
    if args.action != "clear" and args.model:
        raise CliError(f"cache {args.action}: takes no MODEL ({args.model!r}); 'ddpad cache clear MODEL' clears one")
    return cmd_cache(args)
