"""The routes a padded step can take: the eager model, ``torch.compile``,
an ahead-of-time package; and the records of what each holds.

A route is one interface (:class:`Route`): :meth:`~Route.key` (what one graph
or package of it serves; None: it does not take this step),
:meth:`~Route.obtain` (build or load what runs a key), :meth:`~Route.run`
(run it) and, on a key's first use, :meth:`~Route.reference` (the eager step
its numbers are checked against) with :meth:`~Route.passed` /
:meth:`~Route.refuse` (the verdict). A route that cannot take a step hands it
to the route below it (``fallback``): package -> ``torch.compile`` -> eager.
Which of them runs, and when, is the compile manager's
(:meth:`ddpad._manager.CompileManager.dispatch`), which writes what became of
each key into :class:`Records`; a route writes there only its refusals.
A route over another (a CUDA graph replaying a package) is one more
:class:`Route` with the package as its fallback: the call path does not change.

A model that pads at its own seam inside its forward (UMA) takes packages
through :class:`SeamPackageRoute`: the part after the seam (the adapter's
compile region) is replaced, inside ddpad's own wrapper of the model, by a
:class:`RegionPackages` that runs it through its own chain (the part's
packages, its ``torch.compile``, the part eager), dispatched by the same
manager; what comes before the seam (the model's graph generation) stays eager.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

import torch

from ._aot import Call, Packages, Refused, differentiable, form_of, package_form
from ._compile import compile_model, run_step
from ._stats import Stats
from ._store import StoreBinding
from ._strict import call_form

__all__ = ["CompiledRoute", "EagerRoute", "PackageRoute", "Records", "RegionPackages", "Route", "SeamPackageRoute",
           "State", "Step"]

log = logging.getLogger("ddpad")

Key = tuple[Any, ...]  # (call form, caps as items)


class State(enum.Enum):
    """What became of one route's key."""

    READY = "ready"  # built or loaded, not yet checked (or no check asked)
    CHECKED = "checked"  # its first call agreed with the eager step
    BUILDING = "building"  # built in another process; the route below runs meanwhile
    REFUSED = "refused"  # the route cannot take it (or it disagreed): the route below runs


