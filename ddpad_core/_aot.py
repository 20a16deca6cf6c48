"""Ahead-of-time packages (``compile_mode="aot"``): one AOTInductor package
per caps and call form, loaded instead of traced.

The adapter's whole step at fixed caps (its forward, and forces / stress
the way the adapter takes them, autograd included) is traced by ``make_fx``
in fake mode into one aten graph (a data-dependent branch raises instead of
being baked in for the example's values), exported with ``torch.export``
and compiled by AOTInductor into a package. The package's bytes are an
entry of the compile store (atomic, checksummed, one build per entry across
processes: the store's lock), under the model's key, its weights' digest
(the package holds them), the caps and the call form. A steady call runs the
loaded package on the padder's stable buffers: no Dynamo, no guards.

Never a wrong number: the first call of a package in a process also runs
the eager step on the same padded input and compares (:mod:`._verify`); a
package that disagrees, or raises, is moved aside in the store with its
reason (no process rebuilds or re-checks it) and that form falls back to
``torch.compile``, whose own first call is checked in turn. A package names
what it was built for in its own metadata (model key, weights, caps and call
form), read before it is loaded: an entry holding another's package is moved
aside unrun. A package never outlives the weights it holds: a change to the
model's weights or hyper-parameters (:class:`~._weights.Watch`) re-keys the
route, and the packages of the model as it now is are loaded or built. A
step the route cannot take (a data-dependent branch, an op the exporter
refuses, a caller who differentiates the returned energy himself) falls back
with one line naming the reason, the model and its input as they were.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._compile import run_step
from ._noise import quiet_warnings
from ._stats import Stats
from ._store import CompileStore, _digest, model_fingerprint
from ._verify import check, fresh
from ._weights import Watch, packages_key

__all__ = ["AotRoute", "Refused", "package_form"]

log = logging.getLogger("ddpad")

# the package metadata entry naming what a package was built for (model key and weights / signature)
_ENTRY = "ddpad.entry"


class Refused(Exception):
    """The ahead-of-time route cannot take this step; the message says why.
    ``said``: the reason was already reported (a failed build worker's warning)."""

    def __init__(self, reason: str, *, said: bool = False) -> None:
        super().__init__(reason)
        self.said = said


class _Foreign(Exception):
    """A store entry holds a package built for something else (its metadata says what)."""


@dataclass
class _Package:
    """A loaded package, how to call it, and its store entry (None: built here, unsaved)."""

    runner: Callable[[list[torch.Tensor]], list[torch.Tensor]]  # the loader's boxed_run
    out_spec: Any
    path: Any = None

    def __call__(self, leaves: list[torch.Tensor]) -> Any:
        return pytree.tree_unflatten(self.runner(list(leaves)), self.out_spec)  # (boxed: it takes the list)


@dataclass
class _Call:
    """One call's inputs, flattened: its tensors (the package's inputs), the
    flat leaves and tree they came from, and its constants (every leaf that
    is not a tensor: part of the package's key, baked into its graph)."""

    flat: list[Any]
    spec: Any
    tensors: list[torch.Tensor]
    constants: tuple[Any, ...]

    @classmethod
    def of(cls, padded: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _Call:
        flat, spec = pytree.tree_flatten((padded, args, dict(kwargs)))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        constants = tuple(("tensor" if isinstance(x, torch.Tensor) else repr(x)) for x in flat)
        return cls(flat, spec, tensors, constants)

    def rebuilt(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """``(padded, args, kwargs)`` with ``tensors`` in place of the call's own."""
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in self.flat], self.spec)


def _form(one: _Call) -> tuple[Any, ...]:
    """What selects a package: every tensor's dtype, shape and device and the
    call's constants (a tuple: hashed per call, cheaply)."""
    return (*((t.dtype, t.shape, t.device) for t in one.tensors), one.constants)


def package_form(padded: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """What selects a package for this call (see :func:`_form`)."""
    return _form(_Call.of(padded, args, kwargs))


def _signature(form: tuple[Any, ...]) -> str:
    """The package's name in the store."""
    return hashlib.sha256(repr(form).encode()).hexdigest()[:24]


def _differentiable(data: Any) -> bool:
    """Whether the caller's own input asks for a graph back (a tensor that
    requires grad: the caller differentiates what the model returns),
    tensors held by a plain object's attributes included (fairchem's
    ``AtomicData`` is no pytree)."""
    for leaf in pytree.tree_leaves(data):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                return True
        elif hasattr(leaf, "__dict__") and any(isinstance(v, torch.Tensor) and v.requires_grad
                                               for v in vars(leaf).values()):
            return True
    return False


class _ModuleState:
    """Every submodule's attributes and its parameter, buffer and child slots
    (and the tensors' ``requires_grad``), put back by :meth:`restore`: a
    trace that fails half-way (or a model that caches what it traced) must
    leave the model as it was for the route that runs next."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
                      for m in model.modules()]
        self.grads = [(t, t.requires_grad) for t in [*model.parameters(), *model.buffers()]]

    def restore(self) -> None:
        for module, attrs, params, buffers, children in self.saved:
            for now, then in ((module.__dict__, attrs), (module._parameters, params), (module._buffers, buffers),
                              (module._modules, children)):
                if now.keys() != then.keys() or any(now[k] is not v for k, v in then.items()):
                    now.clear()
                    now.update(then)
        for tensor, flag in self.grads:
            if tensor.requires_grad != flag and tensor.is_leaf:
                tensor.requires_grad_(flag)


class AotRoute:
    """One wrapped model's packages: built or loaded per (caps, call form),
    checked once against the eager step, refused forms remembered.

    Parameters
    ----------
    model, call, dynamo_config
        The model and the adapter's step (as :func:`~ddpad._compile.run_step` takes them).
    stats
        Where packages built / loaded / checked / refused are counted.
    store, model_key
        The compile store and a function giving the model's key in it (the
        architecture and hyper-parameters as they now are; None: packages
        live in this process only).
    verify
        Check each package's first call against the eager step (``wrap``'s
        ``verify``).
    """

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
                 stats: Stats, store: CompileStore | None = None, model_key: Callable[[], str] | None = None,
                 verify: bool = True) -> None:
        self.model = model
        self.call = call
        self.dynamo_config = dict(dynamo_config)
        self.stats = stats
        self.store = store
        self.model_key = model_key
        self.verify = verify
        self.watch = Watch(model)
        self.key = self._key()
        self.packages: dict[tuple[Any, ...], _Package] = {}  # by _form
        self.refused: dict[tuple[Any, ...], str] = {}  # call form -> why
        self.weights_bound: set[tuple[Any, ...]] = set()  # ... refused for its package's numbers: these weights only
        self.waiting: set[tuple[Any, ...]] = set()  # forms whose package another process builds
        self.differentiated: set[tuple[Any, ...]] = set()  # forms a differentiating caller called (said once)
        # Inductor options of the builds (none: benchmarks/aot_options.py measured none that pays on a CPU;
        # not part of the store's key: set only where packages go to a store of their own)
        self.inductor_options: dict[str, Any] = {}

    def _key(self) -> str:
        """The model's key (its store key, or without a store its
        architecture's digest) and its weights' digest: the packages' folder."""
        architecture = self.model_key() if self.model_key is not None else _digest(model_fingerprint(self.model))[:32]
        return packages_key(architecture, self.model)

    def run(self, padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any], data: Any,
            fallback: Callable[[], Any], elsewhere: Callable[[str], str | None] | None = None,
            caps: Mapping[str, int] | None = None) -> Any:
        """The step at ``padded``'s caps (``caps``, for the messages) through
        its package; ``fallback()`` (the ``torch.compile`` path) where the
        route cannot take it, and while ``elsewhere`` (given a package's build
        name: None while it is built in another process, ``""`` once built,
        else why not) builds it."""
        changed = self.watch.changed()
        if changed is not None:
            self._rebind(changed)
        one = _Call.of(padded, args, kwargs)
        key = _form(one)
        if _differentiable(data):  # every call, built or not: a package returns plain tensors
            self._differentiated(one.constants)
            return fallback()
        package = self.packages.get(key)
        if package is not None:
            return package(one.tensors)
        form = one.constants
        if form in self.refused:
            return fallback()
        try:
            signature = _signature(key)
            path = self.store.entry(self.key, f"aot-{signature}") if self.store is not None else None
            if path is not None:
                earlier = self.store.refusal(path)  # type: ignore[union-attr]
                if earlier is not None:
                    raise Refused(f"a package of these caps was refused before ({earlier}); remove "
                                  f"{path.with_suffix('.refused.txt')} to build it again")
                if elsewhere is not None and (key in self.waiting or not path.exists()):
                    self.waiting.add(key)
                    why = elsewhere(f"{self.key}/aot-{signature}")
                    if why is None:  # still building: this process runs torch.compile meanwhile
                        return fallback()
                    self.waiting.discard(key)
                    if why:
                        raise Refused(why, said=True)
            package = self._obtain(one, signature, path)
        except Refused as exc:
            self._refuse(form, str(exc), said=exc.said)
            return fallback()
        before = fresh(padded) if self.verify else padded
        try:
            out = package(one.tensors)
        except Exception as exc:  # noqa: BLE001 - a package that fails must not stop the run
            self._discard(form, package, f"its package at caps {dict(caps) if caps else '?'} raised on its first "
                                         f"call ({type(exc).__name__}: {_first_line(exc)})")
            return fallback()
        if not self.verify:
            self.packages[key] = package
            return out
        ref, mismatch = check(self.stats, self.model, out, lambda: self._eager(before, args, kwargs))
        if mismatch is not None:
            self._discard(form, package, f"its package at caps {dict(caps) if caps else '?'} disagrees with the "
                                         f"eager step ({mismatch}; a compiler bug: report it to PyTorch)")
            return ref
        self.stats.aot_checked += 1
        self.packages[key] = package
        self.watch.mark()  # (what the check's eager step wrote into the model is not the user's change)
        return out

    def _rebind(self, why: str) -> None:
        """The model changed since the route was keyed: re-key it (the same
        key, values written back unchanged: nothing to do) and drop the
        packages of the model as it was."""
        self.watch.mark()
        key = self._key()
        if key == self.key:
            return
        self.key = key
        self.packages.clear()
        self.waiting.clear()
        for form in self.weights_bound:
            self.refused.pop(form, None)
        self.weights_bound.clear()
        log.warning("ddpad: the model changed since its ahead-of-time packages were built (%s): the packages of "
                    "the model as it now is are %s", why,
                    "loaded from the store or built" if self.store is not None else "built")

    def _differentiated(self, form: tuple[Any, ...]) -> None:
        """A caller who differentiates the outputs: this call runs the
        fallback (said and counted once per call form); the form's package
        still serves the calls that do not."""
        if form in self.differentiated:
            return
        self.differentiated.add(form)
        self.stats.aot_refused += 1
        log.warning("ddpad: compile_mode='aot' falls back to torch.compile for each call where the caller "
                    "differentiates the returned outputs (an input requires grad): a package returns plain tensors")

    def _refuse(self, form: tuple[Any, ...], reason: str, said: bool = False) -> None:
        self.refused[form] = reason
        self.stats.aot_refused += 1
        if not said:
            log.warning("ddpad: compile_mode='aot' falls back to torch.compile for this call form: %s", reason)

    def _discard(self, form: tuple[Any, ...], package: _Package, reason: str) -> None:
        """A package that cannot be used: its entry moved aside (no process
        uses, rebuilds or re-checks it), its form on ``torch.compile``."""
        if package.path is not None and self.store is not None:
            self.store.set_aside(package.path, "refused", reason, quiet=True)
            reason += f"; its store entry was moved aside to {package.path.with_suffix('.refused').name}"
        self.weights_bound.add(form)
        self._refuse(form, reason)

    def _eager(self, padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The eager step on the padded input (what every check compares with)."""
        return run_step(self.model, self.call, self.dynamo_config, padded, args, kwargs)

    # -- packages -------------------------------------------------------------

    def _obtain(self, one: _Call, signature: str, path: Any) -> _Package:
        """The package of this signature: from the store entry ``path``, or
        built (under the entry's lock: one process builds, the others wait
        and load); built here only, without a store."""
        store = self.store
        if store is None or path is None:
            return self._build(one, None, "")
        entry = f"{self.key}/aot-{signature}"
        package = self._load(path, entry)
        if package is not None:
            return package
        with store.lock(path) as build_here:
            if not build_here:
                package = self._load(path, entry)
                if package is not None:
                    return package
            return self._build(one, path, entry)

    def _load(self, path: Any, entry: str) -> _Package | None:
        """The package in the store entry ``path``, if it is there and was
        built for ``entry`` (a package of other caps, weights or model is moved
        aside unrun: run on another shape, a package reads out of bounds)."""
        assert self.store is not None
        t0 = time.perf_counter()
        payload = self.store.read(path)
        if payload is None:
            return None
        try:
            spec_size = int.from_bytes(payload[:8], "little")
            out_spec = pytree.treespec_loads(payload[8:8 + spec_size].decode())
            runner = _load_package(payload[8 + spec_size:], entry)
        except _Foreign as exc:
            self.store.set_aside(path, "foreign", str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - a bad entry must never stop a run
            self.store.set_aside(path, "corrupt", f"{type(exc).__name__}: {_first_line(exc)}")
            return None
        self.stats.aot_loaded += 1
        self.stats.aot_load_seconds += time.perf_counter() - t0
        return _Package(runner, out_spec, path)

    def _build(self, one: _Call, path: Any, entry: str) -> _Package:
        """Trace (fake), export, compile with AOTInductor; the package names
        ``entry`` in its metadata and is saved to ``path`` (when given) before
        it first runs. The model's state is put back whatever the trace did."""
        from torch.fx.experimental.proxy_tensor import make_fx

        t0 = time.perf_counter()
        out_box: list[Any] = []
        model, call, config = self.model, self.call, self.dynamo_config

        def step(*leaves: torch.Tensor) -> list[torch.Tensor]:
            padded, args, kwargs = one.rebuilt(leaves)
            out = run_step(model, call, config, padded, args, kwargs)
            flat_out, out_spec = pytree.tree_flatten(out)
            out_box[:] = [out_spec]
            return [x.detach() if isinstance(x, torch.Tensor) else x for x in flat_out]

        tensors = one.tensors
        phases = [t0]  # trace, export, AOTInductor: logged, for where a build's time goes
        state = _ModuleState(model)
        try:
            gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
        except Exception as exc:  # noqa: BLE001 - a data-dependent branch, an untraceable op
            raise Refused(f"tracing the step failed ({type(exc).__name__}: {_first_line(exc)})") from exc
        finally:
            state.restore()
        try:
            inputs = tuple(t.detach() for t in tensors)
            phases.append(time.perf_counter())
            with quiet_warnings():  # torch's own deprecations, raised as export copies tree specs
                exported = torch.export.export(gm, inputs, strict=False)
                phases.append(time.perf_counter())
                configs: dict[str, Any] = {**self.inductor_options,
                                           "aot_inductor.metadata": {_ENTRY: entry,
                                                                     "ddpad.form": repr(_form(one))[:4000]}}
                if _scalar_constants(gm):
                    # Inductor inlines a 0-dim tensor constant as a number, which some of its lowerings
                    # cannot take (embedding, view: fairchem's DatasetEmbedding indexes with torch.tensor(0))
                    configs["always_keep_tensor_constants"] = True
                with tempfile.TemporaryDirectory(prefix="ddpad-aot-") as tmp, _own_build_files(configs):
                    built = torch._inductor.aoti_compile_and_package(
                        exported, package_path=os.path.join(tmp, "step.pt2"), inductor_configs=configs)
                    blob = _read(built)
        except Exception as exc:  # noqa: BLE001 - an op the exporter or AOTInductor refuses
            raise Refused(f"exporting or compiling the step failed ({type(exc).__name__}: {_first_line(exc)})") from exc
        out_spec = out_box[0]
        spec_bytes = pytree.treespec_dumps(out_spec).encode()
        saved = path is not None and self.store is not None and self.store.write(
            path, len(spec_bytes).to_bytes(8, "little") + spec_bytes + blob)
        runner = _load_package(blob, entry)
        self.stats.aot_compiled += 1
        self.stats.aot_seconds += time.perf_counter() - t0
        phases.append(time.perf_counter())
        log.info("built an ahead-of-time package in %.1f s (trace %.1f s, export %.1f s, AOTInductor %.1f s; "
                 "%d bytes)", phases[-1] - t0, *(b - a for a, b in zip(phases, phases[1:])), len(blob))
        return _Package(runner, out_spec, path if saved else None)


@contextlib.contextmanager
def _own_build_files(configs: dict[str, Any]) -> Iterator[None]:
    """Name this build's generated files (C++, .so, metadata) for this build
    alone, and remove them once it is packaged. AOTInductor names them by the
    generated code, which two models of one architecture share: a build in
    another process at the same time (test workers, a second user) overwrote
    them between this build's compile and its packaging, and this package
    held the other's weights and metadata."""
    name = f"ddpad_{os.getpid()}_{uuid.uuid4().hex}"
    configs["aot_inductor.model_name_for_generated_files"] = name
    try:
        yield
    finally:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        # (in a directory of Inductor's cache named by the graph: files, a build directory, a lock)
        for path in glob.glob(os.path.join(cache_dir(), "*", name + "*")):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)


