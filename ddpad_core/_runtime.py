"""The fixed-shape compiled forward: pad, run the compiled model, unpad, restore.

The framework side of SPEC section 4: :class:`PaddedModel` owns *when*
padding happens. Compiles are counted from Dynamo's own compile events (the
backend is called once per graph Dynamo compiles, with its compile id: frame
and attempt), not inferred.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import importlib.metadata
import inspect
import json
import logging
import os
import pathlib
import re
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from ._background import Background
from ._capacity import (
    AgreementError,
    CapacityError,
    CapResolution,
    _Scope,
    bucket,
    cap_ceilings,
    current_agreement,
    resolutions,
)
from ._context import DistributedContext, activate_dd_context, current_dd_context
from ._protocol import GraphPadder
from ._store import CompileStore, _atomic_write, _graph_key

if TYPE_CHECKING:
    from ddpad.adapters import Adapter

__all__ = [
    "CapEvent",
    "Evaluator",
    "PaddedModel",
    "RecompileError",
    "ShrinkPolicy",
    "Stats",
    "UnpaddedCompiled",
    "compile_counted",
    "counting_backend",
    "derive_ceilings",
    "load_caps",
    "resolve_adapter",
    "save_caps",
    "wrap",
]

log = logging.getLogger("ddpad")

_CAPS_FORMAT = "ddpad-caps/1"
_HAS_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters
_HAS_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters
# cap sets a wrapped model may compile beyond Dynamo's own recompile limit:
# each is one cache entry of the model's frames, and past the limit Dynamo
# runs the model eager without an error (grow-only buckets of x1.3 from 16
# to 10^6 rows are 42 growths per key)
_CAP_SET_ALLOWANCE = 64


class RecompileError(RuntimeError):
    """A graph was compiled that no capacity change explains (strict mode)."""


@dataclass(frozen=True)
class CapEvent:
    """A cap that changed on call ``call`` (0-based) from ``old`` to ``new``
    for ``real`` local rows (``need`` agreed rows, dead slots included)."""

    call: int
    key: str
    old: int
    new: int
    real: int
    need: int


@dataclass(frozen=True)
class ShrinkPolicy:
    """Optional, hysteretic cap shrinking (off unless passed to :func:`wrap`).

    A cap shrinks only after ``after`` consecutive calls in which its fill
    (agreed need / cap) stayed below ``below``; it then becomes
    ``bucket(max need over that stretch, factor)``, and only if that is
    smaller. Under an agreement group the needs are already MAX-reduced, so
    every rank sees the same fills and shrinks on the same call. A shrink
    costs a recompile unless that shape is still in Dynamo's cache.
    """

    below: float = 0.5
    after: int = 1000
    factor: float = 1.15

    def __post_init__(self) -> None:
        if not 0.0 < self.below < 1.0:
            raise ValueError(f"below must be in (0, 1), got {self.below!r}")
        if self.after < 1:
            raise ValueError(f"after must be >= 1, got {self.after!r}")
        if self.factor < 1.0:
            raise ValueError(f"factor must be >= 1.0, got {self.factor!r}")


@dataclass
class Stats:
    """What a :class:`PaddedModel` measured.

    Attributes
    ----------
    calls
        Forward calls so far.
    graphs
        Graphs Dynamo compiled (one backend call each; graph breaks compile
        several per call).
    graphs_per_frame
        ``{frame_id: graphs}``: compiles of each compiled Python frame.
    recompiles
        Compiles of a frame this model had compiled before.
    graphs_by_call
        ``{call: graphs}`` for every call that compiled something.
    growths, shrinks
        Cap changes (:class:`CapEvent`), first sizing excluded.
    caps
        Current caps.
    fill
        ``real / cap`` per key on the last call.
    pad_seconds, last_pad_seconds
        Time spent padding and unpadding, total and on the last call.
    pad_allocations, last_pad_allocations
        Cap-sized buffers the padder allocated, total and on the last call
        (zero in steady state; only a growth reallocates). ``None`` for a
        padder that does not report them.
    unexplained
        Guard-failure reasons of recompiles that no cap change explained.
    failed_growths
        Cap growths of calls that raised (rolled back, not in ``growths``).
    eager_steps
        Calls run unpadded and eager because a need exceeded its ceiling
        (``on_overflow="eager"``).
    graphs_compiled, graphs_loaded
        Of ``graphs``: those the backend compiled, and those it loaded from
        torch's caches (a compile-store entry, or torch's own on-disk cache).
    graphs_uncached
        Of ``graphs_compiled``: those torch compiled past its caches (a
        graph that only returns its inputs: AOTAutograd bypasses its cache,
        or misses and saves nothing, and Inductor has nothing to compile):
        nothing a store keeps, so every process compiles them again, in
        milliseconds.
    compile_seconds, load_seconds
        Backend time of the compiled graphs, and of the loaded graphs plus
        reading compile-store entries (Dynamo's tracing is in neither).
    store_hits, store_misses
        Graphs whose compile-store entry was there (and loaded) / was not.
    background_started, background_used, background_wasted
        Background compiles of the next bucket: started, whose caps a later
        growth reached, and finished or stopped without being reached.
    rungs_warmed, rungs_used, warm_seconds
        Ladder rungs compiled or loaded by the first call (``warm_ladder``),
        the growths that took a ready rung (warmed, or a background
        worker's caps), and the seconds warming took (part of the first call).
    """

    calls: int = 0
    graphs: int = 0
    graphs_per_frame: dict[int, int] = field(default_factory=dict)
    recompiles: int = 0
    graphs_by_call: dict[int, int] = field(default_factory=dict)
    growths: list[CapEvent] = field(default_factory=list)
    shrinks: list[CapEvent] = field(default_factory=list)
    caps: dict[str, int] = field(default_factory=dict)
    fill: dict[str, float] = field(default_factory=dict)
    pad_seconds: float = 0.0
    last_pad_seconds: float = 0.0
    pad_allocations: int | None = None
    last_pad_allocations: int | None = None
    unexplained: list[str] = field(default_factory=list)
    failed_growths: list[CapEvent] = field(default_factory=list)
    eager_steps: int = 0
    graphs_compiled: int = 0
    graphs_loaded: int = 0
    graphs_uncached: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    store_hits: int = 0
    store_misses: int = 0
    background_started: int = 0
    background_used: int = 0
    background_wasted: int = 0
    rungs_warmed: int = 0
    rungs_used: int = 0
    warm_seconds: float = 0.0

    def record(self, call: int, resolved: list[CapResolution]) -> bool:
        """Record the fills and growths of call ``call``'s cap resolutions;
        True when a known cap changed (first sizing is not a growth)."""
        changed = False
        for r in resolved:
            self.fill[r.key] = r.real / r.cap if r.cap else 0.0
            if r.old_cap is not None and r.cap != r.old_cap:
                changed = True
                self.growths.append(CapEvent(call, r.key, r.old_cap, r.cap, r.real, r.need))
        return changed

    @property
    def growth_calls(self) -> int:
        """Calls on which at least one cap grew (each costs one recompile)."""
        return len({event.call for event in self.growths})

    @property
    def max_graphs_per_frame(self) -> int:
        """Compiles of the most compiled frame: ``1 + growth_calls`` when
        padding holds (graph breaks add frames, not compiles per frame)."""
        return max(self.graphs_per_frame.values(), default=0)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "calls": self.calls,
            "graphs": self.graphs,
            "graphs_per_frame": dict(self.graphs_per_frame),
            "recompiles": self.recompiles,
            "graphs_by_call": dict(self.graphs_by_call),
            "growths": [vars(e) for e in self.growths],
            "shrinks": [vars(e) for e in self.shrinks],
            "caps": dict(self.caps),
            "fill": dict(self.fill),
            "pad_seconds": self.pad_seconds,
            "pad_allocations": self.pad_allocations,
            "unexplained": list(self.unexplained),
            "failed_growths": [vars(e) for e in self.failed_growths],
            "eager_steps": self.eager_steps,
            **{name: getattr(self, name) for name in _COMPILE_FIELDS},
        }


_COMPILE_FIELDS = (
    "graphs_compiled", "graphs_loaded", "compile_seconds", "load_seconds", "store_hits", "store_misses",
    "background_started", "background_used", "background_wasted", "graphs_uncached",
    "rungs_warmed", "rungs_used", "warm_seconds",
)


@dataclass
class _StoreLink:
    """A compile store and the key of one model in it; ``compiled`` are the
    entries this process compiled, saved again whenever torch recorded more
    artifacts since (what compiles lazily: a backward, run by the adapter's
    call or later by the caller)."""

    store: CompileStore
    model_key: str
    compiled: list[pathlib.Path] = field(default_factory=list)

    def save(self, path: pathlib.Path) -> None:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:  # nothing cacheable (a backend without torch's caches)
            return
        try:
            self.store.write(path, saved[0])
        except OSError as exc:
            log.warning("ddpad: cannot write compile-store entry %s (%s)", path, exc)

    def flush(self) -> None:
        """After each call, at close and at exit: re-save the compiled
        entries if torch recorded more artifacts since."""
        from torch.compiler._cache import CacheArtifactManager

        if self.compiled and CacheArtifactManager.need_serialize():
            for path in self.compiled:
                self.save(path)


def _cache_counts() -> tuple[int, ...]:
    """torch's cache counters (AOTAutograd hit, miss, saved, bypass; Inductor
    FX-graph hit, miss) so far."""
    counters = torch._dynamo.utils.counters
    aot, fx = counters["aot_autograd"], counters["inductor"]
    return (aot["autograd_cache_hit"], aot["autograd_cache_miss"], aot["autograd_cache_saved"],
            aot["autograd_cache_bypass"], fx["fxgraph_cache_hit"], fx["fxgraph_cache_miss"])


class _CountingBackend:
    """A Dynamo backend that records each compile event, then delegates
    (through a compile store when it has one)."""

    def __init__(self, inner: Callable[..., Any], stats: Stats, store: _StoreLink | None = None) -> None:
        self.inner = inner
        self.stats = stats
        self.store = store
        self.seen: set[str] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compile_id = torch._guards.CompileContext.current_compile_id()
        key = str(compile_id) if compile_id is not None else f"anonymous-{len(self.seen)}"
        if key not in self.seen:  # not a retry of this compile (a restarted analysis counts once)
            self.seen.add(key)
            self._count(compile_id)
        # a restart raised from inside the backend (e.g. by AOTAutograd) leaves
        # nothing counted as compiled or loaded: the retry is timed and stored
        if self.store is None:
            return self._timed(gm, example_inputs)
        return self._through_store(self.store, gm, example_inputs)

    def _count(self, compile_id: Any) -> None:
        frame = getattr(compile_id, "frame_id", None)
        frame = -1 if frame is None else int(frame)
        if frame in self.stats.graphs_per_frame:  # a frame this model compiled before
            self.stats.recompiles += 1
        self.stats.graphs += 1
        self.stats.graphs_per_frame[frame] = self.stats.graphs_per_frame.get(frame, 0) + 1
        call = self.stats.calls  # the call in progress
        self.stats.graphs_by_call[call] = self.stats.graphs_by_call.get(call, 0) + 1

    def _timed(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The inner compile, timed and sorted into compiled or loaded (an
        AOTAutograd or FX-graph cache hit loads instead of compiling)."""
        before = _cache_counts()
        t0 = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        seconds = time.perf_counter() - t0
        hit, miss, saved, bypass, fx_hit, fx_miss = (b - a for a, b in zip(before, _cache_counts()))
        if hit or fx_hit:
            self.stats.graphs_loaded += 1
            self.stats.load_seconds += seconds
        else:
            self.stats.graphs_compiled += 1
            self.stats.compile_seconds += seconds
            # past torch's caches: AOTAutograd bypassed them, or missed and
            # saved nothing while Inductor had no graph to compile (no ops)
            self.stats.graphs_uncached += bool(bypass or (miss and not saved and not fx_miss))
        return compiled

    def _through_store(self, link: _StoreLink, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Load this graph's entry if the store has it; else compile it under
        the entry's lock (a process already compiling it is waited for, then
        loaded from) and save it before the graph first runs."""
        path = link.store.entry(link.model_key, _graph_key(link.model_key, gm, example_inputs))
        t0 = time.perf_counter()
        found = link.store.load(path)
        with contextlib.nullcontext(False) if found else link.store.lock(path) as compile_here:
            if not found and not compile_here:  # waited for another process's compile
                found = link.store.load(path)
            self.stats.load_seconds += time.perf_counter() - t0
            compiled_before, uncached_before = self.stats.graphs_compiled, self.stats.graphs_uncached
            compiled = self._timed(gm, example_inputs)
            if self.stats.graphs_uncached > uncached_before:  # torch keeps nothing of it: no entry, no hit or miss
                return compiled
            if found and self.stats.graphs_compiled > compiled_before:
                log.info("compile-store entry %s loaded, but torch's caches missed: compiled here", path.name)
            if not found:
                link.save(path)  # before the graph runs: waiting ranks go on
                link.compiled.append(path)
        self.stats.store_hits += int(found)
        self.stats.store_misses += int(not found)
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
) -> Callable[..., Any]:
    """A ``torch.compile`` backend that records each compile event in ``stats``
    (``graphs``, ``graphs_per_frame``, ``graphs_by_call``, ``recompiles``), then
    compiles with ``backend``. Hand it to an engine that compiles for you
    (e.g. nvalchemi's ``compile_kwargs={"backend": ...}``); the caller
    advances ``stats.calls``. With ``compile_cache`` (and the ``model``
    compiled, which keys the store) graphs go through a compile store
    (:func:`wrap`'s ``compile_cache``)."""
    store = None
    if compile_cache is not None:
        if model is None:
            raise ValueError("ddpad: counting_backend(compile_cache=...) needs model= (the store keys by it)")
        store = store_link(model, compile_cache, backend=backend, mode=mode, options=options, dynamic=dynamic)
    return _CountingBackend(_inner_backend(backend, mode, options, dynamic), stats, store)


def compile_counted(model: Callable[..., Any], stats: Stats, **compile_kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(model, **compile_kwargs)`` whose compile events land in
    ``stats`` (see :func:`counting_backend`)."""
    return _compile_counted(model, stats, None, **compile_kwargs)


def _compile_counted(
    model: Callable[..., Any], stats: Stats, store: _StoreLink | None, **compile_kwargs: Any
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


def _compile_model(
    model: torch.nn.Module, stats: Stats, region: Callable[..., Any] | None,
    store: _StoreLink | None = None, **compile_kwargs: Any,
) -> Callable[..., Any]:
    """Compile ``model``, or only the part ``region`` picks (a model padding at
    its own seam compiles what comes after it)."""
    if region is None:
        return _compile_counted(model, stats, store, **compile_kwargs)
    return region(model, lambda part: _compile_counted(part, stats, store, **compile_kwargs))


def _run_step(
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


# the last count of Dynamo's guard-failure reasons, and the frame counter it was taken at
_GUARD_FAILURES: contextvars.ContextVar[tuple[Any, int, dict[Any, int]] | None] = contextvars.ContextVar(
    "ddpad_guard_failures", default=None
)


def _guard_failure_counts() -> Mapping[Any, int]:
    """Guard-failure reasons Dynamo recorded so far, per code object.

    Dynamo records them only while converting a frame, after counting the
    frame in ``counters["frames"]["total"]``; while that count (of the same
    counter object: ``counters.clear()`` replaces it) has not moved, the last
    count still holds, and a call costs two lookups instead of a scan."""
    utils = torch._dynamo.utils
    frames = utils.counters["frames"]
    total = frames["total"]
    last = _GUARD_FAILURES.get()
    if last is not None and last[0] is frames and last[1] == total:
        return last[2]
    counts = {code: len(reasons) for code, reasons in utils.guard_failures.items()}
    _GUARD_FAILURES.set((frames, total, counts))
    return counts


def _new_guard_failures(before: Mapping[Any, int]) -> list[str]:
    reasons: list[str] = []
    for code, listed in torch._dynamo.utils.guard_failures.items():
        reasons.extend(str(r) for r in listed[before.get(code, 0):])
    return reasons


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


def save_caps(caps: Mapping[str, int], path: str | os.PathLike[str], **meta: Any) -> None:
    """Write caps to ``path`` as JSON (with optional metadata, e.g. the adapter).

    Atomic: written to a temporary file beside ``path``, then renamed over it,
    so readers and concurrent writers never see a partial file.
    """
    doc = {"format": _CAPS_FORMAT, "caps": dict(caps), **meta}
    _atomic_write(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), prefix=".ddpad-caps-")


def derive_ceilings(caps: Mapping[str, int], peak_bytes: int, budget_bytes: int) -> dict[str, int]:
    """Ceilings that keep a step under ``budget_bytes``, from one step's peak
    memory at ``caps``, assuming memory grows linearly with every cap."""
    if peak_bytes <= 0:
        raise ValueError(f"peak_bytes must be > 0, got {peak_bytes}")
    scale = budget_bytes / peak_bytes
    return {key: max(1, int(cap * scale)) for key, cap in caps.items()}


def _restore(padder: Any) -> None:
    """Undo what the padder's last ``pad`` changed in the caller's input (a
    padder that changes nothing has no ``restore``)."""
    restore = getattr(padder, "restore", None)
    if callable(restore):
        restore()


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))
    )


def _call_form(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The non-tensor arguments of a call: a new form compiles a new graph."""
    if not args and not kwargs:
        return ()
    return (
        tuple(None if isinstance(a, torch.Tensor) else repr(a) for a in args),
        tuple(sorted((k, repr(v)) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))),
    )


class PaddedModel(torch.nn.Module):
    """A model that always runs at fixed, grow-only padded shapes.

    Takes the model's native input and returns its native output for the
    real atoms and systems only. Each call resolves all caps (one collective
    under an agreement group), pads, runs the (compiled) model, unpads and,
    in a ``finally``, restores what padding changed. Caps resolved by a call
    are committed only when it succeeds: a call that raises (out of memory,
    a model error) leaves the caps as they were. Build it with :func:`wrap`
    or ``adapter.wrap(model)``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        padder: GraphPadder,
        *,
        adapter: Adapter | None = None,
        pad_in_forward: bool = False,
        call: Callable[..., Any] | None = None,
        dynamo_config: Mapping[str, Any] | None = None,
        compile_region: Callable[[torch.nn.Module, Callable[[Any], Any]], Any] | None = None,
        compile: bool = True,
        caps: Mapping[str, int] | str | os.PathLike[str] | None = None,
        on_recompile: Literal["warn", "raise", "ignore"] = "warn",
        shrink: ShrinkPolicy | None = None,
        max_caps: Mapping[str, int] | None = None,
        memory_budget: int | None = None,
        on_overflow: Literal["raise", "eager"] = "raise",
        compile_cache: str | os.PathLike[str] | CompileStore | None = None,
        background_compile: float | None = None,
        background_workers: int = 1,
        warm_ladder: int = 0,
        **compile_kwargs: Any,
    ) -> None:
        super().__init__()
        if on_recompile not in ("warn", "raise", "ignore"):
            raise ValueError(f"on_recompile must be 'warn', 'raise' or 'ignore', got {on_recompile!r}")
        if on_overflow not in ("raise", "eager"):
            raise ValueError(f"on_overflow must be 'raise' or 'eager', got {on_overflow!r}")
        if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1):
            raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
        if isinstance(warm_ladder, bool) or not isinstance(warm_ladder, int) or warm_ladder < 0:
            raise ValueError(f"warm_ladder must be a number of rungs >= 0, got {warm_ladder!r}")
        if not isinstance(padder, GraphPadder):
            raise TypeError(f"padder {padder!r} does not implement GraphPadder (pad / unpad)")
        self.model = model
        self.padder = padder
        self.adapter = adapter
        self.pad_in_forward = pad_in_forward
        self.call = call
        self.dynamo_config = dict(dynamo_config or {})
        self.on_recompile = on_recompile
        self.on_overflow = on_overflow
        self.shrink = shrink
        self.memory_budget = memory_budget
        with cap_ceilings(max_caps):  # validates them
            self.max_caps: dict[str, int] = dict(max_caps or {})
        name = adapter.name if adapter is not None else None
        self.cap_state: dict[str, int] = (
            load_caps(caps, adapter=name, ceilings=self.max_caps) if caps is not None else {}
        )
        self._loaded_keys = set(self.cap_state)
        self.stats = Stats(caps=self.cap_state)
        self._low: dict[str, tuple[int, int]] = {}  # key -> (streak, max need)
        self._forms: set[tuple[Any, ...]] = set()  # (call form, caps) that ran
        self.last_resolutions: list[CapResolution] = []  # of the last call that sized or grew a cap
        self.warm_ladder = warm_ladder
        # caps whose graphs are ready (warmed) or compiling (a background worker)
        self.rungs: list[dict[str, int]] = []
        self.compiled: Callable[..., Any] = model
        self.store: _StoreLink | None = None
        self.background: Background | None = None
        if compile:
            compile_kwargs.setdefault("dynamic", False)
            if compile_cache is not None:
                self.store = store_link(model, compile_cache, adapter, self.dynamo_config, **compile_kwargs)
                weakref.finalize(self, self.store.flush)  # a backward compiled after the last call
            if background_compile is not None:
                if self.store is None or adapter is None:
                    raise ValueError("ddpad: background_compile needs compile_cache= and an adapter (its workers "
                                     "compile into the store and rebuild the padder from the adapter)")
                self.background = Background(self, float(background_compile), background_workers, compile_kwargs)
            self.compiled = _compile_model(model, self.stats, compile_region, self.store, **compile_kwargs)
        elif compile_kwargs or compile_cache is not None or background_compile is not None or warm_ladder:
            given = sorted([*compile_kwargs, *(["compile_cache"] if compile_cache is not None else []),
                            *(["background_compile"] if background_compile is not None else []),
                            *(["warm_ladder"] if warm_ladder else [])])
            raise TypeError(f"compile=False takes no compile arguments, got {given}")

    # -- the call -------------------------------------------------------------

    def forward(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        stats = self.stats
        call, graphs_before, recompiles_before = stats.calls, stats.graphs, stats.recompiles
        allocations_before = getattr(self.padder, "allocations", None)
        failures_before = _guard_failure_counts() if self.on_recompile != "ignore" else {}
        agreement = current_agreement()
        exchanges_before = agreement.step if agreement is not None else 0
        trial = dict(self.cap_state)  # committed only if the call succeeds
        measure = self.memory_budget is not None and call == 0
        pad_seconds = 0.0
        with _Scope(self.max_caps, self.rungs) as rows:  # the call's resolutions (plain tuples) under its ceilings
            try:
                if measure:
                    _reset_peak(data)
                if self.pad_in_forward:  # the model pads at its own seam
                    with activate_dd_context(self._context(trial)):
                        out = self._run(data, args, kwargs)
                else:
                    t0 = time.perf_counter()
                    padded = self.padder.pad(data, trial)
                    pad_seconds += time.perf_counter() - t0
                    out = self._run(padded, args, kwargs)
                t0 = time.perf_counter()
                out = self.padder.unpad(out)
                pad_seconds += time.perf_counter() - t0
            except CapacityError as exc:  # a ceiling: every rank sees the same agreed need
                if self.on_overflow != "eager" or trial != self.cap_state:
                    raise
                log.warning("%s; running this step unpadded and eager", exc)
                out = self._eager(data, args, kwargs)
                stats.eager_steps += 1
                stats.calls += 1
                return out
            except Exception as exc:
                self._report_failure(agreement, exchanges_before, exc)
                self._fail(call, resolutions(rows), exc)
            finally:
                _restore(self.padder)
        self.cap_state.update(trial)  # the call succeeded: commit its caps
        if measure:
            self._derive_ceilings(data)
        if call == 0 and self.warm_ladder:
            self._warm(data, args, kwargs, resolutions(rows))
        stats.calls += 1
        stats.pad_seconds += pad_seconds
        stats.last_pad_seconds = pad_seconds
        if allocations_before is not None:
            stats.pad_allocations = self.padder.allocations  # type: ignore[attr-defined]
            stats.last_pad_allocations = self.padder.allocations - allocations_before  # type: ignore[attr-defined]
        # the form that ran (before a shrink changes the caps)
        form = (_call_form(args, kwargs), tuple(self.cap_state.items()))  # (keys keep their order)
        new_form = form not in self._forms
        self._forms.add(form)
        if call == 0 or self.shrink is not None or self.background is not None or any(r[3] != r[4] for r in rows):
            resolved = resolutions(rows)
            stats.record(call, resolved)
            self.last_resolutions = resolved  # what sized the caps (policies included)
            if self.background is not None:
                self.background.after_call(self, data, args, kwargs, resolved)
            if call and self.rungs and self.cap_state in self.rungs and any(r.grew for r in resolved):
                stats.rungs_used += 1
            if call == 0:
                self._check_loaded_keys(resolved)
            if self.shrink is not None:
                self._maybe_shrink(call, resolved)
        else:  # nothing sized or grew (nearly every call): only the fills changed
            for key, real, _, _, cap, _ in rows:
                stats.fill[key] = real / cap if cap else 0.0
        # a compile is explained by caps or a call form (keywords) not run before
        if stats.recompiles > recompiles_before and not new_form:
            self._unexplained(call, stats.graphs - graphs_before, failures_before)
        return out

    def _run(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.store is None:
            return _run_step(self.compiled, self.call, self.dynamo_config, data, args, kwargs)
        try:
            return _run_step(self.compiled, self.call, self.dynamo_config, data, args, kwargs)
        finally:
            self.store.flush()  # what compiled lazily in this call (a backward) joins its entry

    def close(self) -> None:
        """Stop this model's background compiles (a worker stopped mid-compile
        leaves no entry, only its lock file) and save what compiled lazily."""
        if self.background is not None:
            self.background.close()
        if self.store is not None:
            self.store.flush()

    def __enter__(self) -> PaddedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _warm(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any], resolved: list[CapResolution]) -> None:
        """Compile (or load from the store) the next ``warm_ladder`` rungs on
        this first call's input, the way a server captures its batch sizes
        before serving: a growth that fits a rung then takes it and only
        switches graphs. Each rung runs twice (its compile, then a steady
        call) and the run's own caps once more, so that neither a growth's
        step nor the next step is the first steady call after a compile
        (which costs about 3 steady calls). On a copy of the padder: the
        run's buffers stay."""
        from ._background import ladder

        if current_agreement() is not None or (self.pad_in_forward and current_dd_context().graph_padder is not None):
            log.warning("ddpad: warm_ladder is off under an agreement group or a framework's padding context "
                        "(a rank's warm calls may hold collectives its peers do not make); growths compile "
                        "when they come")
            return
        rungs = [caps for caps in ladder(self.cap_state, resolved, self.warm_ladder)
                 if all(caps[k] <= self.max_caps.get(k, caps[k]) for k in caps)]
        padder = copy.deepcopy(self.padder)
        form = _call_form(args, kwargs)
        t0 = time.perf_counter()
        for caps in rungs:
            if not (self._warm_call(padder, caps, data, args, kwargs)
                    and self._warm_call(padder, caps, data, args, kwargs)):
                break
            self._forms.add((form, tuple(caps.items())))
            self.rungs.append(caps)
            self.stats.rungs_warmed += 1
            log.info("warmed caps %s", caps)
        self._warm_call(padder, self.cap_state, data, args, kwargs)
        self.stats.warm_seconds += time.perf_counter() - t0

    def _warm_call(self, padder: GraphPadder, caps: Mapping[str, int], data: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> bool:
        """One call of the compiled model at ``caps`` through ``padder``;
        False (and a warning) when it raised: the first call's own result
        stands, and growths past these caps compile when they come."""
        state = dict(caps)
        try:
            if self.pad_in_forward:
                with activate_dd_context(self._context(state, padder)):
                    self._run(data, args, kwargs)
            else:
                self._run(padder.pad(data, state), args, kwargs)
        except Exception as exc:  # noqa: BLE001 - reported; the run goes on
            log.warning("ddpad: warming caps %s failed (%s: %s); no rung from there up is warmed", caps,
                        type(exc).__name__, exc)
            return False
        finally:
            _restore(padder)
        return True

    def _eager(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The unpadded, uncompiled model (``on_overflow="eager"``)."""
        if self.adapter is not None:
            return self.adapter.reference(self.model, data, *args, **kwargs)
        return self.model(data, *args, **kwargs)

    def _report_failure(self, agreement: Any, exchanges_before: int, exc: BaseException) -> None:
        """Let the peers of an agreement group learn of this rank's failure on
        this step (before the exchange) or the next one (after it)."""
        if agreement is None or isinstance(exc, AgreementError):
            return
        reason = f"{type(exc).__name__}: {exc}"
        if agreement.step == exchanges_before:
            agreement.fail(reason)
        else:
            agreement.failed = reason

    def _fail(self, call: int, resolved: list[CapResolution], exc: Exception) -> None:
        """Record the failed call's growths and re-raise; out of memory after
        a growth becomes a :class:`CapacityError` naming the caps."""
        grown = [r for r in resolved if r.grew]
        for r in grown:
            if r.old_cap is not None:
                self.stats.failed_growths.append(CapEvent(call, r.key, r.old_cap, r.cap, r.real, r.need))
        described = ", ".join(
            f"{r.key!r} {r.old_cap if r.old_cap is not None else 'new'} -> {r.cap} for real {r.real}" for r in grown
        )
        if grown and _is_out_of_memory(exc):
            raise CapacityError(
                f"ddpad: call {call} ran out of memory after sizing caps ({described}); the caps are "
                f"rolled back to {self.cap_state}. Set max_caps / memory_budget to bound them, or "
                f"on_overflow='eager'. ({type(exc).__name__}: {exc})"
            ) from exc
        if described:
            exc.add_note(f"ddpad: the failed call sized caps ({described}); rolled back to {self.cap_state}")
        raise exc

    def _context(self, cap_state: dict[str, int], padder: GraphPadder | None = None) -> DistributedContext:
        """The context the model's seam pads through: the active one's mesh and
        metadata (a framework's), with this wrapper's padder (or ``padder``)
        and caps."""
        outer = current_dd_context()
        if outer.graph_padder is not None:
            return outer  # a framework already drives padding
        inherited = {f.name: getattr(outer, f.name) for f in dataclasses.fields(DistributedContext)}
        return DistributedContext(**{**inherited, "cap_state": cap_state, "graph_padder": padder or self.padder})

    def _check_loaded_keys(self, resolved: list[CapResolution]) -> None:
        unknown = self._loaded_keys - {r.key for r in resolved}
        if unknown:
            warnings.warn(
                f"ddpad: preset caps {sorted(unknown)} are not used by this model's padder "
                f"(it resolves {sorted(r.key for r in resolved)})",
                RuntimeWarning,
                stacklevel=3,
            )

    def _derive_ceilings(self, data: Any) -> None:
        assert self.memory_budget is not None
        peak = _peak_bytes(data)
        derived = derive_ceilings(self.cap_state, peak, self.memory_budget)
        self.max_caps = {k: min(v, self.max_caps.get(k, v)) for k, v in derived.items()}
        log.info("memory budget %d B, peak %d B at caps %s: ceilings %s", self.memory_budget, peak, self.cap_state, self.max_caps)

    def _maybe_shrink(self, call: int, resolved: list[CapResolution]) -> None:
        policy = self.shrink
        assert policy is not None
        for r in resolved:
            streak, high = self._low.get(r.key, (0, 0))
            if r.cap and r.need / r.cap < policy.below:
                streak, high = streak + 1, max(high, r.need)
            else:
                streak, high = 0, 0
            self._low[r.key] = (streak, high)
            if streak < policy.after:
                continue
            self._low[r.key] = (0, 0)
            stride = r.policy.stride
            new = max(stride, bucket(high, policy.factor, stride))
            if new < self.cap_state[r.key]:
                event = CapEvent(call, r.key, self.cap_state[r.key], new, r.real, high)
                self.stats.shrinks.append(event)
                self.cap_state[r.key] = new
                log.info(
                    "%s fill below %.2f for %d calls (max need %d): shrink %d -> %d, expect one recompile",
                    r.key, policy.below, policy.after, high, event.old, new,
                )

    def _unexplained(self, call: int, graphs: int, failures_before: Mapping[Any, int]) -> None:
        reasons = _new_guard_failures(failures_before) or ["(Dynamo gave no guard-failure reason)"]
        message = (
            f"ddpad: call {call} compiled {graphs} graph(s) although no cap changed; "
            f"Dynamo's guard failure: {' | '.join(reasons)}. Something other than the "
            "padded shapes varies between calls (dtype, device, requires_grad, a Python "
            "argument, or an unpadded field)."
        )
        self.stats.unexplained.append(message)
        if self.on_recompile == "raise":
            raise RecompileError(message)
        if self.on_recompile == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- caps -------------------------------------------------------------------

    @property
    def caps(self) -> dict[str, int]:
        """The current caps (a copy)."""
        return dict(self.cap_state)

    def save_caps(self, path: str | os.PathLike[str]) -> None:
        """Write the current caps to JSON for a warm restart (``caps=path``),
        atomically, with the adapter's name (checked when loaded)."""
        meta = {"adapter": self.adapter.name} if self.adapter is not None else {}
        save_caps(self.cap_state, path, **meta)

    def load_caps(self, source: Mapping[str, int] | str | os.PathLike[str]) -> None:
        """Preset caps (they still grow if a real count overflows them)."""
        name = self.adapter.name if self.adapter is not None else None
        loaded = load_caps(source, adapter=name, ceilings=self.max_caps)
        self.cap_state.update(loaded)
        self._loaded_keys |= set(loaded)


def store_link(model: torch.nn.Module, compile_cache: str | os.PathLike[str] | CompileStore,
               adapter: Adapter | None = None, dynamo_config: Mapping[str, Any] | None = None,
               **compile_kwargs: Any) -> _StoreLink:
    """``model``'s place in a compile store, for :func:`counting_backend`'s
    ``store`` (engines that call ``torch.compile`` themselves)."""
    store = compile_cache if isinstance(compile_cache, CompileStore) else CompileStore(compile_cache)
    environment = _store_environment(adapter, dynamo_config or {}, compile_kwargs)
    return _StoreLink(store, store.model_key(model, **environment))


def _store_environment(adapter: Adapter | None, dynamo_config: Mapping[str, Any],
                       compile_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What besides the model changes its compiled code: adapter and model
    package version, backend, mode, options, ``dynamic``, Dynamo flags."""
    package = None
    for requirement in adapter.requires if adapter is not None else ():
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            package = f"{name}=={importlib.metadata.version(name)}"
            break
    backend = compile_kwargs.get("backend", "inductor")
    return {
        "adapter": adapter.name if adapter is not None else None,
        "package": package,
        "backend": backend if isinstance(backend, str) else f"{type(backend).__module__}.{type(backend).__qualname__}",
        "compile": {k: v for k, v in compile_kwargs.items() if k != "backend"},
        "dynamo_config": dict(dynamo_config),
    }


def _first_tensor(data: Any) -> torch.Tensor | None:
    values = data.values() if isinstance(data, Mapping) else getattr(data, "__dict__", {}).values()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _reset_peak(data: Any) -> None:
    tensor = _first_tensor(data)
    if tensor is None or tensor.device.type != "cuda":
        raise ValueError(
            "ddpad: memory_budget measures the first step's peak with torch.cuda.max_memory_allocated "
            "and needs a CUDA input; on other devices give max_caps={key: ceiling}"
        )
    torch.cuda.reset_peak_memory_stats(tensor.device)


def _peak_bytes(data: Any) -> int:
    tensor = _first_tensor(data)
    assert tensor is not None
    return int(torch.cuda.max_memory_allocated(tensor.device))


def resolve_adapter(adapter: Adapter | str) -> Adapter:
    """An :class:`~ddpad.adapters.Adapter`, looked up by name if need be."""
    if isinstance(adapter, str):
        from ddpad import adapters

        return adapters.get(adapter)
    return adapter


class UnpaddedCompiled:
    """The adapter's model compiled *without* padding: what ddpad is measured
    against (``ddpad bench``, ``ddpad.torchsim.Model(pad=False)``). Compile
    events land in ``stats``; every call advances ``stats.calls``."""

    def __init__(self, model: torch.nn.Module, adapter: Adapter | str, **compile_kwargs: Any) -> None:
        self.adapter = resolve_adapter(adapter)
        prepared = self.adapter.prepare_model(model) if self.adapter.prepare_model is not None else model
        self.stats = Stats()
        # outside a ddpad context a seam (compile_region) pads nothing
        self.compiled = _compile_model(prepared, self.stats, self.adapter.compile_region, **compile_kwargs)

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(data, Mapping):  # the model may write into its input; inputs
            # that require grad stay connected (the caller differentiates them)
            data = {k: (_private_copy(v) if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
        try:
            return _run_step(self.compiled, self.adapter.call, self.adapter.dynamo_config, data, args, kwargs)
        finally:
            self.stats.calls += 1


def _private_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.requires_grad else tensor.detach().clone()


_PADDING_OPTIONS = frozenset({"padder", "caps", "on_recompile", "shrink", "max_caps", "memory_budget", "on_overflow",
                              "compile_cache", "background_compile", "background_workers", "warm_ladder"})


class Evaluator:
    """``atoms -> flat properties`` for engine integrations (ASE, torch-sim):
    builds the adapter's native input and runs the padded model (``pad=True``),
    the unpadded compiled model (``pad=False, compile=True``) or the plain
    eager model (``pad=False, compile=False``, the reference)."""

    def __init__(self, model: torch.nn.Module, adapter: Adapter | str, *, pad: bool = True,
                 compile: bool = True, **wrap_kwargs: Any) -> None:
        self.adapter = resolve_adapter(adapter)
        self.model = model
        self.build = self.adapter.input_builder(model)
        self.wrapped: PaddedModel | None = wrap(model, self.adapter, compile=compile, **wrap_kwargs) if pad else None
        compile_kwargs = {k: v for k, v in wrap_kwargs.items() if k not in _PADDING_OPTIONS}
        self.unpadded = UnpaddedCompiled(model, self.adapter, **compile_kwargs) if compile and not pad else None

    @property
    def stats(self) -> Stats | None:
        """Compile and cap statistics (``None`` for the plain eager model)."""
        runner = self.wrapped if self.wrapped is not None else self.unpadded
        return None if runner is None else runner.stats

    def __call__(self, atoms: Any, *, stress: bool = False, **kwargs: Any) -> dict[str, Any]:
        data = self.build(atoms)
        options = {**self.adapter.call_options(stress), **kwargs}
        if self.wrapped is not None:
            out = self.wrapped(data, **options)
        elif self.unpadded is not None:
            out = self.unpadded(data, **options)
        else:
            out = self.adapter.reference(self.model, data, **options)
        return self.adapter.flat(out)


def wrap(
    model: torch.nn.Module,
    adapter: Adapter | str,
    *,
    compile: bool = True,
    padder: GraphPadder | None = None,
    caps: Mapping[str, int] | str | os.PathLike[str] | None = None,
    on_recompile: Literal["warn", "raise", "ignore"] = "warn",
    shrink: ShrinkPolicy | None = None,
    max_caps: Mapping[str, int] | None = None,
    memory_budget: int | None = None,
    on_overflow: Literal["raise", "eager"] = "raise",
    compile_cache: str | os.PathLike[str] | CompileStore | None = None,
    background_compile: float | None = None,
    background_workers: int = 1,
    warm_ladder: int = 0,
    **compile_kwargs: Any,
) -> PaddedModel:
    """Wrap ``model`` so it always runs at fixed padded shapes.

    Parameters
    ----------
    model
        The model, called with its native input.
    adapter
        An :class:`~ddpad.adapters.Adapter` or a registered name (``"mace"``).
    compile
        Compile the model with ``torch.compile`` (``dynamic=False`` unless
        given); ``backend``, ``mode``, ``fullgraph``, ``options`` pass through.
    padder
        Override the adapter's padder.
    caps
        Preset caps: a dict or a JSON file from :meth:`PaddedModel.save_caps`.
    on_recompile
        What to do when a graph compiles that no cap change explains:
        ``"warn"`` (default), ``"raise"`` (:class:`RecompileError`), ``"ignore"``.
    shrink
        A :class:`ShrinkPolicy` to let caps shrink after long low fill; off by default.
    max_caps
        Per-key ceilings (``{"edges": 200_000}``): a growth stops there, and a
        need beyond raises :class:`CapacityError` (or see ``on_overflow``).
    memory_budget
        Bytes a step may use (CUDA): ceilings are derived from the first
        step's measured peak, assuming memory linear in every cap.
    on_overflow
        ``"raise"`` (default) or ``"eager"``: run a step whose need exceeds a
        ceiling unpadded and eager, and carry on.
    compile_cache
        A directory (or :class:`CompileStore`) keeping what compiling
        produced, keyed by the model's architecture, caps, backend and
        versions: a later process (a restart, the next job, another rank)
        loads instead of compiling, and processes compiling the same graph
        at once compile it once (the others wait and load).
    background_compile
        A fill threshold (e.g. ``0.9``; needs ``compile_cache``): when a cap's
        fill passes it, a worker process compiles the cap's next bucket into
        the store, so the growth only loads. Stop workers with
        :meth:`PaddedModel.close` or a ``with`` block (also done at exit).
    background_workers
        At most this many background compiles at once.
    warm_ladder
        The first call also compiles (or, from ``compile_cache``, loads) the
        next ``warm_ladder`` rungs of caps, each one bucket up in every count
        but the number of systems; a later growth takes the smallest rung
        that fits and runs a ready graph: no stall in the run, a longer first
        call, and caps up to one rung larger than a growth alone would pick.
        Off under an agreement group.
    """
    adapter = resolve_adapter(adapter)
    model = adapter.prepare_model(model) if adapter.prepare_model is not None else model
    return padded_model(
        model, adapter, padder=padder, compile=compile, caps=caps, on_recompile=on_recompile, shrink=shrink,
        max_caps=max_caps, memory_budget=memory_budget, on_overflow=on_overflow, compile_cache=compile_cache,
        background_compile=background_compile, background_workers=background_workers, warm_ladder=warm_ladder,
        **compile_kwargs,
    )


def padded_model(model: torch.nn.Module, adapter: Adapter, *, padder: GraphPadder | None = None,
                 **options: Any) -> PaddedModel:
    """:func:`wrap` for a model ``adapter.prepare_model`` has already prepared
    (what a background worker rebuilds)."""
    return PaddedModel(
        model,
        padder if padder is not None else adapter.make_padder(model),
        adapter=adapter,
        pad_in_forward=adapter.pad_in_forward,
        call=adapter.call,
        dynamo_config=adapter.dynamo_config,
        compile_region=adapter.compile_region,
        **options,
    )
