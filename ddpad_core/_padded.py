"""The fixed-shape forward: pad, run the compiled model, unpad, restore.

The framework side of SPEC section 4: :class:`PaddedModel` owns *when*
padding happens, and nothing else: the caps it resolves are committed only
when a call succeeds (a call that raises rolls them back). Compiling
(:mod:`._compile`), the store (:mod:`._store`), ready rungs (:mod:`._ladder`,
:mod:`._warm`, :mod:`._background`), shrinking, memory ceilings, strict
mode and statistics live in their own modules.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import pathlib
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._agreement import AgreementError, current_agreement
from ._aot import AotRoute
from ._background import PACKAGE_BUILD, Background, PackageBuilds
from ._capacity import CapacityError, CapResolution, TightCaps, _Scope, record_resolutions, resolutions
from ._caps_file import caps_fitted, load_caps, save_caps
from ._compile import compile_model, run_step
from ._context import DistributedContext, activate_dd_context, current_dd_context
from ._ladder import Ladder
from ._memory import derive_ceilings, measure_peak, reset_peak
from ._noise import CompileEvent, CompileNotice
from ._options import WrapOptions
from ._protocol import GraphPadder
from ._shrink import Shrinker
from ._stats import Stats, caps_changed
from ._store import CompileStore, StoreBinding, aot_binding, bind_store
from ._strict import RecompileError, call_form, guard_failure_counts, unexplained
from ._verify import FirstUse
from ._warm import warm, warm_rungs

if TYPE_CHECKING:
    from ._adapter import Adapter

__all__ = ["PaddedModel"]

log = logging.getLogger("ddpad")


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


class _Turns:
    """One call at a time: a thread waits for another's call to end; a call
    from inside a call (the same thread) raises. A plain object, not module
    attributes: ``nn.Module.__setattr__`` costs microseconds a call."""

    __slots__ = ("holder", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: int | None = None  # the thread in a call

    def take(self) -> None:
        me = threading.get_ident()
        if not self.lock.acquire(blocking=False):
            if self.holder == me:
                raise RuntimeError("ddpad: a PaddedModel was called from inside its own call (re-entry); "
                                   "call the inner model, or wrap it separately")
            self.lock.acquire()  # another thread's call: take turns
        self.holder = me

    def give(self) -> None:
        self.holder = None
        self.lock.release()

    def __reduce__(self) -> tuple[type[_Turns], tuple[()]]:
        return _Turns, ()  # a copy (deepcopy, pickle) of a model gets its own turns, free


class PaddedModel(torch.nn.Module):
    """A model that always runs at fixed, grow-only padded shapes.

    Takes the model's native input and returns its native output for the
    real atoms and systems only. Each call resolves all caps (one collective
    under an agreement group), pads, runs the (compiled) model, unpads and,
    in a ``finally``, restores what padding changed. Caps resolved by a call
    are committed only when it succeeds: a call that raises (out of memory,
    a model error) leaves the caps as they were. Calls are serialised: a
    second thread waits for the first (the padder's buffers are the one
    input of the compiled graph), and a call from inside a call raises.

    Users build it with :func:`~ddpad.wrap` (or ``adapter.wrap(model)``);
    this constructor takes the padder and the adapter's hooks directly, and
    the options of :func:`~ddpad.wrap` as keywords.
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
        source: torch.nn.Module | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        opts = WrapOptions.from_kwargs(**options)
        if not isinstance(padder, GraphPadder):
            raise TypeError(f"padder {padder!r} does not implement GraphPadder (pad / unpad)")
        self.options = opts
        self.model = model
        self.padder = padder
        self.adapter = adapter
        self.pad_in_forward = pad_in_forward
        self.call = call  # the adapter's step: (compiled, input, ...) -> output, or None
        # the model before the adapter prepared it (None: not prepared): what a worker prepares again
        self.__dict__["source"] = source  # (not a submodule: no second copy of the weights in state_dict)
        self.dynamo_config = dict(dynamo_config or {})
        self.on_recompile = opts.on_recompile
        self.max_caps: dict[str, int] = dict(opts.max_caps)  # lowered by a memory budget
        name = adapter.name if adapter is not None else None
        self.cap_state: dict[str, int] = (
            load_caps(opts.caps, adapter=name, ceilings=self.max_caps) if opts.caps is not None else {}
        )
        self._loaded_keys = set(self.cap_state)
        self.ladder = Ladder()
        self.stats = Stats(caps=dict(self.cap_state), ladder=self.ladder)
        self.sizer: TightCaps | None = None  # cap_policy="tight" (set below, once the store is bound)
        self.shrinker: Shrinker | None = None
        self._forms: set[tuple[Any, ...]] = set()  # (call form, caps) that ran compiled
        self.last_resolutions: list[CapResolution] = []  # of the last call that sized or grew a cap
        self._turns = _Turns()
        self.compiled: Callable[..., Any] = model
        self.store_binding: StoreBinding | None = None
        self.background: Background | None = None
        self.aot: AotRoute | None = None  # compile_mode="aot": packages first, torch.compile where refused
        self.package_builds: PackageBuilds | None = None  # aot_build="background": the packages' workers
        # every compiled graph's first call (per caps and call form) checked against the eager step
        self.checks = FirstUse(self.stats, model) if opts.compile and opts.verify else None
        if opts.compile:
            compile_kwargs = dict(opts.compile_kwargs)
            if opts.compile_cache is not None:  # None for a backend with nothing to store (said once)
                self.store_binding = bind_store(model, opts.compile_cache, adapter, self.dynamo_config,
                                                **compile_kwargs)
            if self.store_binding is not None:
                weakref.finalize(self, self.store_binding.flush)  # a backward compiled after the last call
            cache = opts.compile_cache
            root = pathlib.Path(cache.root if isinstance(cache, CompileStore) else cache).expanduser() \
                if cache is not None else None
            if opts.background_compile is not None:
                if adapter is None:
                    raise ValueError("ddpad: background_compile needs compile_cache= and an adapter (its workers "
                                     "compile into the store and rebuild the padder from the adapter)")
                # (under compile_mode="aot" its workers build the next rung's package)
                assert root is not None  # (WrapOptions: background_compile needs compile_cache)
                self.background = Background(self, self.ladder, root,
                                             float(opts.background_compile), opts.background_workers, compile_kwargs,
                                             options=PACKAGE_BUILD if opts.compile_mode == "aot" else None)
            if opts.compile_mode == "aot":
                self.aot = self._aot_route(opts, adapter)
                if self.aot is not None and root is not None and self._builds_elsewhere(opts, adapter):
                    self.package_builds = PackageBuilds(self, root, opts.background_workers, compile_kwargs,
                                                        self.stats)
            if self.aot is None:
                self.compiled = compile_model(model, self.stats, compile_region, self.store_binding,
                                              **compile_kwargs)
            else:  # torch.compile only for a form the packages refuse: importing Dynamo takes seconds
                self._compile_later = (compile_region, compile_kwargs)
        tight = opts.tight_policy(self.store_binding is not None)
        if tight is not None:  # preset caps a tight run fitted are kept; others are fitted after the window
            fitted = bool(self.cap_state) and opts.caps is not None and caps_fitted(opts.caps)
            if opts.warm_ladder:  # fit on the first call, as ddpad precompile does: the ladder is warmed
                tight = dataclasses.replace(tight, settle=1)  # before the run, not in a stall ten steps in
            self.sizer = TightCaps(tight, settled=fitted)
            if self.background is not None:
                self.background.sizer = self.sizer
        if opts.shrink is not None:
            self.shrinker = Shrinker(opts.shrink, self.sizer)

    @property
    def rungs(self) -> list[dict[str, int]]:
        """Caps whose graphs are ready (warmed) or compiling (a background worker)."""
        return self.ladder.ready

    # -- the call -------------------------------------------------------------

    def forward(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        turns = self._turns
        turns.take()
        try:
            return self._forward(data, args, kwargs)
        finally:
            turns.give()

    def _forward(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stats, options = self.stats, self.options
        index, graphs_before, recompiles_before = stats.calls, stats.graphs, stats.recompiles
        allocations_before = getattr(self.padder, "allocations", None)
        failures_before = guard_failure_counts() if self.on_recompile != "ignore" else {}
        agreement = current_agreement()
        exchanges_before = agreement.step if agreement is not None else 0
        trial = dict(self.cap_state)  # committed only if the call succeeds
        measure = options.memory_budget is not None and index == 0
        pad_seconds, started = 0.0, time.perf_counter()
        sizer = self.sizer
        notice: CompileNotice | None = None  # a call that may compile says so, and what it did
        work_before = None
        if self.checks is not None:
            self.checks.eager_only = False
        with _Scope(self.max_caps, self.ladder.ready, sizer) as rows:  # the call's resolutions (plain tuples)
            try:
                if measure:
                    reset_peak(data)
                if self.pad_in_forward:  # the model pads at its own seam
                    if index == 0 and options.compile:
                        message = "first call (caps sized at the model's padding seam): compiling or loading its graph"
                        notice = CompileNotice(log, message, event=CompileEvent("start", "seam", message))
                        work_before = stats.snapshot()
                    with activate_dd_context(self._context(trial)), notice or contextlib.nullcontext():
                        out = self._run(data, args, kwargs, None, trial)
                else:
                    t0 = time.perf_counter()
                    padded = self.padder.pad(data, trial)
                    pad_seconds += time.perf_counter() - t0
                    notice = self._notice(index, trial) if options.compile else None
                    if notice is None:  # nearly every call
                        out = self._run(padded, args, kwargs, data, trial)
                    else:
                        work_before = stats.snapshot()
                        with notice:
                            out = self._run(padded, args, kwargs, data, trial)
                t0 = time.perf_counter()
                out = self.padder.unpad(out)
                pad_seconds += time.perf_counter() - t0
            except CapacityError as exc:  # a ceiling: every rank sees the same agreed need
                if options.on_overflow != "eager" or trial != self.cap_state:
                    raise
                log.warning("%s; running this step unpadded and eager", exc)
                out = self._eager(data, args, kwargs)
                stats.record_eager_step()
                return out
            except Exception as exc:
                self._report_failure(agreement, exchanges_before, exc)
                self._fail(index, resolutions(rows), exc)
            finally:
                _restore(self.padder)
        self.cap_state.update(trial)  # the call succeeded: commit its caps
        if self.package_builds is not None and self.package_builds.active:
            self.package_builds.poll()  # (a finished build frees a worker for the next queued one)
        if measure:
            self._derive_ceilings(data)
        fitted = False
        if sizer is not None and (not sizer.settled or any(r.old != r.cap for r in rows)):
            fitted = sizer.observe(rows)  # True on the one call that fits the caps
        # the ladder climbs from the first call's caps, or from the fitted ones under a tight sizing
        if options.warm_ladder and (fitted or (index == 0 and (sizer is None or sizer.settled))):
            self._warm(data, args, kwargs, resolutions(rows))
        stats.record_pads(pad_seconds, getattr(self.padder, "allocations", None), allocations_before)
        # the form that ran (before a shrink changes the caps)
        form = (call_form(args, kwargs), tuple(self.cap_state.items()))  # (keys keep their order)
        new_form = form not in self._forms
        if self.checks is None or not self.checks.eager_only:  # (no graph for caps that only ran eager)
            self._forms.add(form)
        if index == 0 or self.shrinker is not None or self.background is not None or any(r.old != r.cap for r in rows):
            self._sized(index, resolutions(rows), data, args, kwargs, fitted,
                        time.perf_counter() - started, stats.graphs > graphs_before, agreement is not None)
        else:  # nothing sized or grew (nearly every call): only the fills changed
            stats.record_fills(rows)
        if notice is not None:
            work = stats.work(work_before)
            notice.done(f"{'first call' if index == 0 else f'call {index}'} at caps {self.cap_state}: {work} "
                        f"({time.perf_counter() - started:.1f} s in all)")
        # a compile is explained by caps or a call form (keywords) not run before
        if stats.recompiles > recompiles_before and not new_form:
            self._unexplained(index, stats.graphs - graphs_before, failures_before)
        return out

    def _sized(self, index: int, resolved: list[CapResolution], data: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any], fitted: bool = False, seconds: float = 0.0, compiled: bool = False,
               agreed: bool = False) -> None:
        """After a call that sized, grew, fitted (or may shrink) a cap: record
        it, let background compiles and the ladder see it, shrink."""
        self.stats.record_call(index, resolved, self.cap_state, fitted=fitted)
        self.last_resolutions = resolved  # what sized the caps (policies included)
        if self.background is not None:
            self.background.after_call(self, data, args, kwargs, resolved)
        if index and any(r.grew for r in resolved):
            self.ladder.count_use(self.cap_state)
        if index == 0:
            self._check_loaded_keys(resolved)
        if self.shrinker is not None:
            shrinks = self.shrinker.observe(index, resolved, self.cap_state, seconds=seconds, compiled=compiled,
                                            ready=self._ready, agreed=agreed)
            if shrinks:
                self.stats.record_shrinks(shrinks, self.cap_state)

    def _notice(self, index: int, trial: dict[str, int]) -> CompileNotice | None:
        """The notice of a call that may compile at caps ``trial``: the first
        call, one whose caps changed (fitted or grew), or the first after a
        shrink to caps no graph is ready for; None for any other."""
        change = None
        if index == 0:
            what, kind = f"first call at caps {trial}", "first"
        elif trial != self.cap_state:
            sizer = self.sizer
            change = caps_changed(self.cap_state, trial, sizer is not None and not sizer.settled)
            what, kind = f"caps {change}", change.split(" ", 1)[0]  # fitted, grew or shrank
        else:
            shrinks = self.stats.shrinks
            if not shrinks or shrinks[-1].call != index - 1 or trial in self._ready():  # (nearly every call)
                return None
            shrunk = [e for e in shrinks if e.call == index - 1]  # after the last call
            change = caps_changed({e.key: e.old for e in shrunk}, {e.key: e.new for e in shrunk}, False)
            what, kind = f"caps {change}", "shrank"
        built = "package" if self.aot is not None else "graph"
        message = f"{what}: compiling or loading the {built}"
        return CompileNotice(log, message, event=CompileEvent("start", kind, message, dict(trial), change, built))

    def _ready(self) -> list[dict[str, int]]:
        """Caps whose graphs are ready: they ran before (Dynamo's cache holds
        them) or are rungs (warmed, or a background worker's)."""
        return [*self.ladder.ready, *(dict(caps) for _, caps in self._forms)]

    def _builds_elsewhere(self, opts: WrapOptions, adapter: Adapter | None) -> bool:
        """Whether packages are built in worker processes (``aot_build``;
        None: wherever a store and an adapter let a worker rebuild the model)."""
        if opts.aot_build == "background" and adapter is None:
            raise ValueError("ddpad: aot_build='background' needs an adapter (its workers rebuild the padder "
                             "from it)")
        return opts.aot_build == "background" or (opts.aot_build is None and adapter is not None)

    def _aot_route(self, opts: WrapOptions, adapter: Adapter | None) -> AotRoute | None:
        """The ahead-of-time route, or None (said once) where it cannot be taken."""
        if self.pad_in_forward:
            log.warning("ddpad: compile_mode='aot' falls back to torch.compile: this model pads at its own seam "
                        "inside its forward, and a package needs the padded input from outside")
            return None
        store = None
        model_key: Callable[[], str] | None = None
        if opts.compile_cache is not None:
            store = opts.compile_cache if isinstance(opts.compile_cache, CompileStore) \
                else CompileStore(opts.compile_cache)

            def model_key() -> str:  # (again when the model's hyper-parameters change)
                return aot_binding(self.model, store, adapter, self.dynamo_config)[1]
        return AotRoute(self.model, self.call, self.dynamo_config, self.stats, store, model_key,
                        verify=opts.verify)

    def _run(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any], source: Any = None,
             caps: dict[str, int] | None = None) -> Any:
        """One step on padded ``data`` at ``caps`` (a model padding at its own
        seam: its unpadded input, and the caps its seam resolves into): its
        package (``compile_mode="aot"``; ``source``, the caller's input, says
        whether the caller differentiates the outputs, and is what a
        background build is sent), else the compiled model."""
        if self.aot is not None:
            builds, elsewhere = self.package_builds, None
            if builds is not None and caps is not None:
                def elsewhere(name: str) -> str | None:
                    sizer = self.sizer
                    if sizer is not None and not sizer.settled:  # caps about to be fitted: no build for them
                        return None
                    return builds.status(name, self, caps, source, args, kwargs)
            return self.aot.run(data, args, kwargs, source, lambda: self._fallback_step(data, args, kwargs, caps),
                                elsewhere, caps)
        return self._compiled_step(data, args, kwargs, caps)

    def _fallback_step(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       caps: dict[str, int] | None) -> Any:
        """A step the ahead-of-time route refused: ``torch.compile``, built on the first one."""
        later = self.__dict__.pop("_compile_later", None)
        if later is not None:
            region, compile_kwargs = later
            self.compiled = compile_model(self.model, self.stats, region, self.store_binding, **compile_kwargs)
        return self._compiled_step(data, args, kwargs, caps)

    def _compiled_step(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       caps: dict[str, int] | None) -> Any:
        """The ``torch.compile`` step; its first call at each caps and call form
        checked against the eager step (``verify``)."""
        checks = self.checks
        if checks is None or caps is None:
            return self._step(data, args, kwargs)
        form = call_form(args, kwargs)
        rekey = (lambda: (form, tuple(caps.items()))) if self.pad_in_forward else None  # (its seam may grow them)
        return checks.run((form, tuple(caps.items())), data, lambda d: self._step(d, args, kwargs),
                          lambda d, again: self._eager_step(d, args, kwargs, again), caps, rekey)

    def _eager_step(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any], again: bool = False) -> Any:
        """The eager step on the same padded input as the compiled one: the
        model as it is; a model padding at its own seam runs its compiled
        part eager (``force_eager``), padded at the seam through the active
        context (``again``, after the compiled step padded it: to the same
        caps, and the resolutions are not recorded twice)."""
        if not self.pad_in_forward:
            return run_step(self.model, self.call, self.dynamo_config, data, args, kwargs)
        with torch.compiler.set_stance("force_eager"), record_resolutions() if again else contextlib.nullcontext():
            return run_step(self.compiled, self.call, self.dynamo_config, data, args, kwargs)

    def _step(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One ``torch.compile`` step, unchecked."""
        if self.store_binding is None:
            return run_step(self.compiled, self.call, self.dynamo_config, data, args, kwargs)
        try:
            return run_step(self.compiled, self.call, self.dynamo_config, data, args, kwargs)
        finally:
            self.store_binding.flush()  # what compiled lazily in this call (a backward) joins its entry

    def close(self) -> None:
        """Stop this model's background compiles (a worker stopped mid-compile
        leaves no entry, only its lock file) and save what compiled lazily."""
        if self.background is not None:
            self.background.close()
        if self.package_builds is not None:
            self.package_builds.close()
        if self.store_binding is not None:
            self.store_binding.flush()

    def finish_builds(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout`` seconds) for the ahead-of-time packages
        worker processes are building (``aot_build="background"``), so the
        next process finds them in the store; returns how many are still
        building (0: none)."""
        return self.package_builds.wait(timeout) if self.package_builds is not None else 0

    def __enter__(self) -> PaddedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _warm(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any], resolved: list[CapResolution]) -> None:
        """Compile (or load from the store) the next ``warm_ladder`` rungs on
        this first call's input (:mod:`._warm`), on a copy of the padder: the
        run's buffers stay."""
        if current_agreement() is not None or (self.pad_in_forward and current_dd_context().graph_padder is not None):
            log.warning("ddpad: warm_ladder is off under an agreement group or a framework's padding context "
                        "(a rank's warm calls may hold collectives its peers do not make); growths compile "
                        "when they come")
            return
        padder = copy.deepcopy(self.padder)
        form = call_form(args, kwargs)

        def step(caps: Mapping[str, int]) -> None:
            state = dict(caps)
            try:
                if self.pad_in_forward:
                    with activate_dd_context(self._context(state, padder)):
                        self._run(data, args, kwargs, None, state)
                else:
                    self._run(padder.pad(data, state), args, kwargs, data, state)
            finally:
                _restore(padder)

        t0 = time.perf_counter()
        rungs = warm_rungs(self.cap_state, resolved, self.options.warm_ladder, self.max_caps, self.sizer)
        before = self.stats.snapshot()
        message = f"warm ladder: compiling or loading {len(rungs)} rung(s) above caps {self.cap_state}"
        with CompileNotice(log, message, event=CompileEvent("start", "ladder", message, dict(self.cap_state))) \
                as notice:
            for caps in warm(rungs, self.cap_state, step, self.ladder):
                self._forms.add((form, tuple(caps.items())))
        self.stats.warm_seconds += time.perf_counter() - t0
        notice.done(f"warm ladder: {self.stats.work(before)}")

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
            agreement.failed_after(reason)

    def _fail(self, index: int, resolved: list[CapResolution], exc: Exception) -> None:
        """Record the failed call's growths and re-raise; out of memory after
        a growth becomes a :class:`CapacityError` naming the caps."""
        self.stats.record_failure(index, resolved)
        grown = [r for r in resolved if r.grew]
        described = ", ".join(
            f"{r.key!r} {r.old_cap if r.old_cap is not None else 'new'} -> {r.cap} for real {r.real}" for r in grown
        )
        if grown and _is_out_of_memory(exc):
            raise CapacityError(
                f"ddpad: call {index} ran out of memory after sizing caps ({described}); the caps are "
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
                stacklevel=5,
            )

    def _derive_ceilings(self, data: Any) -> None:
        budget = self.options.memory_budget
        assert budget is not None
        peak = measure_peak(data)
        derived = derive_ceilings(self.cap_state, peak, budget)
        self.max_caps = {k: min(v, self.max_caps.get(k, v)) for k, v in derived.items()}
        log.info("memory budget %d B, peak %d B at caps %s: ceilings %s", budget, peak, self.cap_state, self.max_caps)

    def _unexplained(self, index: int, graphs: int, failures_before: Mapping[Any, int]) -> None:
        message = unexplained(index, graphs, failures_before)
        self.stats.unexplained.append(message)
        if self.on_recompile == "raise":
            raise RecompileError(message)
        if self.on_recompile == "warn":
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    # -- caps -------------------------------------------------------------------

    @property
    def caps(self) -> dict[str, int]:
        """The current caps (a copy)."""
        return dict(self.cap_state)

    def save_caps(self, path: str | os.PathLike[str]) -> None:
        """Write the current caps to JSON for a warm restart (``caps=path``),
        atomically, with the adapter's name (checked when loaded) and, once
        ``cap_policy="tight"`` fitted them, that they are fitted (a tight
        restart from the file keeps them)."""
        meta: dict[str, Any] = {"adapter": self.adapter.name} if self.adapter is not None else {}
        if self.sizer is not None and self.sizer.settled:
            meta["fitted"] = True  # a tight restart keeps them
        save_caps(self.cap_state, path, **meta)

    def load_caps(self, source: Mapping[str, int] | str | os.PathLike[str]) -> None:
        """Preset caps (they still grow if a real count overflows them)."""
        name = self.adapter.name if self.adapter is not None else None
        loaded = load_caps(source, adapter=name, ceilings=self.max_caps)
        self.cap_state.update(loaded)
        self._loaded_keys |= set(loaded)
        self.stats.caps = dict(self.cap_state)