class Records:
    """What each route holds, per key (:class:`State`, and why for a
    refusal): the one table the compile manager, the routes and
    :class:`~ddpad.Stats` (``routes``) share (which route answered each caps
    and call form is the manager's ``records``). A route's key is its own (``torch.compile``: caps and call form;
    a package: the model's weights and the padded shapes); a route records
    refusals of a whole call form under a key of its choosing."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, Hashable], State] = {}
        self.why: dict[tuple[str, Hashable], str] = {}  # refusals, and what disagreed
        self.said: set[tuple[str, Hashable]] = set()  # what a route said once

    def get(self, route: str, key: Hashable) -> State | None:
        return self.states.get((route, key))

    def set(self, route: str, key: Hashable, state: State, why: str = "") -> None:
        self.states[route, key] = state
        if why:
            self.why[route, key] = why

    def counts(self) -> dict[str, dict[str, int]]:
        """Per route, how many keys are in each state."""
        out: dict[str, dict[str, int]] = {}
        for (route, _), state in self.states.items():
            per = out.setdefault(route, {})
            per[state.value] = per.get(state.value, 0) + 1
        return out

    def refused(self, route: str) -> dict[Hashable, str]:
        """The keys ``route`` refused, and why."""
        return {key: self.why.get((name, key), "") for (name, key), state in self.states.items()
                if name == route and state is State.REFUSED}

    def say_once(self, route: str, what: Hashable) -> bool:
        """True the first time ``route`` has ``what`` to say (a warning said once per call form)."""
        if (route, what) in self.said:
            return False
        self.said.add((route, what))
        return True

    def forget(self, route: str, keep: Callable[[Hashable], bool]) -> None:
        """Drop ``route``'s records whose key ``keep`` rejects (a re-keyed route's old keys)."""
        for name, key in [k for k in self.states if k[0] == route and not keep(k[1])]:
            self.states.pop((name, key), None)
            self.why.pop((name, key), None)


class Step:
    """One padded call as a route sees it.

    ``padded`` is the padded input (a model padding at its own seam: its
    unpadded input), ``caps`` the caps it is padded to (the seam's model:
    filled in while it runs; None: caps nobody records), ``source`` the
    caller's own input (whether the caller differentiates the outputs, and
    what a worker is sent). The route that answered sets ``route`` and, when
    a compiled graph or package ran, ``compiled``; ``memo`` holds what a
    route worked out for its key and needs again to run (the package route:
    the call's flat tensors).
    """

    __slots__ = ("args", "caps", "compiled", "kwargs", "memo", "padded", "route", "source")

    def __init__(self, padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any], source: Any = None,
                 caps: dict[str, int] | None = None) -> None:
        self.padded, self.args, self.kwargs, self.source, self.caps = padded, args, kwargs, source, caps
        self.route = ""
        self.compiled = False
        self.memo: Any = None

    def key(self) -> Key:
        """What one graph or package serves: the call form and the caps (as they are now)."""
        return (call_form(self.args, self.kwargs), tuple(self.caps.items()) if self.caps is not None else ())


class Route(Protocol):
    """One way to run a padded step (see the module's docstring).

    ``checked``: each key's first run is checked against :meth:`reference`;
    False for a route that holds nothing to build or check (the eager step,
    the reference itself; a seam model's wrapper, whose parts are
    dispatched and checked): it only runs, keyed and recorded by nobody. ``late_key``: the key is known
    only after the run (a model sizing its caps at its own seam): it is asked
    again then. ``fallible``: a first run that raises is a refusal, not an error.
    """

    name: str
    fallback: Route | None
    checked: bool
    late_key: bool
    fallible: bool

    def key(self, step: Step) -> Hashable | None:
        """What one graph or package of this route serves for ``step``; None:
        this route does not take it (the step goes to the fallback)."""
        ...

    def obtain(self, key: Hashable, step: Step, building: bool) -> State:
        """Build or load what runs ``key`` (``building``: it was building on an
        earlier call): READY, BUILDING (elsewhere; the fallback runs
        meanwhile) or REFUSED (recorded and said by the route)."""
        ...

    def run(self, key: Hashable, step: Step) -> Any:
        """The step's outputs through what :meth:`obtain` made ready (unchecked)."""
        ...

    def reference(self, step: Step, padded: Any) -> Any:
        """The eager step on ``padded`` (the input as it was before the run), for the first-use check."""
        ...

    def passed(self, key: Hashable) -> None:
        """``key``'s first run agreed with the eager step."""
        ...

    def refuse(self, key: Hashable, step: Step, why: str) -> None:
        """``key``'s first run disagreed or raised (``why``; the manager has
        recorded ``key`` refused): record what else the refusal covers, say so."""
        ...

    def close(self) -> None:
        """Save or stop what this route holds (called once, at the model's close)."""
        ...


class _Plain:
    """A route with nothing to build or check (``checked = False``): the
    manager only runs it; the other members are the protocol's, never called."""

    fallback: Route | None = None
    checked = False
    late_key = False
    fallible = False

    def key(self, step: Step) -> Hashable | None:
        return ()

    def obtain(self, key: Hashable, step: Step, building: bool) -> State:
        return State.READY

    def reference(self, step: Step, padded: Any) -> Any:
        raise NotImplementedError  # (never asked: not checked)

    def passed(self, key: Hashable) -> None:
        pass

    def refuse(self, key: Hashable, step: Step, why: str) -> None:
        pass

    def close(self) -> None:
        pass


class EagerRoute(_Plain):
    """The model as it is, on the padded input: the reference every check
    compares with, and the route of caps whose compiled numbers disagreed."""

    name = "eager"

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None,
                 dynamo_config: Mapping[str, Any]) -> None:
        self.model, self.call, self.dynamo_config = model, call, dict(dynamo_config)

    def run(self, key: Hashable, step: Step) -> Any:
        step.route = self.name
        return self.reference(step, step.padded)

    def reference(self, step: Step, padded: Any) -> Any:
        """The eager step on ``padded`` (the same input a compiled step had), with the step's arguments."""
        return run_step(self.model, self.call, self.dynamo_config, padded, step.args, step.kwargs)


class _SeamEager(_Plain):
    """The eager step of a model padding at its own seam whose compiled part
    is installed in it: the part runs eager under ``force_eager``."""

    name = "eager"

    def __init__(self, compiled: CompiledRoute) -> None:
        self.compiled = compiled

    def run(self, key: Hashable, step: Step) -> Any:
        step.route = self.name
        return self.compiled.forced_eager(step, step.padded, again=False)


class CompiledRoute:
    """``torch.compile``'s graphs (kept in the compile store when one is
    bound), one per caps and call form; caps whose first call disagreed with
    the eager step run eager from then on (its fallback).

    Parameters
    ----------
    model, call, dynamo_config, stats
        The model, the adapter's step and Dynamo flags; where compiles and disagreements are counted.
    region, compile_kwargs
        What of the model compiles (a model padding at its own seam: what
        comes after it) and ``torch.compile``'s arguments.
    binding
        The model's place in the compile store (None: none).
    seam
        The model pads at its own seam: its caps are known after the
        compiled part ran, and its eager reference runs that part eager.
    lazy
        Compile on the first step that needs it (under the package route:
        importing Dynamo takes seconds a loaded package never needs).
    keyed
        The key of a step (default: its call form and caps; the part after a
        model's seam, whose caps nobody records: its padded shapes).
    """

    name = "torch.compile"
    checked = True
    fallible = False

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
                 stats: Stats, *, region: Callable[..., Any] | None,
                 compile_kwargs: Mapping[str, Any], binding: StoreBinding | None, seam: bool, lazy: bool = False,
                 keyed: Callable[[Step], Hashable] = Step.key) -> None:
        self.eager = EagerRoute(model, call, dynamo_config)
        self.fallback: Route = _SeamEager(self) if seam else self.eager
        self.model, self.call, self.dynamo_config, self.stats = model, call, dict(dynamo_config), stats
        self.keyed = keyed
        self.region, self.compile_kwargs = region, dict(compile_kwargs)
        self.binding, self.seam, self.late_key = binding, seam, seam
        self.compiled: Callable[..., Any] | None = None if lazy else self._compile()

    def _compile(self) -> Callable[..., Any]:
        return compile_model(self.model, self.stats, self.region, self.binding, **self.compile_kwargs)

    def key(self, step: Step) -> Hashable:
        return self.keyed(step)

    def obtain(self, key: Hashable, step: Step, building: bool) -> State:
        if self.compiled is None:  # (Dynamo builds each graph inside its first call, from the store when bound)
            self.compiled = self._compile()
        return State.READY

    def run(self, key: Hashable, step: Step) -> Any:
        """One compiled step, unchecked."""
        compiled = self.compiled
        assert compiled is not None  # (obtained first)
        step.route, step.compiled = self.name, True
        if self.binding is None:
            return run_step(compiled, self.call, self.dynamo_config, step.padded, step.args, step.kwargs)
        try:
            return run_step(compiled, self.call, self.dynamo_config, step.padded, step.args, step.kwargs)
        finally:
            self.binding.flush()  # what compiled lazily in this call (a backward) joins its entry

    def reference(self, step: Step, padded: Any) -> Any:
        if not self.seam:
            return self.eager.reference(step, padded)
        return self.forced_eager(step, padded, again=True)

    def forced_eager(self, step: Step, padded: Any, again: bool) -> Any:
        """A model padding at its own seam, its compiled part run eager
        (``force_eager``), padded at the seam through the active context
        (``again``: after the compiled step padded it, to the same caps; the
        resolutions are not recorded twice)."""
        compiled = self.compiled
        assert compiled is not None  # (a model padding at its own seam compiles its region up front)
        scope = getattr(step.caps, "scope", None)
        recorded = len(scope.rows) if again and scope is not None else None
        try:
            with torch.compiler.set_stance("force_eager"):
                return run_step(compiled, self.call, self.dynamo_config, padded, step.args, step.kwargs)
        finally:
            if recorded is not None:
                del scope.rows[recorded:]  # the seam resolved the same caps again

    def passed(self, key: Hashable) -> None:
        pass

    def refuse(self, key: Hashable, step: Step, why: str) -> None:
        self.stats.eager_forms += 1
        log.warning("ddpad: %s disagrees with the eager step at caps %s (%s): these caps and call form run eager "
                    "from now on; a compiler bug: report it to PyTorch with the model", self.name,
                    dict(step.caps) if step.caps is not None else "?", why)

    def close(self) -> None:
        if self.binding is not None:
            self.binding.flush()


