"""What a wrapped model measured: :class:`Stats`, written through its own methods.

Writers: the call path (:meth:`Stats.record_call`, :meth:`Stats.record_fills`,
failed and eager steps, shrinks), the counting backend (compile events,
:mod:`._compile`) and engines that pad for a framework (nvalchemi's padders
call :meth:`Stats.record_call` too). Counts about ready rungs and background
compiles are the :class:`~._ladder.Ladder`'s, read here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._capacity import CapResolution, Row
from ._ladder import Ladder

__all__ = ["CapEvent", "Stats", "caps_changed", "lowest_fill"]


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
    growths, shrinks, fits
        Cap changes (:class:`CapEvent`, one per key that changed), first
        sizing excluded. One growth step may grow several keys:
        :attr:`growth_calls` counts the steps. ``fits`` are those of the
        call on which ``cap_policy="tight"`` fitted the caps to the needs it
        had seen (one recompile, on one call).
    caps
        The caps as of the last call that sized, grew or shrank one (a copy).
    fill
        ``real / cap`` per key on the last call.
    fill_sum, fill_calls
        Sums of ``real / cap`` per key over the calls since the caps last
        changed, and how many: :attr:`mean_fill` (what a run's steps paid).
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
    settling_steps
        Calls run on the (padded) eager step while tight caps settle
        (``cap_policy="tight"``): nothing compiles before the caps are fitted.
    changing_run
        Under ``cap_policy="tight"``, why the fit kept the caps at head room
        ("step 9: edges swung 5.3 % over 10 calls"); None when it fitted
        them, or before.
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
        Graphs whose compile-store entry was there / was not (then compiled,
        or loaded from torch's own cache, and written).
    store_loads
        Of ``graphs_loaded``: those loaded from their compile-store entry
        (the rest came from torch's own on-disk cache).
    background_started, background_used, background_wasted
        Background compiles of the next bucket: started, whose caps a later
        growth reached, and finished or stopped without being reached.
    checks, disagreements, check_seconds
        First calls of a compiled graph or package (per caps and call form)
        compared with the eager step on the same padded input (``verify``),
        those that disagreed (each returned the eager result and fell back
        one route), and the seconds the eager steps and comparisons took.
    eager_forms
        Caps and call forms that run eager: their ``torch.compile`` graph
        disagreed with the eager step.
    dead_nonfinite
        First-use checks whose eager step held NaN or inf in dead rows only
        (a padding defect of the adapter's: the real rows were finite, and
        the compiled step, with the same NaN there, was kept).
    aot_compiled, aot_loaded, aot_checked, aot_refused, aot_seconds, aot_load_seconds
        ``compile_mode="aot"``: packages built (traced, exported, compiled by
        AOTInductor) and loaded from the store, packages whose first call
        matched the eager step, call forms that fell back to
        ``torch.compile``, and the seconds building and loading took.
    aot_background
        Package builds started in worker processes (``aot_build="background"``).
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
    fits: list[CapEvent] = field(default_factory=list)
    caps: dict[str, int] = field(default_factory=dict)
    fill: dict[str, float] = field(default_factory=dict)
    fill_sum: dict[str, float] = field(default_factory=dict)
    fill_calls: int = 0
    pad_seconds: float = 0.0
    last_pad_seconds: float = 0.0
    pad_allocations: int | None = None
    last_pad_allocations: int | None = None
    unexplained: list[str] = field(default_factory=list)
    failed_growths: list[CapEvent] = field(default_factory=list)
    eager_steps: int = 0
    settling_steps: int = 0
    changing_run: str | None = None
    graphs_compiled: int = 0
    graphs_loaded: int = 0
    graphs_uncached: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    store_hits: int = 0
    store_misses: int = 0
    store_loads: int = 0
    warm_seconds: float = 0.0
    aot_compiled: int = 0
    aot_loaded: int = 0
    aot_checked: int = 0
    aot_refused: int = 0
    aot_seconds: float = 0.0
    aot_load_seconds: float = 0.0
    aot_background: int = 0
    checks: int = 0
    disagreements: int = 0
    check_seconds: float = 0.0
    eager_forms: int = 0
    dead_nonfinite: int = 0
    ladder: Ladder = field(default_factory=Ladder, repr=False, compare=False)
    # the compile manager's records (``_routes.Records``: what each route holds per key), read by ``routes``
    records: Any = field(default=None, repr=False, compare=False)

    def record(self, call: int, resolved: list[CapResolution], fitted: bool = False) -> bool:
        """Record the fills and growths (or, ``fitted``, the fits) of call
        ``call``'s cap resolutions; True when a known cap changed (first
        sizing is not a growth)."""
        changed = False
        events = self.fits if fitted else self.growths
        for r in resolved:
            if r.old_cap is not None and r.cap != r.old_cap:
                changed = True
                events.append(CapEvent(call, r.key, r.old_cap, r.cap, r.real, r.need))
        if changed:  # the mean fill is of the caps as they now are
            self.fill_sum.clear()
            self.fill_calls = 0
        self.record_fills(Row(r.key, r.real, r.need, r.old_cap, r.cap, r.policy) for r in resolved)
        return changed

    def record_call(self, call: int, resolved: list[CapResolution], caps: dict[str, int],
                    fitted: bool = False) -> bool:
        """:meth:`record`, and the caps as they now are (a copy)."""
        changed = self.record(call, resolved, fitted)
        self.caps = dict(caps)
        return changed

    def record_fills(self, rows: Iterable[Row]) -> None:
        """The fills of a call (the rows of a call's scope)."""
        fill, total = self.fill, self.fill_sum
        for row in rows:
            cap = row.cap
            fill[row.key] = value = row.real / cap if cap else 0.0
            total[row.key] = total.get(row.key, 0.0) + value
        self.fill_calls += 1

    @property
    def mean_fill(self) -> dict[str, float]:
        """``real / cap`` per key, averaged over the calls since the caps last changed."""
        calls = self.fill_calls
        return {key: value / calls for key, value in self.fill_sum.items()} if calls else dict(self.fill)

    def record_shrinks(self, events: list[CapEvent], caps: dict[str, int]) -> None:
        """Caps that shrank (:class:`~ddpad.ShrinkPolicy`) after a call, and the caps now."""
        self.shrinks.extend(events)
        self.caps = dict(caps)
        self.fill_sum.clear()
        self.fill_calls = 0

    def record_pads(self, seconds: float, allocations: int | None, before: int | None) -> None:
        """One finished call: its pad / unpad time and the padder's buffer allocations."""
        self.calls += 1
        self.pad_seconds += seconds
        self.last_pad_seconds = seconds
        if allocations is not None and before is not None:
            self.pad_allocations = allocations
            self.last_pad_allocations = allocations - before

    def record_settling_step(self) -> None:
        """A call of a tight sizing's window, run on the eager step."""
        self.settling_steps += 1

    def record_eager_step(self) -> None:
        """A finished call run unpadded and eager (``on_overflow="eager"``)."""
        self.eager_steps += 1
        self.calls += 1

    def record_failure(self, call: int, resolved: list[CapResolution]) -> None:
        """The growths of a call that raised (rolled back)."""
        for r in resolved:
            if r.grew and r.old_cap is not None:
                self.failed_growths.append(CapEvent(call, r.key, r.old_cap, r.cap, r.real, r.need))

    # -- compile events (the counting backend) -------------------------------

    def record_graph(self, frame: int) -> None:
        """A graph Dynamo compiled for ``frame`` during the call in progress."""
        if frame in self.graphs_per_frame:  # a frame this model compiled before
            self.recompiles += 1
        self.graphs += 1
        self.graphs_per_frame[frame] = self.graphs_per_frame.get(frame, 0) + 1
        self.graphs_by_call[self.calls] = self.graphs_by_call.get(self.calls, 0) + 1

    def record_backend(self, seconds: float, *, loaded: bool, uncached: bool = False) -> None:
        """The backend's time for one graph: loaded from torch's caches, or compiled."""
        if loaded:
            self.graphs_loaded += 1
            self.load_seconds += seconds
        else:
            self.graphs_compiled += 1
            self.compile_seconds += seconds
            self.graphs_uncached += uncached

    @property
    def routes(self) -> dict[str, dict[str, int]]:
        """Per route (``package``, ``torch.compile``, ``eager``), how many of
        its records are ready, building, checked or refused, from the compile
        manager's records: one per key (caps and call form), and one per call
        form the route refused as a whole."""
        return self.records.counts() if self.records is not None else {}

    # -- rungs and background compiles (the ladder's counts) ------------------

    @property
    def rungs_warmed(self) -> int:
        """Ladder rungs the first call compiled or loaded (``warm_ladder``)."""
        return self.ladder.count("warm")

    @property
    def rungs_used(self) -> int:
        """Growths that took a ready rung (warmed, or a background worker's caps)."""
        return self.ladder.uses

    @property
    def background_started(self) -> int:
        """Background compiles started."""
        return self.ladder.count("background")

    @property
    def background_used(self) -> int:
        """Background compiles whose caps a later growth reached."""
        return self.ladder.count("background", used=True)

    @property
    def background_wasted(self) -> int:
        """Background compiles finished or stopped without being reached (counted at close)."""
        return self.ladder.background_wasted

    @property
    def fit_calls(self) -> int:
        """Calls on which ``cap_policy="tight"`` fitted the caps (0 or 1; each one recompile)."""
        return len({event.call for event in self.fits})

    @property
    def growth_calls(self) -> int:
        """Calls on which at least one cap grew (each costs one recompile)."""
        return len({event.call for event in self.growths})

    @property
    def max_graphs_per_frame(self) -> int:
        """Compiles of the most compiled frame: ``1 + growth_calls +
        fit_calls`` when padding holds (graph breaks add frames, not compiles per frame)."""
        return max(self.graphs_per_frame.values(), default=0)

    def work(self, since: Mapping[str, float] | None = None) -> str:
        """What compiling took since ``since`` (a :meth:`snapshot`; None: since
        the start), in words: "compiled 1 graph in 30.1 s", "loaded 1 graph
        from the compile store in 2.0 s", "loaded 1 package in 0.02 s", each
        with the first-use checks' seconds; "nothing compiled or loaded"."""
        base = since or {}
        d = {name: getattr(self, name) - base.get(name, 0) for name in _WORK}
        parts = []
        if d["graphs_compiled"]:
            parts.append(f"compiled {_count(d['graphs_compiled'], 'graph')} in {d['compile_seconds']:.1f} s")
        if d["graphs_loaded"]:
            store, own = d["store_loads"], d["graphs_loaded"] - d["store_loads"]
            sources = " and ".join(f"{n} from {where}" for n, where in ((store, "the compile store"),
                                                                         (own, "torch's own cache")) if n)
            parts.append(f"loaded {_count(d['graphs_loaded'], 'graph')} ({sources}) in {d['load_seconds']:.1f} s")
        if d["aot_compiled"]:
            parts.append(f"built {_count(d['aot_compiled'], 'package')} in {d['aot_seconds']:.1f} s")
        if d["aot_loaded"]:
            parts.append(f"loaded {_count(d['aot_loaded'], 'package')} in {d['aot_load_seconds']:.2f} s")
        if d["checks"]:
            parts.append(f"checked against the eager step in {d['check_seconds']:.1f} s")
        return ", ".join(parts) or "nothing compiled or loaded"

    def snapshot(self) -> dict[str, float]:
        """The counts :meth:`work` describes, as they are now."""
        return {name: getattr(self, name) for name in _WORK}

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
            "fits": [vars(e) for e in self.fits],
            "fill": dict(self.fill),
            "mean_fill": self.mean_fill,
            "pad_seconds": self.pad_seconds,
            "pad_allocations": self.pad_allocations,
            "unexplained": list(self.unexplained),
            "failed_growths": [vars(e) for e in self.failed_growths],
            "eager_steps": self.eager_steps,
            "settling_steps": self.settling_steps,
            "changing_run": self.changing_run,
            **{name: getattr(self, name) for name in _COMPILE_FIELDS},
        }


