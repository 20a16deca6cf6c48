"""A Dynamo backend that compiles wrong numbers, for the first-use checks' tests."""

from __future__ import annotations

from typing import Any

import torch

OFF = 1e-3


def miscompiling(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A backend that runs the graph and adds ``OFF`` to every floating output
    (as Inductor's CPU code for orb's conservative model was off by 0.094)."""

    def run(*args: Any) -> Any:
        outs = gm(*args)
        off = [o + OFF if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in outs]
        return type(outs)(off) if isinstance(outs, (tuple, list)) else off

    return run