class PackageRoute:
    """Ahead-of-time packages (:class:`~ddpad._aot.Packages`: one per caps
    and call form, from the store or built) of a whole step or of the part
    after a model's seam. A call form the packages cannot take (tracing or
    exporting failed, a package raised or disagreed: for these weights only)
    is refused as a whole and runs ``fallback``; so does each call of a
    caller who differentiates the outputs (a package returns plain tensors),
    and each step while its package is built in a worker process
    (``elsewhere``: given the build name and the step, None while it builds,
    ``""`` once built, else why not).
    """

    name = "package"
    checked = True
    late_key = False
    fallible = True

    def __init__(self, packages: Packages, fallback: Route, records: Records,
                 elsewhere: Callable[[str, Step], str | None] | None = None) -> None:
        self.packages, self.fallback, self.records, self.elsewhere = packages, fallback, records, elsewhere
        self.id = id(packages)  # (records of two parts' packages stay apart)

    def key(self, step: Step) -> Hashable | None:
        old = self.packages.rebind()
        if old is not None:  # the model changed: its old packages' records go, and refusals bound to them
            self.records.forget(self.name, lambda key: old not in key)
        one = step.memo = Call.of(step.padded, step.args, step.kwargs)
        if differentiable(step.source if step.source is not None else step.padded):
            self._differentiated(one.constants)  # (every call, built or not)
            return None
        # (the packages' own identity too: two parts of one architecture and weights load their own)
        return (self.packages.key, form_of(one), self.id)

    def obtain(self, key: Hashable, step: Step, building: bool) -> State:
        one: Call = step.memo
        constants, records = one.constants, self.records
        if records.get(self.name, self._form(constants)) or records.get(self.name, self._form(constants, key[0])):
            return State.REFUSED
        builds = self.elsewhere
        elsewhere = (lambda name: builds(name, step)) if builds is not None and step.caps is not None else None
        try:
            ready = self.packages.obtain(key, one, elsewhere, building)
        except Refused as exc:
            self._refuse(self._form(constants), str(exc), said=exc.said)
            return State.REFUSED
        return State.READY if ready else State.BUILDING

    def run(self, key: Hashable, step: Step) -> Any:
        out = self.packages.run(key, step.memo)
        step.route, step.compiled = self.name, True
        return out

    def reference(self, step: Step, padded: Any) -> Any:
        p = self.packages
        return run_step(p.model, p.call, p.dynamo_config, padded, step.args, step.kwargs)

    def passed(self, key: Hashable) -> None:
        self.packages.checked()

    def refuse(self, key: Hashable, step: Step, why: str) -> None:
        """A package that raised or disagreed on its first call: set aside,
        its call form refused for these weights."""
        caps = dict(step.caps) if step.caps else "?"
        reason = self.packages.discard(key, f"its package at caps {caps} {why}")
        self._refuse(self._form(step.memo.constants, key[0]), reason)

    def _form(self, constants: tuple[Any, ...], weights: str | None = None) -> Hashable:
        """The record of a whole call form of these packages (``weights``: refused for those weights only);
        its constants last, as :attr:`~ddpad._manager.CompileManager.refused` reads them."""
        return ("form", self.id, constants) if weights is None else ("form", self.id, weights, constants)

    def _refuse(self, form: Hashable, reason: str, said: bool = False) -> None:
        self.records.set(self.name, form, State.REFUSED, reason)
        self.packages.stats.aot_refused += 1
        if not said:
            log.warning("ddpad: compile_mode='aot' falls back to torch.compile for this call form: %s", reason)

    def _differentiated(self, constants: tuple[Any, ...]) -> None:
        """A caller who differentiates the outputs: said and counted once per
        call form; the form's package still serves the calls that do not."""
        if not self.records.say_once(self.name, ("differentiated", self.id, constants)):
            return
        self.packages.stats.aot_refused += 1
        log.warning("ddpad: compile_mode='aot' falls back to torch.compile for each call where the caller "
                    "differentiates the returned outputs (an input requires grad): a package returns plain tensors")

    def close(self) -> None:
        self.fallback.close()