def _scalar_constants(gm: torch.fx.GraphModule) -> bool:
    """Whether the traced step holds a 0-dim tensor constant (one the traced
    code made with ``torch.tensor(number)``)."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value: Any = gm
            for name in str(node.target).split("."):
                value = getattr(value, name, None)
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                return True
    return False


def _load_package(blob: bytes, entry: str) -> Callable[..., Any]:
    """A package's runner, from its bytes, once its metadata says it was
    built for ``entry`` (``""``: not checked; else :class:`_Foreign`).
    torch's ``aoti_load_package``
    first probes the CPU's vector ISAs by compiling and running test programs
    (1.5 s with a warm Inductor cache, 5-7 s without: most of a warm start)
    only to warn on a mismatch; the store's key holds the CPU capability the
    package was built for instead, and the first call's check against the
    eager step catches any wrong number. The C++ loader reads a file, and
    its ``boxed_run`` takes the flat tensors (torch's Python wrapper would
    parse the call's tree spec again on every call, and importing it pulls in
    ``torch.export``'s serializer and Dynamo: seconds)."""
    loader_class = torch._C._aoti.AOTIModelPackageLoader
    with tempfile.NamedTemporaryFile(suffix=".pt2") as fh:
        fh.write(blob)
        fh.flush()
        if entry:
            built_for = loader_class.load_metadata_from_package(fh.name, "model").get(_ENTRY)
            if built_for != entry:
                raise _Foreign(f"it holds a package built for {built_for or 'something else (no ddpad metadata)'}, "
                               f"not {entry}")
        loader = loader_class(fh.name, "model", False, 1, -1)
    return loader.boxed_run


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
