"""The fixed-shape forward: pad, run the compiled model, unpad, restore.

The framework side of SPEC section 4: :class:`PaddedModel` owns *when*
padding happens, and nothing else: the caps it resolves are committed only
when a call succeeds (a call that raises rolls them back). What runs the
padded step, and everything built for it (routes, the store, checks, ready
rungs, worker processes), is the compile manager's (:mod:`._manager`);
shrinking, memory ceilings, strict mode and statistics live in their own
modules."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._agreement import AgreementError, current_agreement
from ._capacity import CapacityError, CapResolution, CapScope, Row, ScopedCaps, TightCaps, resolutions
from ._caps_file import caps_fitted, load_caps, save_caps
from ._context import NOT_DISTRIBUTED, DistributedContext, activate_dd_context, current_dd_context
from ._manager import CompileManager
from ._memory import derive_ceilings, measure_peak, reset_peak
from ._noise import CompileEvent, CompileNotice, quiet
from ._options import WrapOptions
from ._protocol import GraphPadder
from ._routes import Step
from ._shrink import Shrinker
from ._stats import caps_changed
from ._strict import RecompileError, guard_failure_counts, unexplained
from ._warm import warm_rungs
from ._weights import Follow

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
        if adapter is not None:  # the family's Inductor options, under the caller's
            opts = opts.with_inductor_options(adapter.inductor_options)
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
        # the prepared copy holds the source's own tensors; a change it does not follow prepares it again
        self._follow = Follow(source, model) if source is not None else None
        self._compile_region = compile_region
        self._remake_padder: Callable[[torch.nn.Module], GraphPadder] | None = None  # wrap's own padder: remade
        self.dynamo_config = dict(dynamo_config or {})
        self.on_recompile = opts.on_recompile
        self.max_caps: dict[str, int] = dict(opts.max_caps)  # lowered by a memory budget
        name = adapter.name if adapter is not None else None
        self.cap_state: dict[str, int] = (
            load_caps(opts.caps, adapter=name, ceilings=self.max_caps) if opts.caps is not None else {}
        )
        self._loaded_keys = set(self.cap_state)
        fitted = bool(self.cap_state) and opts.caps is not None and caps_fitted(opts.caps)
        # what is compiled, loaded, checked and built, by which route: apart from the call path
        self._manage(model, fitted)
        self.shrinker: Shrinker | None = None
        self.last_resolutions: list[CapResolution] = []  # of the last call that sized or grew a cap
        self._turns = _Turns()
        if opts.shrink is not None:
            self.shrinker = Shrinker(opts.shrink, self.sizer)

    @property
    def sizer(self) -> TightCaps | None:
        """The tight sizing of the caps (``cap_policy="tight"``; None: head room), the manager's."""
        return self.manager.sizer

    @property
    def rungs(self) -> list[dict[str, int]]:
        """Caps whose graphs are ready (warmed) or compiling (a background worker)."""
        return self.manager.ladder.ready

    # -- the call -------------------------------------------------------------

    def forward(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        turns = self._turns
        turns.take()
        try:
            return self._forward(data, args, kwargs)
        finally:
            turns.give()

    def _forward(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._follow is not None:
            changed = self._follow.stale()
            if changed is not None:
                self._prepare_again(changed)
        stats, options = self.stats, self.options
        index, graphs_before, recompiles_before = stats.calls, stats.graphs, stats.recompiles
        allocations_before = getattr(self.padder, "allocations", None)
        failures_before = guard_failure_counts() if self.on_recompile != "ignore" else {}
        agreement = current_agreement()
        exchanges_before = agreement.step if agreement is not None else 0
        # the call's caps (committed only if it succeeds) with what they resolve under: the padder reads
        # the scope from the caps it is handed, and records each key's resolution in it
        sizer = self.sizer
        scope = CapScope(self.max_caps, self.manager.ladder.ready, sizer)
        trial, rows = ScopedCaps(self.cap_state, scope), scope.rows
        measure = options.memory_budget is not None and index == 0
        pad_seconds, started = 0.0, time.perf_counter()
        notice: CompileNotice | None = None  # a call that may compile says so, and what it did
        work_before = None
        try:
            if measure:
                reset_peak(data)
            if self.pad_in_forward:  # the model pads at its own seam
                if index == 0 and options.compile:
                    message = "first call (caps sized at the model's padding seam): compiling or loading its graph"
                    notice = CompileNotice(log, message, event=CompileEvent("start", "seam", message))
                    work_before = stats.snapshot()
                step = Step(data, args, kwargs, None, trial)
                with activate_dd_context(self._context(trial)), notice or contextlib.nullcontext():
                    out = self.manager.run(step)
            else:
                t0 = time.perf_counter()
                padded = self.padder.pad(data, trial)
                pad_seconds += time.perf_counter() - t0
                step = Step(padded, args, kwargs, data, trial)
                watching = options.compile and sizer is not None and not sizer.settled and sizer.watching(rows)
                notice = self._notice(index, trial, rows) if options.compile and not watching else None
                if watching:  # tight caps not fitted yet: the eager step, and one compile at the fitted caps
                    out = self.manager.run_eager(step)
                    stats.record_settling_step()
                elif notice is None:  # nearly every call
                    out = self.manager.run(step)
                else:
                    work_before = stats.snapshot()
                    with notice:
                        out = self.manager.run(step)
            t0 = time.perf_counter()
            if step.route != "unpadded":  # (a refused key's call ran the unpadded model: nothing to take off)
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
        self.manager.poll()
        new_form = self.manager.note(step)  # the route that ran these caps and call form (before a warm or shrink)
        if measure:
            self._derive_ceilings(data)
        fitted = sizer is not None and sizer.observe_call(rows)  # True on the one call that fits the caps
        if fitted and sizer.changing is not None:
            stats.changing_run = f"step {index}: {sizer.changing}"
        # the ladder climbs from the first call's caps, or from the fitted ones under a tight sizing
        if options.warm_ladder and (fitted or (index == 0 and (sizer is None or sizer.settled))):
            self._warm(data, args, kwargs, resolutions(rows))
        stats.record_pads(pad_seconds, getattr(self.padder, "allocations", None), allocations_before)
        if index == 0 or self.shrinker is not None or self.manager.background is not None \
                or any(r.old != r.cap for r in rows):
            self._sized(index, resolutions(rows), data, args, kwargs, fitted and stats.changing_run is None,
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
        self.manager.after_call(data, args, kwargs, resolved, bool(index) and any(r.grew for r in resolved),
                                self.cap_state)
        if index == 0:
            self._check_loaded_keys(resolved)
        if self.shrinker is not None:
            shrinks = self.shrinker.observe(index, resolved, self.cap_state, seconds=seconds, compiled=compiled,
                                            ready=self.manager.ready, agreed=agreed)
            if shrinks:
                self.stats.record_shrinks(shrinks, self.cap_state)

    def _notice(self, index: int, trial: dict[str, int], rows: Sequence[Row]) -> CompileNotice | None:
        """The notice of a call that may compile at caps ``trial`` (its scope
        rows ``rows``): the first call, one whose caps changed (fitted or
        grew) or that fits tight caps, or the first after a shrink to caps no
        graph is ready for; None for any other."""
        change = None
        sizer = self.manager.sizer  # (not the property: a steady call makes no call it does not need)
        fitting = sizer is not None and not sizer.settled
        if index == 0:
            what, kind = f"first call at caps {trial}", "first"
        elif fitting and (why := sizer.swing([(r.key, r.need) for r in rows])) is not None:
            change = f"kept at head room ({why}: a changing run)"
            if trial != self.cap_state:
                change += f", {caps_changed(self.cap_state, trial, False)}"
            what, kind = f"caps {change}", "fitted"
        elif trial != self.cap_state:
            change = caps_changed(self.cap_state, trial, fitting)
            what, kind = f"caps {change}", change.split(" ", 1)[0]  # fitted, grew or shrank
        else:
            shrinks = self.stats.shrinks
            if not shrinks or shrinks[-1].call != index - 1 or trial in self.manager.ready():  # (nearly every call)
                return None
            shrunk = [e for e in shrinks if e.call == index - 1]  # after the last call
            change = caps_changed({e.key: e.old for e in shrunk}, {e.key: e.new for e in shrunk}, False)
            what, kind = f"caps {change}", "shrank"
        built = "package" if self.manager.aot is not None else "graph"
        message = f"{what}: compiling or loading the {built}"
        return CompileNotice(log, message, event=CompileEvent("start", kind, message, dict(trial), change, built))

    def _prepare_again(self, changed: str) -> None:
        """The user's model changed in a way the prepared copy does not follow
        (``changed`` says how): prepare it again and start over from it, at
        the caps reached (its graphs compile again, its stats restart)."""
        assert self.adapter is not None and self.adapter.prepare_model is not None and self.source is not None
        warnings.warn(f"ddpad: your model changed after wrap ({changed}), which the compile-ready copy ddpad "
                      "runs does not follow: prepared the copy again from your model; its graphs compile again "
                      "and its stats restart", RuntimeWarning, stacklevel=4)
        with quiet():
            model = self.adapter.prepare_model(self.source)
        self.manager.close()
        self._follow = Follow(self.source, model)
        self.model = model
        if self._remake_padder is not None:
            self.padder = self._remake_padder(model)
        sizer = self.sizer
        self._manage(model, fitted=sizer is None or sizer.settled)
        if self.shrinker is not None:
            self.shrinker = Shrinker(self.options.shrink, self.sizer)

    def _manage(self, model: torch.nn.Module, fitted: bool) -> None:
        """A compile manager for ``model`` (the one at construction, or a copy
        prepared again) from the current caps; its stats are the model's."""
        self.manager = CompileManager(self, model, adapter=self.adapter, call=self.call,
                                      dynamo_config=self.dynamo_config, compile_region=self._compile_region,
                                      options=self.options, caps=self.cap_state, fitted=fitted,
                                      seam=self.pad_in_forward)
        self.stats = self.manager.stats
        if not self.pad_in_forward:  # (a seam model's manager dispatches its parts: their steps are not calls)
            self.manager.unpadded = self._unpadded

    def _unpadded(self, step: Step) -> Any:
        """A call whose caps and call form every compiled route refused, on
        the unpadded eager model (as exact as the padded eager step, without
        its dead rows); NotImplemented under an agreement group or a domain
        decomposition, where the ranks' steps must stay the same padded one."""
        if current_agreement() is not None or current_dd_context() is not NOT_DISTRIBUTED:
            return NotImplemented
        step.route = "unpadded"
        return self._eager(step.source, step.args, step.kwargs)

    def close(self) -> None:
        """Stop this model's background compiles and package builds (a worker
        stopped mid-compile leaves no entry, only its lock file) and save what
        compiled lazily."""
        self.manager.close()

    def finish_builds(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout`` seconds) for the ahead-of-time packages
        worker processes are building (``aot_build="background"``), so the
        next process finds them in the store; returns how many are still
        building (0: none)."""
        return self.manager.finish_builds(timeout)

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

        def step(caps: Mapping[str, int]) -> Step:
            state = dict(caps)
            try:
                if self.pad_in_forward:
                    one = Step(data, args, kwargs, None, state)
                    with activate_dd_context(self._context(state, padder)):
                        self.manager.run(one)
                else:
                    one = Step(padder.pad(data, state), args, kwargs, data, state)
                    self.manager.run(one)
                return one
            finally:
                _restore(padder)

        t0 = time.perf_counter()
        rungs = warm_rungs(self.cap_state, resolved, self.options.warm_ladder, self.max_caps, self.sizer)
        before = self.stats.snapshot()
        message = f"warm ladder: compiling or loading {len(rungs)} rung(s) above caps {self.cap_state}"
        with CompileNotice(log, message, event=CompileEvent("start", "ladder", message, dict(self.cap_state))) \
                as notice:
            self.manager.warm(rungs, self.cap_state, step)
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
        """Preset caps (they still grow if a real count overflows them).
        Before the first call, caps a tight run fitted (a mapping, or a
        file that says so) are kept as ``caps=`` keeps them: no window."""
        name = self.adapter.name if self.adapter is not None else None
        loaded = load_caps(source, adapter=name, ceilings=self.max_caps)
        sizer = self.sizer
        if sizer is not None and not sizer.settled and self.stats.calls == 0 and caps_fitted(source):
            sizer.settled = True
        self.cap_state.update(loaded)
        self._loaded_keys |= set(loaded)
        self.stats.caps = dict(self.cap_state)