class RegionPackages(torch.nn.Module):
    """The part of a model after its own seam, run as ahead-of-time packages
    (one per padded shape and call form); a call the packages cannot take
    runs ``torch.compile`` of the part (compiled on first need, its first
    call per shape checked against the part's eager step), through
    ``dispatch`` (the compile manager's). The part must take tensors in
    dicts, lists and tuples, and plain constants (the package's inputs and key).

    A module (it takes the part's place inside the model); which route
    answered its last call is :attr:`answered`.
    """

    def __init__(self, part: torch.nn.Module, packages: Packages, compiled: CompiledRoute, records: Records,
                 dispatch: Callable[[Route, Step], Any]) -> None:
        super().__init__()
        # (named as torch.compile's wrapper names the module it wraps: a state dict's keys read the same way)
        self._orig_mod = part
        self._route = PackageRoute(packages, compiled, records)
        self._dispatch = dispatch
        self._answered = ""
        self._source: Any = None  # the caller's own input (whether the caller differentiates the outputs)

    @property
    def answered(self) -> str:
        """The route that answered the last call: ``package``, ``torch.compile`` or ``eager``."""
        return self._answered

    def serve(self, source: Any) -> None:
        """Whose call the next ones are: the model's own input (whether its
        caller differentiates the outputs; not the part's input, which the
        model may mark as requiring grad itself); None: the part's input."""
        self._source = source

    @property
    def part(self) -> torch.nn.Module:
        """The part of the model these packages run."""
        return self._orig_mod

    @property
    def packages(self) -> Packages:
        """The part's packages."""
        return self._route.packages

    def forward(self, padded: Any, *args: Any, **kwargs: Any) -> Any:
        step = Step(padded, args, kwargs, self._source)
        out = self._dispatch(self._route, step)
        self._answered = step.route
        return out


