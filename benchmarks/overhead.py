"""Print ddpad's per-call host overhead table (``ddpad._bench.overhead``).

``python benchmarks/overhead.py [--quick] [--sizes 20 100 ...] [--calls 50]``;
``--padders-from PATH`` measures the padders of another ``_padders``
(a ``_padders.py`` file or a ``_padders/`` package folder, e.g. an older
version) in place of the installed ones, for before/after tables on the
same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


def _use_padders_from(path: str) -> None:
    """Swap the padder classes everywhere the benchmark builds them."""
    import ddpad
    import ddpad.adapters.aimnet2
    import ddpad.adapters.mace
    import ddpad.adapters.uma
    from ddpad import _padders

    if os.path.isdir(path):  # a package: its relative imports resolve under ddpad._padders_alt
        spec = importlib.util.spec_from_file_location(
            "ddpad._padders_alt", os.path.join(path, "__init__.py"), submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location("ddpad._padders_alt", path)
    assert spec is not None and spec.loader is not None
    alt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = alt
    spec.loader.exec_module(alt)
    # the adapters' fill markers are the installed enum's, in every module of alt that compares them
    for name, module in list(sys.modules.items()):
        if (name == spec.name or name.startswith(spec.name + ".")) and hasattr(module, "Fill"):
            module.Fill = _padders.Fill
    for module in (ddpad, _padders, ddpad.adapters.mace, ddpad.adapters.uma, ddpad.adapters.aimnet2):
        for name in ("COOPadder", "DensePadder", "DenseBatchPadder"):
            if hasattr(module, name):
                setattr(module, name, getattr(alt, name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 100, 1000, 10000, 100000])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--padders", nargs="+", help="names from ddpad._bench.overhead.PADDERS (default: all)")
    parser.add_argument("--padders-from", help="a _padders.py or _padders/ to measure instead of the installed one")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.padders_from:
        _use_padders_from(args.padders_from)
    from ddpad._bench.overhead import format_table, overhead_table

    rows = overhead_table(args.sizes, args.calls, quick=args.quick, padders=args.padders)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
