"""First-use checks: a compiled step's numbers are compared with the eager
step's before anyone sees them.

Every compiled graph (a ``torch.compile`` graph or an ahead-of-time package)
runs its first call at given caps and call form beside the eager model on the
same padded input; outputs must agree within the tolerance of the least
precise floating dtype at work. A disagreement returns the eager result, and
that route is not used again for those caps and call form (a package falls
back to ``torch.compile``, ``torch.compile`` to the eager step), with one
warning. One eager step per compiled graph is the whole cost: nothing is
checked on a steady call.

Where an engine calls ``torch.compile`` itself (nvalchemi's
``DistributedModel``) there is no padded step to hold beside the eager one:
:class:`CheckedGraph` checks each graph the backend compiled against the same
graph run eagerly.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._stats import Stats

__all__ = ["CheckedGraph", "check", "disagreement", "fresh", "nonfinite"]

log = logging.getLogger("ddpad")


# relative tolerance of a check, by the least precise dtype at work: a compiler
# may fuse and reorder floating-point work the eager step does in order
_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _named(tree: Any) -> list[tuple[str, Any]]:
    """The leaves of ``tree`` with their names (``['energy']``; ``[0]`` for a tuple)."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [(pytree.keystr(path) or "[0]", leaf) for path, leaf in leaves]


def nonfinite(tree: Any) -> list[str]:
    """The names of the floating-point outputs in ``tree`` holding NaN or inf."""
    return [name for name, x in _named(tree)
            if isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all())]


def disagreement(out: Any, ref: Any, model: torch.nn.Module | None = None,
                 inputs: Iterable[Any] = ()) -> str | None:
    """None when every output of ``out`` matches ``ref``'s (the eager step's)
    within the tolerance of the least precise floating dtype among the
    outputs, ``model``'s parameters and the tensors among ``inputs`` (a
    float32 model's float64 outputs carry float32 work), else what differed.

    A NaN or inf of the eager step's agrees with the same NaN or inf in the
    same place (it is the step's own, not the compiler's: a padding defect
    is told apart by :func:`nonfinite`, not here); the finite values are
    compared within the tolerance."""
    got, want = _named(out), _named(ref)
    if len(got) != len(want):
        return f"{len(got)} outputs, the eager step {len(want)}"
    dtypes = {x.dtype for _, x in want if isinstance(x, torch.Tensor) and x.is_floating_point()}
    dtypes |= {p.dtype for p in (model.parameters() if model is not None else ()) if p.is_floating_point()}
    dtypes |= {x.dtype for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()}
    rtol = max((_RTOL.get(dtype, 1e-4) for dtype in dtypes), default=1e-4)
    for (name, a), (_, b) in zip(got, want):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {name}: {a!r} != {b!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {name}: {type(a).__name__}, the eager step a tensor"
        a, b = a.detach(), b.detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {name}: {tuple(a.shape)} {a.dtype}, the eager step {tuple(b.shape)} {b.dtype}"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {name} differs"
            continue
        finite = torch.isfinite(b)
        if not bool(finite.all()):  # the eager step's own NaN or inf: the compiled step must have the same
            if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite].nan_to_num(),
                                                                             b[~finite].nan_to_num()):
                return f"output {name}: NaN or inf in other places than the eager step's"
            a, b = a[finite], b[finite]
        scale = float(b.abs().max()) if b.numel() else 0.0
        tol = rtol * max(scale, 1.0)
        worst = float((a - b).abs().max()) if b.numel() else 0.0
        if not worst <= tol:  # (a NaN where the eager step is finite fails too)
            return f"output {name}: max deviation {worst:.3g} > {tol:.3g}"
    return None


def check(stats: Stats, model: torch.nn.Module | None, out: Any, eager: Callable[[], Any],
          inputs: Iterable[Any] = ()) -> tuple[Any, str | None]:
    """One first-use check: ``eager()``'s result (the eager step on the input
    the compiled step had) and what of ``out`` disagreed with it (None: all
    agreed; ``model`` and ``inputs`` as for :func:`disagreement`), counted and
    timed in ``stats``."""
    t0 = time.perf_counter()
    ref = eager()
    why = disagreement(out, ref, model, inputs)
    stats.checks += 1
    stats.disagreements += why is not None
    stats.check_seconds += time.perf_counter() - t0
    return ref, why


def fresh(data: Any) -> Any:
    """``data`` with new containers (dicts, lists, tuples) around the same
    tensors: a model that writes into its input dict (aimnet adds its
    intermediates to it) must not hand one route's autograd graph to the next."""
    return pytree.tree_map(lambda leaf: leaf, data)


def _copy(value: Any) -> Any:
    """A tensor input copied for the compiled graph's checked run (its own
    storage, the same ``requires_grad``: a graph that differentiates inside
    needs it); other inputs (symbolic sizes, ints) as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.requires_grad)


class CheckedGraph:
    """A graph compiled by a Dynamo backend, its first call checked against
    the same FX graph run eagerly.

    On the first call the compiled graph runs on copies of the inputs and
    the eager graph on the inputs themselves, and the eager outputs are
    returned (a graph that writes into an input writes once; the outputs
    differentiate to the inputs). If the outputs agree
    (:func:`disagreement`), the compiled graph answers from then on; if not,
    the eager graph does, with one warning. The forward is what is checked:
    a backward compiled for it (autograd through a graph break) is not.

    Parameters
    ----------
    compiled
        What the backend returned for ``graph``.
    graph
        The graph Dynamo handed the backend, as it was before the backend ran
        (its passes may rewrite it in place: pass a copy, see :meth:`before`).
    stats
        Where the check is counted (``checks``, ``disagreements``,
        ``check_seconds``; ``eager_forms`` for a graph that runs eagerly).
    """

    def __init__(self, compiled: Callable[..., Any], graph: torch.fx.GraphModule, stats: Stats) -> None:
        self.compiled = compiled
        self.eager = graph
        self.stats = stats
        self.run: Callable[..., Any] = self._first
        # Dynamo's disable() wrapper reads the name on every call: found here, not
        # through __getattr__ (a raised AttributeError per call)
        self.__name__ = getattr(compiled, "__name__", type(self).__name__)

    @staticmethod
    def before(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """``graph`` with its own copy of the FX graph (sharing its modules
        and constants), to run eagerly after a backend rewrote the original."""
        return torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def _first(self, *args: Any) -> Any:
        # the compiled graph runs on copies, the eager graph on the inputs: its
        # outputs are returned (they differentiate to the inputs, and a graph
        # that writes into an input writes once)
        copies = [_copy(a) for a in args]
        out = self.compiled(*copies)
        ref, why = check(self.stats, None, out, lambda: self.eager(*args), copies)
        if why is None:
            self.run = self.compiled
            return ref
        self.stats.eager_forms += 1
        self.run = self.eager
        log.warning("ddpad: a compiled graph disagrees with the same graph run eagerly on its first call (%s): it "
                    "runs eagerly from now on; a compiler bug: report it to PyTorch with the model", why)
        return ref

    def __getattr__(self, name: str) -> Any:  # what Dynamo or AOTAutograd read off the compiled function
        if name in ("compiled", "eager", "stats", "run") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.compiled, name)
