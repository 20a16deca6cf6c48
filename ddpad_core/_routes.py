"""The routes a padded step can take: the eager model, ``torch.compile``,
an ahead-of-time package.

A route answers one :class:`Step` (the padded input at fixed caps, the call's
arguments): on the first use of a key (the call form and the caps) it builds
or loads what runs them (a ``torch.compile`` graph, through Dynamo and the
compile store; a package, from the store or built) and checks its numbers
against the eager step once; later uses only run. A route that cannot take a
step, or whose numbers disagree, hands it to the route below it
(``fallback``): package -> ``torch.compile`` -> eager. Each route says in the
step which one answered (:attr:`Step.route`), which the compile manager
(:mod:`._manager`) records per key. A route wrapping another (a CUDA graph
replaying a package) is one more :class:`Route` with the package as its
fallback: the call path does not change.

A model that pads at its own seam inside its forward (UMA) takes packages
through :class:`SeamPackageRoute`: the part after the seam (the adapter's
compile region) is replaced, inside ddpad's own wrapper of the model, by a
:class:`RegionPackages` that runs it as one package per padded shape, the
same :class:`~ddpad._aot.AotRoute` a whole step's package uses; what comes
before the seam (the model's graph generation) stays eager.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ._aot import AotRoute, package_form
from ._compile import compile_model, run_step
from ._stats import Stats
from ._store import StoreBinding
from ._strict import call_form
from ._verify import FirstUse

__all__ = ["CompiledRoute", "EagerRoute", "PackageRoute", "RegionPackages", "Route", "SeamPackageRoute", "Step"]

Key = tuple[Any, ...]  # (call form, caps as items)


class Step:
    """One padded call as a route sees it.

    ``padded`` is the padded input (a model padding at its own seam: its
    unpadded input), ``caps`` the caps it is padded to (the seam's model:
    filled in while it runs; None: caps nobody records), ``source`` the
    caller's own input (whether the caller differentiates the outputs, and
    what a worker is sent). The route that answered sets ``route`` and, when
    a compiled graph or package ran, ``compiled``.
    """

    __slots__ = ("args", "caps", "compiled", "kwargs", "padded", "route", "source")

    def __init__(self, padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any], source: Any = None,
                 caps: dict[str, int] | None = None) -> None:
        self.padded, self.args, self.kwargs, self.source, self.caps = padded, args, kwargs, source, caps
        self.route = ""
        self.compiled = False

    def key(self) -> Key:
        """What one graph or package serves: the call form and the caps (as they are now)."""
        return (call_form(self.args, self.kwargs), tuple(self.caps.items()) if self.caps is not None else ())


class Route(Protocol):
    """One way to run a padded step (see the module's docstring)."""

    name: str

    def run(self, step: Step) -> Any:
        """The step's outputs: built or loaded and checked on its key's first
        use, handed to the fallback route where this one cannot take it."""
        ...

    def close(self) -> None:
        """Save or stop what this route holds (called once, at the model's close)."""
        ...


class EagerRoute:
    """The model as it is, on the padded input: the reference every check
    compares with, and the route of caps whose compiled numbers disagreed."""

    name = "eager"

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None,
                 dynamo_config: Mapping[str, Any]) -> None:
        self.model, self.call, self.dynamo_config = model, call, dict(dynamo_config)

    def run(self, step: Step) -> Any:
        step.route = self.name
        return self.reference(step.padded, step)

    def reference(self, padded: Any, step: Step) -> Any:
        """The eager step on ``padded`` (the same input a compiled step had), with the step's arguments."""
        return run_step(self.model, self.call, self.dynamo_config, padded, step.args, step.kwargs)

    def close(self) -> None:
        pass


