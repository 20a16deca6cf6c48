"""Which runtime modules, and how many ddpad function calls, a steady call and a growth call visit.

``python benchmarks/call_trace.py [TREE]``: a MACE-layout padder around a
trivial model (``torch.compile`` with ``aot_eager``, head-room caps), counted
with ``sys.setprofile``; the padders' own modules and the model are left out
(they are the same for every route). ``TREE``: a checkout whose
``ddpad_core`` is imported as ``ddpad`` in place of the installed one (an
older commit's worktree, for a before/after count on docs/pages/architecture.md).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import sys
from typing import Any


def _ddpad(tree: str | None) -> Any:
    if tree is None:
        return importlib.import_module("ddpad")
    spec = importlib.util.spec_from_file_location("ddpad", f"{tree}/ddpad_core/__init__.py",
                                                  submodule_search_locations=[f"{tree}/ddpad_core"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddpad"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", default=None)
    args = parser.parse_args(argv)
    import torch

    ddpad = _ddpad(args.tree)
    overhead = importlib.import_module("ddpad._bench.overhead")
    root = ddpad.__file__.rsplit("/", 1)[0] + "/"
    model = ddpad.PaddedModel(overhead._Trivial("positions"), overhead._make_mace(), backend="aot_eager",
                              on_recompile="ignore", cap_policy="headroom")
    gen = torch.Generator().manual_seed(0)
    small, big = overhead._mace(50, gen), overhead._mace(400, gen)
    for _ in range(5):
        model(small)

    def visit(data: Any) -> collections.Counter[str]:
        calls: collections.Counter[str] = collections.Counter()

        def count(frame: Any, event: str, arg: Any) -> None:
            name = frame.f_code.co_filename
            if event == "call" and name.startswith(root) and "/_padders/" not in name and "/_bench/" not in name:
                calls[name[len(root):].removesuffix(".py")] += 1

        sys.setprofile(count)
        try:
            model(data)
        finally:
            sys.setprofile(None)
        return calls

    for name, data in (("steady", small), ("growth", big)):
        calls = visit(data)
        print(f"{name}: {len(calls)} modules, {sum(calls.values())} calls ({', '.join(sorted(calls))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