def part_key(step: Step, part: torch.nn.Module) -> Hashable:
    """The key of a call of ``part``, after a model's seam (no caps recorded):
    its padded shapes and constants, and the part (two parts may take the
    same shapes; each has its own graphs and checks)."""
    return (package_form(step.padded, step.args, step.kwargs), id(part))


class SeamPackageRoute(_Plain):
    """Packages for a model that pads at its own seam (see the module's
    docstring): the model runs eager up to the seam, and its compile region
    (``region``, the adapter's hook, given a function that makes each part's
    :class:`RegionPackages`) runs as packages after it. The step's route is
    the one its parts answered on (the least compiled of them)."""

    name = "package"

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None, *,
                 region: Callable[..., Any], parts: Callable[[torch.nn.Module], RegionPackages]) -> None:
        self.model, self.call = model, call
        self.parts: list[RegionPackages] = []

        def packaged(part: torch.nn.Module) -> RegionPackages:
            one = parts(part)
            self.parts.append(one)
            return one

        region(model, packaged)  # (replaces the part inside ddpad's own wrapper of the model, in place)

    def run(self, key: Hashable, step: Step) -> Any:
        for part in self.parts:
            part.serve(step.padded)
        try:
            # no Dynamo flags here: only a part's torch.compile fallback reads them (and sets them itself)
            out = run_step(self.model, self.call, {}, step.padded, step.args, step.kwargs)
        finally:
            for part in self.parts:
                part.serve(None)
        answered = {part.answered for part in self.parts} - {""}
        for route in (EagerRoute.name, CompiledRoute.name, self.name):
            if route in answered:
                step.route = route
                break
        else:
            step.route = EagerRoute.name  # (no part ran)
        step.compiled = step.route != EagerRoute.name
        return out