class CompiledRoute:
    """``torch.compile``'s graphs (kept in the compile store when one is
    bound), each checked on its first call at given caps and call form
    (``checks``); caps that disagreed run eager from then on.

    Parameters
    ----------
    model, call, dynamo_config, stats
        The model, the adapter's step and Dynamo flags; where compiles are counted.
    region, compile_kwargs
        What of the model compiles (a model padding at its own seam: what
        comes after it) and ``torch.compile``'s arguments.
    binding
        The model's place in the compile store (None: none).
    checks
        The first-use checks (None: ``verify=False``).
    seam
        The model pads at its own seam: its caps are known after the
        compiled part ran, and its eager reference runs that part eager.
    lazy
        Compile on the first step that needs it (under the package route:
        importing Dynamo takes seconds a loaded package never needs).
    """

    name = "torch.compile"

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
                 stats: Stats, *, region: Callable[..., Any] | None, compile_kwargs: Mapping[str, Any],
                 binding: StoreBinding | None, checks: FirstUse | None, seam: bool, lazy: bool = False) -> None:
        self.eager = EagerRoute(model, call, dynamo_config)
        self.model, self.call, self.dynamo_config, self.stats = model, call, dict(dynamo_config), stats
        self.region, self.compile_kwargs = region, dict(compile_kwargs)
        self.binding, self.checks, self.seam = binding, checks, seam
        self.compiled: Callable[..., Any] | None = None if lazy else self._compile()

    def _compile(self) -> Callable[..., Any]:
        return compile_model(self.model, self.stats, self.region, self.binding, **self.compile_kwargs)

    def run(self, step: Step) -> Any:
        checks = self.checks
        if checks is None or step.caps is None:
            return self._step(step.padded, step)
        key = step.key()
        rekey = step.key if self.seam else None  # (its seam may grow the caps as it runs)
        out = checks.run(key, step.padded, lambda d: self._step(d, step),
                         lambda d, again: self._reference(d, step, again), step.caps, rekey)
        # eager: these caps disagreed before, or on this call (a steady call reads one flag and one empty dict)
        if checks.eager_only or (checks.eager and (step.key() if self.seam else key) in checks.eager):
            step.route = self.eager.name
        return out

    def _step(self, padded: Any, step: Step) -> Any:
        """One compiled step, unchecked."""
        compiled = self.compiled
        if compiled is None:
            compiled = self.compiled = self._compile()
        step.route, step.compiled = self.name, True
        if self.binding is None:
            return run_step(compiled, self.call, self.dynamo_config, padded, step.args, step.kwargs)
        try:
            return run_step(compiled, self.call, self.dynamo_config, padded, step.args, step.kwargs)
        finally:
            self.binding.flush()  # what compiled lazily in this call (a backward) joins its entry

    def _reference(self, padded: Any, step: Step, again: bool) -> Any:
        """The eager step on the same padded input as the compiled one; a model
        padding at its own seam runs its compiled part eager (``force_eager``),
        padded at the seam through the active context (``again``, after the
        compiled step padded it: to the same caps, and the resolutions are not
        recorded twice)."""
        if not self.seam:
            return self.eager.reference(padded, step)
        compiled = self.compiled
        assert compiled is not None  # (the compiled step ran first)
        scope = getattr(step.caps, "scope", None)
        recorded = len(scope.rows) if again and scope is not None else None
        try:
            with torch.compiler.set_stance("force_eager"):
                return run_step(compiled, self.call, self.dynamo_config, padded, step.args, step.kwargs)
        finally:
            if recorded is not None:
                del scope.rows[recorded:]  # the seam resolved the same caps again

    def close(self) -> None:
        if self.binding is not None:
            self.binding.flush()


class PackageRoute:
    """Ahead-of-time packages (:class:`~ddpad._aot.AotRoute`: one per caps and
    call form, from the store or built, checked once); a step they cannot
    take goes to ``fallback``, and so does each step while its package is
    built in a worker process (``elsewhere``: given the package's build name,
    None while it builds, ``""`` once built, else why not)."""

    name = "package"

    def __init__(self, packages: AotRoute, fallback: Route,
                 elsewhere: Callable[[str, Step], str | None] | None = None) -> None:
        self.packages, self.fallback, self.elsewhere = packages, fallback, elsewhere

    def run(self, step: Step) -> Any:
        builds = self.elsewhere
        elsewhere = (lambda name: builds(name, step)) if builds is not None and step.caps is not None else None
        out = self.packages.run(step.padded, step.args, step.kwargs, step.source, lambda: self.fallback.run(step),
                                elsewhere, step.caps)
        if not step.route:  # the package answered (or, on its first call, its check's eager step did)
            step.route, step.compiled = self.name, True
        return out

    def close(self) -> None:
        self.fallback.close()


class RegionPackages(torch.nn.Module):
    """The part of a model after its own seam, run as ahead-of-time packages
    (one per padded shape and call form, :class:`~ddpad._aot.AotRoute`); a
    call the packages cannot take runs ``torch.compile`` of the part
    (compiled on first need, its first call per shape checked against the
    part's eager step: ``checks``). The part must take tensors in dicts,
    lists and tuples, and plain constants (the package's inputs and key).

    A module (it takes the part's place inside the model); which route
    answered its last call is :attr:`answered`.
    """

    def __init__(self, part: torch.nn.Module, packages: AotRoute, compile_part: Callable[[], Callable[..., Any]],
                 dynamo_config: Mapping[str, Any], checks: FirstUse | None) -> None:
        super().__init__()
        # (named as torch.compile's wrapper names the module it wraps: a state dict's keys read the same way)
        self._orig_mod = part
        self._packages, self._compile_part, self._checks = packages, compile_part, checks
        self._dynamo_config = dict(dynamo_config)
        self._compiled: Callable[..., Any] | None = None  # (imports Dynamo: only once a call needs it)
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
    def packages(self) -> AotRoute:
        """The part's packages."""
        return self._packages

    def forward(self, padded: Any, *args: Any, **kwargs: Any) -> Any:
        self._answered = ""
        source = self._source if self._source is not None else padded
        out = self._packages.run(padded, args, kwargs, source, lambda: self._fallback(padded, args, kwargs))
        if not self._answered:  # the package answered (or, on its first call, its check's eager step did)
            self._answered = PackageRoute.name
        return out

    def _fallback(self, padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``torch.compile`` of the part, checked on each shape's first call."""
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = self._compile_part()
        checks = self._checks
        if checks is None:
            self._answered = CompiledRoute.name
            return run_step(compiled, None, self._dynamo_config, padded, args, kwargs)
        key = package_form(padded, args, kwargs)
        out = checks.run(key, padded, lambda d: run_step(compiled, None, self._dynamo_config, d, args, kwargs),
                         lambda d, again: self.part(d, *args, **kwargs))
        self._answered = EagerRoute.name if checks.eager_only or key in checks.eager else CompiledRoute.name
        return out


class SeamPackageRoute:
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

    def run(self, step: Step) -> Any:
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

    def close(self) -> None:
        pass
