"""The compile manager: what a wrapped model has built, where, and by which
route, apart from the call path.

One :class:`CompileManager` per :class:`~ddpad.PaddedModel` owns the compile
store's binding, the route chain (:mod:`._routes`: package ->
``torch.compile`` -> eager, as the options ask), the first-use checks, the
ready caps (:class:`~ddpad._ladder.Ladder`: warmed rungs, background
workers'), the worker processes (background compiles, package builds), the
tight sizing that decides how far ahead they build, and one :class:`Record`
per caps and call form that ran: which route answered it, and whether a
compiled graph or package exists for it. :class:`~ddpad.Stats` is created
here and reads the ladder's counts. The call path asks :meth:`run` for a
step's outputs and tells :meth:`note` which step succeeded.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._aot import Packages, first_line
from ._background import PACKAGE_BUILD, Background, PackageBuilds, reaches_worker
from ._capacity import CapResolution, TightCaps
from ._ladder import Ladder
from ._options import WrapOptions
from ._routes import (CompiledRoute, EagerRoute, Key, PackageRoute, Records, RegionPackages, Route,
                      SeamPackageRoute, State, Step, part_key)
from ._stats import Stats
from ._store import CompileStore, StoreBinding, aot_binding, bind_store
from ._verify import check, fresh, nonfinite
from ._warm import warm

if TYPE_CHECKING:
    from ._adapter import Adapter

__all__ = ["CompileManager", "Record"]

log = logging.getLogger("ddpad")

_REFUSED = object()  # a first use refused: the route below answers


@dataclasses.dataclass
class Record:
    """What became of one caps and call form: the route that answered its
    last step, and whether a compiled graph or package ran for it (its caps
    are then ready: a later growth to them compiles nothing)."""

    route: str
    compiled: bool


class CompileManager:
    """Build, load, check and keep what one wrapped model runs (see the module's docstring).

    Parameters
    ----------
    owner
        The :class:`~ddpad.PaddedModel` served (held weakly): what a worker
        process rebuilds (its model, adapter, source and current caps).
    model, adapter, call, dynamo_config, compile_region
        The model, its adapter, the adapter's step, Dynamo flags and compile region.
    options
        ``wrap``'s options.
    caps
        The preset caps (``Stats`` starts from them); ``fitted``: a tight run fitted them.
    seam
        The model pads at its own seam inside its forward.
    """

    def __init__(self, owner: Any, model: torch.nn.Module, *, adapter: Adapter | None,
                 call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
                 compile_region: Callable[..., Any] | None, options: WrapOptions, caps: Mapping[str, int],
                 fitted: bool, seam: bool) -> None:
        self._owner = weakref.ref(owner)
        self.ladder = Ladder()
        self.table = Records()  # by route and its key: what each route holds (ready, building, checked, refused)
        self.stats = Stats(caps=dict(caps), ladder=self.ladder, records=self.table)
        self.records: dict[Key, Record] = {}  # by caps and call form: the route that answered
        self._model = model
        self._adapter = adapter.name if adapter is not None else None
        self.store_binding: StoreBinding | None = None
        self.background: Background | None = None
        self.aot: Packages | None = None  # compile_mode="aot": packages first, torch.compile where refused
        self.package_builds: PackageBuilds | None = None  # packages built in worker processes
        opts = options
        if opts.compile and opts.compile_cache is not None:  # (None for a backend with nothing to store)
            self.store_binding = bind_store(model, opts.compile_cache, adapter, dynamo_config, **opts.compile_kwargs)
            if self.store_binding is not None:
                weakref.finalize(owner, self.store_binding.flush)  # a backward compiled after the last call
        self.sizer: TightCaps | None = None  # cap_policy="tight"
        tight = opts.tight_policy(self.store_binding is not None)
        if tight is not None:  # preset caps a tight run fitted are kept; others are fitted after the window
            if opts.warm_ladder:  # fit on the first call, as ddpad precompile does: the ladder is warmed
                tight = dataclasses.replace(tight, settle=1)  # before the run, not in a stall ten steps in
            self.sizer = TightCaps(tight, settled=fitted)
        # every compiled graph's first call (per caps and call form) checked against the eager step
        self.verify = opts.compile and opts.verify
        if opts.compile and opts.background_compile is not None:
            root = _store_root(opts.compile_cache)
            if adapter is None or root is None:
                raise ValueError("ddpad: background_compile needs compile_cache= and an adapter (its workers "
                                 "compile into the store and rebuild the padder from the adapter)")
            # (under compile_mode="aot" its workers build the next rung's package)
            self.background = Background(owner, self.ladder, root, float(opts.background_compile),
                                         opts.background_workers, opts.compile_kwargs, self.sizer,
                                         options=PACKAGE_BUILD if opts.compile_mode == "aot" else None)
        self.route: Route = self._chain(owner, model, call, dynamo_config, compile_region, opts, adapter, seam)
        # the unpadded model, for the calls of a refused key (its owner's; NotImplemented where it cannot run)
        self.unpadded: Callable[[Step], Any] | None = None

    def _chain(self, owner: Any, model: torch.nn.Module, call: Callable[..., Any] | None,
               dynamo_config: Mapping[str, Any], region: Callable[..., Any] | None, opts: WrapOptions,
               adapter: Adapter | None, seam: bool) -> Route:
        """The top of the route chain the options ask for: eager; ``torch.compile``
        (-> eager); packages (-> ``torch.compile`` -> eager), a model padding
        at its own seam: its compile region's."""
        if not opts.compile:
            return EagerRoute(model, call, dynamo_config)
        if opts.compile_mode == "aot" and seam:
            seam_packages = self._seam_packages(model, call, dynamo_config, region, opts, adapter)
            if seam_packages is not None:
                return seam_packages
        elif opts.compile_mode == "aot":
            self.aot = _packages(model, call, dynamo_config, self.stats, opts, adapter)
        compiled = CompiledRoute(model, call, dynamo_config, self.stats, region=region,
                                 compile_kwargs=opts.compile_kwargs, binding=self.store_binding, seam=seam,
                                 lazy=self.aot is not None)
        if self.aot is None:
            return compiled
        elsewhere = None
        root = _store_root(opts.compile_cache)
        if root is not None and _builds_elsewhere(opts, adapter):
            self.package_builds = PackageBuilds(owner, root, opts.background_workers, opts.compile_kwargs,
                                                self.stats)
            elsewhere = self._built_elsewhere
        return PackageRoute(self.aot, compiled, self.table, elsewhere)

    def _seam_packages(self, model: torch.nn.Module, call: Callable[..., Any] | None,
                       dynamo_config: Mapping[str, Any], region: Callable[..., Any] | None, opts: WrapOptions,
                       adapter: Adapter | None) -> Route | None:
        """The package route of a model padding at its own seam: its compile
        region's packages (:class:`~ddpad._routes.SeamPackageRoute`), built
        in this process; None (said once: ``torch.compile``) without a region."""
        if region is None:
            log.warning("ddpad: compile_mode='aot' falls back to torch.compile: this model pads at its own seam "
                        "inside its forward and its adapter names no compile region (the part after the seam "
                        "that a package is built of)")
            return None
        if opts.aot_build == "background":
            log.warning("ddpad: aot_build='background' is not taken by a model padding at its own seam: its "
                        "packages are built in this process, on the first call at new caps")
        stats, binding, table = self.stats, self.store_binding, self.table

        def parts(part: torch.nn.Module) -> RegionPackages:
            compiled = CompiledRoute(part, None, dynamo_config, stats, region=None,
                                     compile_kwargs=opts.compile_kwargs, binding=binding, seam=False, lazy=True,
                                     keyed=lambda step: part_key(step, part))
            return RegionPackages(part, _packages(part, None, dynamo_config, stats, opts, adapter), compiled, table,
                                  self.dispatch)

        route = SeamPackageRoute(model, call, region=region, parts=parts)
        self.aot = route.parts[0].packages if route.parts else None
        return route

    # -- the call path's side -----------------------------------------------------

    def run(self, step: Step) -> Any:
        """The step's outputs, through the first route of the chain that takes it."""
        return self.dispatch(self.route, step)

    def run_eager(self, step: Step) -> Any:
        """The step on the eager route, the bottom of the chain (a tight
        sizing's window: nothing is built at caps about to be fitted)."""
        route = self.route
        while route.fallback is not None:
            route = route.fallback
        return route.run((), step)

    def dispatch(self, route: Route, step: Step) -> Any:
        """``step`` through ``route``, or the first route below it that takes
        it: a key ready and checked only runs (nearly every call); a key's
        first use builds or loads it (:meth:`Route.obtain`), runs it and
        checks it against the eager step (:meth:`_first_use`); a key refused,
        or building elsewhere, goes to the route below."""
        table = self.table
        while True:
            if not route.checked:  # the eager step itself (or a seam's parts, each dispatched here): nothing to build
                return route.run((), step)
            key = route.key(step)
            if key is not None:
                state = table.states.get((route.name, key))
                # nearly every call: a key that passed its check (or needs none) runs
                if state is (State.CHECKED if self.verify else State.READY) and not route.late_key:
                    return route.run(key, step)
                if state is None or state is State.BUILDING:
                    state = route.obtain(key, step, state is State.BUILDING)
                    if state is not State.REFUSED:
                        table.set(route.name, key, state)
                if state is State.READY or state is State.CHECKED:
                    out = self._first_use(route, key, step, state)
                    if out is not _REFUSED:
                        return out
                elif state is State.REFUSED and self.unpadded is not None and not route.fallback.checked:
                    # refused down to the eager step: the model's own, unpadded step is as exact and
                    # takes no dead rows (orb at one thread: 1.67 x orb's own step padded, 1.00 x unpadded)
                    out = self.unpadded(step)
                    if out is not NotImplemented:
                        return out
            fallback = route.fallback
            assert fallback is not None  # (the eager route, at the bottom, takes every step)
            route = fallback

    def _first_use(self, route: Route, key: Hashable, step: Step, state: State) -> Any:
        """Run ``key`` and, on its first use, check it against the eager step
        on the same input (made before the run, in new containers: a model
        may write into its input); a key that disagrees, or (a fallible
        route's) raises, is refused and answered by the eager step or the
        route below (``_REFUSED``). A late key (a model sizing caps at its
        seam) is known after the run and checked then."""
        checking = self.verify
        before = fresh(step.padded) if checking and state is not State.CHECKED else step.padded
        try:
            out = route.run(key, step)
        except Exception as exc:
            if not route.fallible or state is State.CHECKED:
                raise
            self._refuse(route, key, step, f"raised on its first call ({type(exc).__name__}: {first_line(exc)})")
            return _REFUSED
        if route.late_key:
            key = route.key(step)
            state = self.table.states.get((route.name, key))  # type: ignore[assignment]
            if state is State.CHECKED:
                return out
            if state is State.REFUSED:
                step.route = EagerRoute.name
                return route.reference(step, before)
        if not checking:
            self.table.set(route.name, key, State.READY)
            return out
        ref, why = check(self.stats, self._model, out, lambda: route.reference(step, before))
        dead = self._nonfinite(ref, step)
        if why is None:
            self.table.set(route.name, key, State.CHECKED)
            route.passed(key)
            return out
        if dead:
            why += f"; the eager step also has NaN or inf in dead rows ({', '.join(dead)})"
        self._refuse(route, key, step, f"disagrees with the eager step ({why}; a compiler bug: report it to "
                                       "PyTorch)" if route.fallible else why)
        step.route = EagerRoute.name
        return ref

    def _nonfinite(self, ref: Any, step: Step) -> list[str]:
        """The outputs of the eager step ``ref`` with NaN or inf in dead rows
        only (a padding defect: counted, and said once); NaN or inf in a
        real row is an error, whatever the compiled step gave: the step's
        own, not the compiler's."""
        names = nonfinite(ref)
        if not names:  # (nearly every check)
            return []
        owner = self._owner()
        seam = owner is None or getattr(owner, "pad_in_forward", True)
        real = names if seam else nonfinite(owner.padder.unpad(ref))
        caps = dict(step.caps) if step.caps is not None else "?"
        if real:
            raise FloatingPointError(
                f"ddpad: the eager step gives NaN or inf in real rows ({', '.join(real)}) at caps {caps}: not a "
                f"compiler bug. Either the model's own answer on this input is not finite (run the unpadded "
                f"model on it) or adapter {self._adapter!r}'s padding leaks into real rows")
        if not self.stats.dead_nonfinite:
            log.warning("ddpad: adapter %r's padded eager step gives NaN or inf in dead rows only (%s) at caps %s: "
                        "the real rows are finite and used, and a compiled step with the same NaN there is kept; "
                        "a padding defect in the adapter's dead atoms or edges (they must stay finite), not a "
                        "compiler bug", self._adapter, ", ".join(names), caps)
        self.stats.dead_nonfinite += 1
        return names

    def _refuse(self, route: Route, key: Hashable, step: Step, why: str) -> None:
        """``key`` is refused: the route below answers it from now on (the
        route records what else its refusal covers, and says so)."""
        self.table.set(route.name, key, State.REFUSED, why)
        route.refuse(key, step, why)

    def note(self, step: Step) -> bool:
        """Record the route that answered ``step`` (a call that succeeded, at
        the caps it committed); True when its caps and call form had no
        compiled graph or package before (a compile then is explained)."""
        key = step.key()
        record = self.records.get(key)
        new = record is None or not record.compiled
        if record is None:
            self.records[key] = Record(step.route, step.compiled)
        else:
            record.route, record.compiled = step.route, record.compiled or step.compiled
        return new

    def ready(self) -> list[dict[str, int]]:
        """Caps whose graphs are ready: they ran compiled before (Dynamo's
        cache or a loaded package holds them) or are rungs (warmed, or a
        background worker's)."""
        return [*self.ladder.ready, *(dict(caps) for (_, caps), r in self.records.items() if r.compiled)]

    def after_call(self, data: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   resolved: list[CapResolution], grew: bool, caps: Mapping[str, int]) -> None:
        """After a call that sized or grew caps (now ``caps``): background
        workers may start for the next rung; the ladder counts a rung a growth took."""
        owner = self._owner()
        if self.background is not None and owner is not None:
            self.background.after_call(owner, data, args, kwargs, resolved)
        if grew:
            self.ladder.count_use(caps)

    def poll(self) -> None:
        """Reap finished package builds (one frees a worker for the next queued)."""
        if self.package_builds is not None and self.package_builds.active:
            self.package_builds.poll()

    def warm(self, rungs: list[dict[str, int]], caps: Mapping[str, int],
             step: Callable[[Mapping[str, int]], Step]) -> list[dict[str, int]]:
        """Run ``step`` at each rung above ``caps`` and back at ``caps``
        (:func:`~ddpad._warm.warm`); each rung that ran becomes a ready rung,
        and each step that ran has its record. Returns the warmed rungs."""

        def noted(rung: Mapping[str, int]) -> None:
            self.note(step(rung))

        return warm(rungs, caps, noted, self.ladder)

    # -- what was built --------------------------------------------------------

    @property
    def refused(self) -> dict[Hashable, str]:
        """Call forms the package route refused, and why (empty without one)."""
        if self.aot is None:
            return {}
        # (a whole call form is refused: its constants name it)
        return {key[-1]: why for key, why in self.table.refused(PackageRoute.name).items()
                if isinstance(key, tuple) and key[0] == "form"}

    @property
    def store_key(self) -> str | None:
        """Where this model's work lands in the store: its packages' folder
        (``compile_mode="aot"``) or its graphs' model key; None without a store."""
        if self.aot is not None:
            return self.aot.key
        return self.store_binding.model_key if self.store_binding is not None else None

    def _built_elsewhere(self, name: str, step: Step) -> str | None:
        """The package build ``name`` in a worker (:meth:`PackageBuilds.status`);
        None (run ``torch.compile`` meanwhile) while caps are about to be fitted."""
        sizer, owner, builds = self.sizer, self._owner(), self.package_builds
        if (sizer is not None and not sizer.settled) or owner is None or builds is None or step.caps is None:
            return None
        return builds.status(name, owner, step.caps, step.source, step.args, step.kwargs)

    def close(self) -> None:
        """Stop background compiles and package builds (a worker stopped
        mid-build leaves no entry, only its lock file) and save what compiled lazily."""
        if self.background is not None:
            self.background.close()
        if self.package_builds is not None:
            self.package_builds.close()
        self.route.close()

    def finish_builds(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout`` seconds) for the packages worker
        processes build; how many are still building (0: none)."""
        return self.package_builds.wait(timeout) if self.package_builds is not None else 0


def _store_root(cache: str | Any | None) -> pathlib.Path | None:
    if cache is None:
        return None
    return pathlib.Path(cache.root if isinstance(cache, CompileStore) else cache).expanduser()


def _builds_elsewhere(opts: WrapOptions, adapter: Adapter | None) -> bool:
    """Whether packages are built in worker processes (``aot_build``; None:
    wherever a store and an adapter let a worker rebuild the model: another
    process loads the adapter by its name, or it pickles)."""
    if opts.aot_build == "background":
        if adapter is None:
            raise ValueError("ddpad: aot_build='background' needs an adapter (its workers rebuild the padder from it)")
        if not reaches_worker(adapter):
            raise ValueError(f"ddpad: aot_build='background' needs an adapter a worker process can rebuild: no "
                             f"built-in or plugin adapter {adapter.name!r} is this one, and it does not pickle (a "
                             "lambda or a local function among its hooks). Publish it as a plugin (the "
                             "'ddpad.adapters' entry point; ddpad.adapters.register reaches this process only), "
                             "give it module-level functions, or pass aot_build='foreground'")
        return True
    return opts.aot_build is None and adapter is not None and reaches_worker(adapter)


def _packages(model: torch.nn.Module, call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
              stats: Stats, opts: WrapOptions, adapter: Adapter | None) -> Packages:
    """The ahead-of-time packages of ``model`` (a whole step, or the part
    after a model's own seam), keyed in the store when one is given."""
    store = None
    model_key: Callable[[], str] | None = None
    if opts.compile_cache is not None:
        store = opts.compile_cache if isinstance(opts.compile_cache, CompileStore) \
            else CompileStore(opts.compile_cache)

        def model_key() -> str:  # (again when the model's hyper-parameters change)
            return aot_binding(model, store, adapter, dynamo_config)[1]
    return Packages(model, call, dynamo_config, stats, store, model_key)

