"""The run summary's lines: what ``ddpad run`` prints of a wrapped model's
:class:`~ddpad.Stats` after its steps. ``Stats`` keeps the counters; how
they read to a user is the command line's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddpad import CapEvent, Stats

__all__ = ["checks_line", "fill_line", "growth_line", "store_line"]


def growth_line(stats: Stats) -> str:
    """``growth calls: N (atoms 40 -> 56 (2 growths), ...)``: the calls on
    which caps grew (each one compile, however many caps grew on it), then
    each grown cap's first and last size and how many times it grew. With
    no growth, a fit of the caps (``cap_policy="tight"``) is said: the caps
    changed, and it compiled, without growing."""
    if not stats.growths:
        if stats.changing_run is not None and not stats.fits:
            return f"growth calls: 0 (tight caps kept at head room, {stats.changing_run}: a changing run)"
        if not stats.fits:
            return "growth calls: 0"
        return (f"growth calls: 0 (the caps changed once: fitted to the needs seen up to step "
                f"{stats.fits[0].call}, one compile; no cap grew after)")
    grown: dict[str, list[CapEvent]] = {}
    for event in stats.growths:
        grown.setdefault(event.key, []).append(event)
    caps = ", ".join(f"{key} {events[0].old} -> {events[-1].new}"
                     + (f" ({len(events)} growths)" if len(events) > 1 else "") for key, events in grown.items())
    return f"growth calls: {stats.growth_calls} ({caps})"


def fill_line(stats: Stats, policy: str) -> str:
    """``fill (tight, ...): atoms 0.990 (cap 516), ...``: real rows over the
    cap, the mean over the calls since the caps last changed, and the call
    that fitted them (``policy``: the cap policy's name, said first)."""
    fill = stats.mean_fill
    line = f"fill ({policy}, mean since the caps last changed): " + ", ".join(
        f"{k} {fill[k]:.3f} (cap {stats.caps[k]})" for k in sorted(fill))
    if stats.changing_run is not None:
        line += f"; caps kept at head room on {stats.changing_run} (a changing run)"
    elif stats.fits:
        changed = ", ".join(f"{e.key} {e.old} -> {e.new}" for e in stats.fits)
        line += f"; caps fitted on step {stats.fits[0].call} ({changed})"
    return line


def checks_line(stats: Stats, verify: bool = True) -> str:
    """What the first-use checks found, or (``verify`` False) that none ran."""
    if not verify:
        return "not checked against the eager step (--no-verify): the compiled graphs' numbers are as compiled"
    line = (f"checked against the eager step: {stats.checks} compiled graph(s) on their first call, "
            f"{stats.disagreements} disagreed ({stats.check_seconds:.2f} s)")
    if stats.eager_forms:
        line += f" ({stats.eager_forms} caps / call form(s) run eager: see the warnings above)"
    if stats.dead_nonfinite:
        line += f" ({stats.dead_nonfinite} with NaN or inf in dead rows: see the warning above)"
    return line


def store_line(stats: Stats) -> str:
    """The compile store's counts in words: how many of the graphs looked
    up were in it; what became of the others (compiled, or found in
    torch's own cache, then written to it); then background compiles,
    warm-ladder rungs and packages."""
    uncached = f", {stats.graphs_uncached} of them past torch's caches" if stats.graphs_uncached else ""
    aot = (f"; ahead-of-time packages: {stats.aot_compiled} built in {stats.aot_seconds:.1f} s, "
           f"{stats.aot_loaded} loaded in {stats.aot_load_seconds:.2f} s, {stats.aot_checked} checked against "
           f"eager, {stats.aot_refused} call form(s) on torch.compile"
           if stats.aot_compiled or stats.aot_loaded or stats.aot_refused else "")
    unused = stats.background_started - stats.background_used
    looked_up, own = stats.store_hits + stats.store_misses, stats.graphs_loaded - stats.store_loads
    found = f"compile store: found {stats.store_hits} of {_count(looked_up, 'graph')} in it"
    compiled = f"in {stats.compile_seconds:.1f} s{uncached}"
    if stats.graphs_compiled and own > 0:  # both: how many each
        made = f"compiled ({stats.graphs_compiled}, {compiled}) or found in torch's own cache ({own})"
    else:
        made = f"compiled {compiled}" if stats.graphs_compiled else "found in torch's own cache"
    missing = (f"; the {stats.store_misses} not in it {'was' if stats.store_misses == 1 else 'were'} {made}, "
               "then written to it" if stats.store_misses else "")
    loaded = f"; loading took {stats.load_seconds:.1f} s" if stats.graphs_loaded else ""
    return (f"{found}{missing}{loaded}; background compiles: "
            f"{stats.background_started} started, {stats.background_used} used"
            + (f" ({unused} unused: worker CPU time this run did not need)" if unused else "")
            + (f"; warm ladder: {stats.rungs_warmed} rung(s) in {stats.warm_seconds:.1f} s, {stats.rungs_used} "
               "growth(s) took one" if stats.rungs_warmed else "") + aot)


def _count(n: float, noun: str) -> str:
    return f"{n:g} {noun}" + ("" if n == 1 else "s")
