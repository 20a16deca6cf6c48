"""Compiling with a counting backend: every graph Dynamo compiles is recorded
(frame, call, compiled or loaded, seconds) and, with a compile store, loaded
from or saved to its entry."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._noise import quiet_warnings
from ._stats import Stats
from ._store import CompileStore, StoreBinding, bind_store, own_artifacts
from ._verify import CheckedGraph

__all__ = ["compile_model", "counting_backend", "run_step"]

log = logging.getLogger("ddpad")

_HAS_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters
_HAS_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters
# cap sets a wrapped model may compile beyond Dynamo's own recompile limit:
# each is one cache entry of the model's frames, and past the limit Dynamo
# runs the model eager without an error (grow-only buckets of x1.3 from 16
# to 10^6 rows are 42 growths per key)
_CAP_SET_ALLOWANCE = 64


def _cache_counts() -> tuple[int, ...]:
    """torch's cache counters (AOTAutograd hit, miss, saved, bypass; Inductor
    FX-graph hit, miss) so far."""
    counters = torch._dynamo.utils.counters
    aot, fx = counters["aot_autograd"], counters["inductor"]
    return (aot["autograd_cache_hit"], aot["autograd_cache_miss"], aot["autograd_cache_saved"],
            aot["autograd_cache_bypass"], fx["fxgraph_cache_hit"], fx["fxgraph_cache_miss"])


class _CountingBackend:
    """A Dynamo backend that records each compile event, then delegates
    (through a compile store when it has one); ``verify``: each graph's
    first call is checked against the graph run eagerly (:class:`CheckedGraph`)."""

    def __init__(self, inner: Callable[..., Any], stats: Stats, store: StoreBinding | None = None,
                 verify: bool = False) -> None:
        self.inner = inner
        self.stats = stats
        self.store = store
        self.verify = verify
        self.seen: set[str] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compile_id = torch._guards.CompileContext.current_compile_id()
        key = str(compile_id) if compile_id is not None else f"anonymous-{len(self.seen)}"
        if key not in self.seen:  # not a retry of this compile (a restarted analysis counts once)
            self.seen.add(key)
            self._count(compile_id)
        # a restart raised from inside the backend (e.g. by AOTAutograd) leaves
        # nothing counted as compiled or loaded: the retry is timed and stored
        eager = CheckedGraph.before(gm) if self.verify else None
        with quiet_warnings():  # torch's own deprecations, raised as it compiles or loads (tree specs)
            if self.store is None:
                compiled = self._timed(gm, example_inputs)
            else:
                compiled = self._through_store(self.store, gm, example_inputs)
        return compiled if eager is None else CheckedGraph(compiled, eager, self.stats)

    def _count(self, compile_id: Any) -> None:
        frame = getattr(compile_id, "frame_id", None)
        self.stats.record_graph(-1 if frame is None else int(frame))

    def _timed(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The inner compile, timed and sorted into compiled or loaded (an
        AOTAutograd or FX-graph cache hit loads instead of compiling)."""
        before = _cache_counts()
        t0 = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        seconds = time.perf_counter() - t0
        hit, miss, saved, bypass, fx_hit, fx_miss = (b - a for a, b in zip(before, _cache_counts()))
        # past torch's caches: AOTAutograd bypassed them, or missed and saved
        # nothing while Inductor had no graph to compile (no ops)
        self.stats.record_backend(seconds, loaded=bool(hit or fx_hit),
                                  uncached=bool(bypass or (miss and not saved and not fx_miss)))
        return compiled

    def _through_store(self, link: StoreBinding, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Load this graph's entry if the store has it; else compile it under
        the entry's lock (a process already compiling it is waited for, then
        loaded from) and save it before the graph first runs."""
        path = link.entry(gm, example_inputs)
        t0 = time.perf_counter()
        found = link.store.load(path)
        with contextlib.nullcontext(False) if found else link.store.lock(path) as compile_here:
            if not found and not compile_here:  # waited for another process's compile
                found = link.store.load(path)
            self.stats.load_seconds += time.perf_counter() - t0
            compiled_before, uncached_before = self.stats.graphs_compiled, self.stats.graphs_uncached
            loaded_before = self.stats.graphs_loaded
            # the artifacts of this graph only (torch's list is the process's, every model's, so far)
            with contextlib.nullcontext() if found else own_artifacts():
                compiled = self._timed(gm, example_inputs)
                if self.stats.graphs_uncached > uncached_before:  # torch keeps nothing of it: no entry
                    return compiled
                if not found:
                    link.save(path)  # before the graph runs: waiting ranks go on
            if found and self.stats.graphs_compiled > compiled_before:
                log.info("compile-store entry %s loaded, but torch's caches missed: compiled here", path.name)
        self.stats.store_hits += int(found)
        self.stats.store_misses += int(not found)
        self.stats.store_loads += int(found and self.stats.graphs_loaded > loaded_before)
        return compiled

    def __deepcopy__(self, memo: dict[int, Any]) -> _CountingBackend:
        # a recorder: a copy would count into a copy of the stats (lightning,
        # imported by nequip, deep-copies the arguments of torch.compile)
        return self

    def __getattr__(self, name: str) -> Any:  # reset(), get_compiler_config() ...
        if name == "inner" or name.startswith("__"):  # copy / pickle probe before __init__ ran
            raise AttributeError(name)
        return getattr(self.inner, name)


def _inner_backend(backend: str | Callable[..., Any], mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> Callable[..., Any]:
    """The backend ``torch.compile`` would build for these arguments."""
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    return torch._TorchCompileWrapper(backend, mode, options, dynamic)


def counting_backend(
    stats: Stats, backend: str | Callable[..., Any] = "inductor", *,
    mode: str | None = None, options: dict[str, Any] | None = None, dynamic: bool | None = None,
    compile_cache: str | os.PathLike[str] | CompileStore | None = None, model: torch.nn.Module | None = None,
    verify: bool = True,
) -> Callable[..., Any]:
    """A ``torch.compile`` backend that records each compile event in ``stats``
    (``graphs``, ``graphs_per_frame``, ``graphs_by_call``, ``recompiles``), then
    compiles with ``backend``. Hand it to an engine that compiles for you
    (e.g. nvalchemi's ``compile_kwargs={"backend": ...}``); the caller
    advances ``stats.calls``. With ``compile_cache`` (and the ``model``
    compiled, which keys the store) graphs go through a compile store
    (:func:`wrap`'s ``compile_cache``). With ``verify`` (default, as
    :func:`wrap`'s), each graph's first call is checked against the same
    graph run eagerly: a graph that disagrees runs eagerly from then on, with
    one warning (``stats.checks``, ``stats.disagreements``)."""
    store = None
    if compile_cache is not None:
        if model is None:
            raise ValueError("ddpad: counting_backend(compile_cache=...) needs model= (the store keys by it)")
        store = bind_store(model, compile_cache, backend=backend, mode=mode, options=options, dynamic=dynamic)
    return _CountingBackend(_inner_backend(backend, mode, options, dynamic), stats, store, verify)


def _compile_counted(
    model: Callable[..., Any], stats: Stats, store: StoreBinding | None, **compile_kwargs: Any
) -> Callable[..., Any]:
    kwargs = dict(compile_kwargs)
    backend = kwargs.pop("backend", "inductor")
    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None)
    dynamic = kwargs.pop("dynamic", None)
    if _HAS_ISOLATE:  # recompiles count against this compile's own limit only
        kwargs.setdefault("isolate_recompiles", True)
    if _HAS_LIMIT:  # growths are explained recompiles: Dynamo's limit stays for the unexplained ones
        kwargs.setdefault("recompile_limit", torch._dynamo.config.recompile_limit + _CAP_SET_ALLOWANCE)
    counting = _CountingBackend(_inner_backend(backend, mode, options, dynamic), stats, store)
    return torch.compile(model, backend=counting, dynamic=dynamic, **kwargs)


def compile_model(
    model: torch.nn.Module, stats: Stats, region: Callable[..., Any] | None,
    store: StoreBinding | None = None, **compile_kwargs: Any,
) -> Callable[..., Any]:
    """Compile ``model``, or only the part ``region`` picks (a model padding at
    its own seam compiles what comes after it)."""
    if region is None:
        return _compile_counted(model, stats, store, **compile_kwargs)
    return region(model, lambda part: _compile_counted(part, stats, store, **compile_kwargs))


def run_step(
    compiled: Callable[..., Any], call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
    data: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> Any:
    """One model step: through the adapter's ``call`` if it has one, with its
    Dynamo flags set for this call only (``config.patch`` restores them on
    exit, exceptions included)."""
    if not dynamo_config and call is None:  # nearly every model: nothing to set
        return compiled(data, *args, **kwargs)
    with torch._dynamo.config.patch(**dynamo_config) if dynamo_config else contextlib.nullcontext():
        if call is None:
            return compiled(data, *args, **kwargs)
        return call(compiled, data, *args, **kwargs)
