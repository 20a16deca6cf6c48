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
from ._weights import Watch, packages_key

__all__ = ["Call", "Packages", "Refused", "differentiable", "first_line", "form_of", "package_form"]

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
class Call:
    """One call's inputs, flattened: its tensors (the package's inputs), the
    flat leaves and tree they came from, and its constants (every leaf that
    is not a tensor: part of the package's key, baked into its graph)."""

    flat: list[Any]
    spec: Any
    tensors: list[torch.Tensor]
    constants: tuple[Any, ...]

    @classmethod
    def of(cls, padded: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Call:
        flat, spec = pytree.tree_flatten((padded, args, dict(kwargs)))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        constants = tuple(("tensor" if isinstance(x, torch.Tensor) else repr(x)) for x in flat)
        return cls(flat, spec, tensors, constants)

    def rebuilt(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """``(padded, args, kwargs)`` with ``tensors`` in place of the call's own."""
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in self.flat], self.spec)


def form_of(one: Call) -> tuple[Any, ...]:
    """What selects a package: every tensor's dtype, shape and device and the
    call's constants (a tuple: hashed per call, cheaply)."""
    return (*((t.dtype, t.shape, t.device) for t in one.tensors), one.constants)


def package_form(padded: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """What selects a package for this call (see :func:`_form`)."""
    return form_of(Call.of(padded, args, kwargs))


def _signature(form: tuple[Any, ...]) -> str:
    """The package's name in the store."""
    return hashlib.sha256(repr(form).encode()).hexdigest()[:24]


def differentiable(data: Any) -> bool:
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


class Packages:
    """One wrapped model's packages (one per caps and call form): keyed,
    loaded from the store or built, run, set aside. What became of each key
    (ready, building, checked, refused) is the compile manager's record; the
    package route (:class:`~ddpad._routes.PackageRoute`) asks this for the
    packages themselves.

    Parameters
    ----------
    model, call, dynamo_config
        The model and the adapter's step (as :func:`~ddpad._compile.run_step` takes them).
    stats
        Where packages built / loaded / checked are counted.
    store, model_key
        The compile store and a function giving the model's key in it (the
        architecture and hyper-parameters as they now are; None: packages
        live in this process only).
    """

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
                 stats: Stats, store: CompileStore | None = None, model_key: Callable[[], str] | None = None) -> None:
        self.model = model
        self.call = call
        self.dynamo_config = dict(dynamo_config)
        self.stats = stats
        self.store = store
        self.model_key = model_key
        self.watch = Watch(model)
        self.key = self._key()
        self.loaded: dict[tuple[Any, ...], _Package] = {}  # by the package route's key (self.key, form, ...)
        # Inductor options of the builds (none: benchmarks/aot_options.py measured none that pays on a CPU;
        # not part of the store's key: set only where packages go to a store of their own)
        self.inductor_options: dict[str, Any] = {}

    def _key(self) -> str:
        """The model's key (its store key, or without a store its
        architecture's digest) and its weights' digest: the packages' folder."""
        architecture = self.model_key() if self.model_key is not None else _digest(model_fingerprint(self.model))[:32]
        return packages_key(architecture, self.model)

    def rebind(self) -> str | None:
        """Re-key the packages if the model changed since they were keyed (its
        weights or hyper-parameters: a package holds them); the old key when
        the key changed (its packages are dropped), else None."""
        changed = self.watch.changed()
        if changed is None:
            return None
        self.watch.mark()
        key, old = self._key(), self.key
        if key == old:  # (values written back unchanged)
            return None
        self.key = key
        self.loaded.clear()
        log.warning("ddpad: the model changed since its ahead-of-time packages were built (%s): the packages of "
                    "the model as it now is are %s", changed,
                    "loaded from the store or built" if self.store is not None else "built")
        return old

    def obtain(self, key: tuple[Any, ...], one: Call, elsewhere: Callable[[str], str | None] | None = None,
               building: bool = False) -> bool:
        """Load or build the package of ``key`` (``(self.key, form, ...)``); False
        while ``elsewhere`` (given its build name: None while another process
        builds it, ``""`` once built, else why not) builds it (``building``:
        it was building on an earlier call). :class:`Refused` where it cannot."""
        signature = _signature(key[1])
        path = self.store.entry(self.key, f"aot-{signature}") if self.store is not None else None
        if path is not None:
            earlier = self.store.refusal(path)  # type: ignore[union-attr]
            if earlier is not None:
                why, marker = earlier
                raise Refused(f"a package of these caps was refused before ({why}); remove {marker} to try it "
                              "again")
            if elsewhere is not None and (building or not path.exists()):
                why = elsewhere(f"{self.key}/aot-{signature}")
                if why is None:  # still building: this process runs torch.compile meanwhile
                    return False
                if why:
                    raise Refused(why, said=True)
        self.loaded[key] = self._obtain(one, signature, path)
        return True

    def run(self, key: tuple[Any, ...], one: Call) -> Any:
        """The loaded package of ``key`` on the call's tensors."""
        return self.loaded[key](one.tensors)

    def checked(self) -> None:
        """A package's first call agreed with the eager step."""
        self.stats.aot_checked += 1
        self.watch.mark()  # (what the check's eager step wrote into the model is not the user's change)

    def discard(self, key: tuple[Any, ...], reason: str) -> str:
        """A package that cannot be used here (it raised, or disagreed at this
        thread count): refused on this host and setting, its entry kept for
        the others (its bytes are right: they passed the checksum); ``reason``
        with where that is recorded."""
        package = self.loaded.pop(key, None)
        if package is not None and package.path is not None and self.store is not None:
            marker = self.store.refuse_here(package.path, reason)
            reason += f"; refused on this host and setting only ({marker.name}), the entry stays for others"
        return reason

    # -- packages -------------------------------------------------------------

    def _obtain(self, one: Call, signature: str, path: Any) -> _Package:
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
        except Exception as exc:  # noqa: BLE001 - bytes that are not a package: wrong for everyone
            self.store.set_aside(path, "corrupt", f"{type(exc).__name__}: {first_line(exc)}")
            return None
        try:
            runner = _load_package(payload[8 + spec_size:], entry)
        except _Foreign as exc:
            self.store.set_aside(path, "foreign", str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - a load that fails here (dlopen, a library) stays local
            why = f"its package failed to load here ({type(exc).__name__}: {first_line(exc)})"
            marker = self.store.refuse_here(path, why)
            raise Refused(f"{why}; refused on this host and setting only ({marker.name}), the entry stays for "
                          "others") from None
        self.stats.aot_loaded += 1
        self.stats.aot_load_seconds += time.perf_counter() - t0
        return _Package(runner, out_spec, path)

    def _build(self, one: Call, path: Any, entry: str) -> _Package:
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
            raise Refused(f"tracing the step failed ({type(exc).__name__}: {first_line(exc)})") from exc
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
                                                                     "ddpad.form": repr(form_of(one))[:4000]}}
                if _scalar_constants(gm):
                    # Inductor inlines a 0-dim tensor constant as a number, which some of its lowerings
                    # cannot take (embedding, view: fairchem's DatasetEmbedding indexes with torch.tensor(0))
                    configs["always_keep_tensor_constants"] = True
                with tempfile.TemporaryDirectory(prefix="ddpad-aot-") as tmp, _own_build_files(configs):
                    built = torch._inductor.aoti_compile_and_package(
                        exported, package_path=os.path.join(tmp, "step.pt2"), inductor_configs=configs)
                    blob = _read(built)
        except Exception as exc:  # noqa: BLE001 - an op the exporter or AOTInductor refuses
            raise Refused(f"exporting or compiling the step failed ({type(exc).__name__}: {first_line(exc)})") from exc
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