_COMPILE_FIELDS = (
    "graphs_compiled", "graphs_loaded", "compile_seconds", "load_seconds", "store_hits", "store_misses",
    "store_loads",
    "background_started", "background_used", "background_wasted", "graphs_uncached",
    "rungs_warmed", "rungs_used", "warm_seconds",
    "aot_compiled", "aot_loaded", "aot_checked", "aot_refused", "aot_seconds", "aot_load_seconds", "aot_background",
    "checks", "disagreements", "check_seconds", "eager_forms", "dead_nonfinite",
)


# what :meth:`Stats.work` reports
_WORK = ("graphs_compiled", "compile_seconds", "graphs_loaded", "store_loads", "load_seconds", "aot_compiled",
         "aot_seconds", "aot_loaded", "aot_load_seconds", "checks", "check_seconds")


def _count(n: float, noun: str) -> str:
    return f"{n:g} {noun}" + ("" if n == 1 else "s")


def lowest_fill(fill: Mapping[str, float]) -> float | None:
    """The lowest ``real / cap`` of a fill (``Stats.fill``, ``mean_fill``),
    systems aside (a system is whole: its fill says nothing of dead rows);
    None for no key."""
    return min((value for key, value in fill.items() if key != "systems"), default=None)


def caps_changed(before: Mapping[str, int], after: Mapping[str, int], fitting: bool) -> str:
    """What a change of caps did, with each changed cap: "fitted (atoms 80
    -> 65, ...)" (``fitting``: the call fits them, ``cap_policy="tight"``),
    "shrank (...)" when every changed cap went down, else "grew (...)"."""
    changed = {key: (before.get(key), new) for key, new in after.items() if before.get(key) != new}
    down = all(old is not None and new < old for old, new in changed.values())
    verb = "fitted" if fitting else "shrank" if changed and down else "grew"
    return f"{verb} ({', '.join(f'{key} {old} -> {new}' for key, (old, new) in changed.items())})"
