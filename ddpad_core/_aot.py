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

Never a wrong number: the first call at given caps in a process also runs
the eager step on the same padded input and compares; a mismatch is logged
and that form falls back to ``torch.compile``. A step the route cannot take
(a data-dependent branch, an op the exporter refuses, a caller who
differentiates the returned energy himself) falls back with one line naming
the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ._compile import run_step
from ._stats import Stats
from ._store import CompileStore

__all__ = ["AotRoute", "Refused", "weights_digest"]

log = logging.getLogger("ddpad")

# relative tolerance of the first call's check against the eager step, by the least precise
# dtype at work: AOTInductor may fuse and reorder floating-point work the eager step does in order
_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


class Refused(Exception):
    """The ahead-of-time route cannot take this step; the message says why."""


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of ``model``'s parameters and buffers (a package holds them:
    two models of one architecture with other weights must not share one)."""
    h = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        data = tensor.detach().cpu().contiguous().reshape(-1)  # (a 0-d tensor has no byte view)
        h.update(str(data.dtype).encode() + str(tuple(tensor.shape)).encode())
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()[:32]


@dataclass
class _Package:
    """A loaded package and how to call it."""

    runner: Callable[[list[torch.Tensor]], list[torch.Tensor]]  # the loader's boxed_run
    out_spec: Any

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


def _signature(form: tuple[Any, ...]) -> str:
    """The package's name in the store."""
    return hashlib.sha256(repr(form).encode()).hexdigest()[:24]


def _differentiable(data: Any) -> bool:
    """Whether the caller's own input asks for a graph back (a tensor that
    requires grad: the caller differentiates what the model returns)."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves(data))


def _close(out: Any, ref: Any, model: torch.nn.Module | None = None) -> str | None:
    """None when every output matches the eager step's within the tolerance
    of the least precise floating dtype among the outputs and ``model``'s
    parameters (a float32 model's float64 outputs carry float32 work), else
    what differed."""
    got, want = pytree.tree_flatten(out)[0], pytree.tree_flatten(ref)[0]
    if len(got) != len(want):
        return f"{len(got)} outputs, the eager step {len(want)}"
    dtypes = {x.dtype for x in want if isinstance(x, torch.Tensor) and x.is_floating_point()}
    dtypes |= {p.dtype for p in (model.parameters() if model is not None else ()) if p.is_floating_point()}
    rtol = max((_RTOL.get(dtype, 1e-4) for dtype in dtypes), default=1e-4)
    for i, (a, b) in enumerate(zip(got, want)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i}: {a!r} != {b!r}"
            continue
        a, b = a.detach(), b.detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {tuple(a.shape)} {a.dtype}, the eager step {tuple(b.shape)} {b.dtype}"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i} differs"
            continue
        scale = float(b.abs().max()) if b.numel() else 0.0
        tol = rtol * max(scale, 1.0)
        worst = float((a - b).abs().max()) if b.numel() else 0.0
        if not worst <= tol:  # (NaN fails too)
            return f"output {i}: max deviation {worst:.3g} > {tol:.3g}"
    return None


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
        The compile store and the model's key in it (None: packages live in
        this process only).
    """

    def __init__(self, model: torch.nn.Module, call: Callable[..., Any] | None, dynamo_config: Mapping[str, Any],
                 stats: Stats, store: CompileStore | None = None, model_key: str | None = None) -> None:
        self.model = model
        self.call = call
        self.dynamo_config = dict(dynamo_config)
        self.stats = stats
        self.store = store
        self.key = f"{model_key}-{weights_digest(model)}" if store is not None else None
        self.packages: dict[tuple[Any, ...], _Package] = {}  # by _form
        self.refused: dict[tuple[Any, ...], str] = {}  # call form -> why
        self.waiting: set[tuple[Any, ...]] = set()  # forms whose package another process builds
        self.fallback_checked: set[tuple[Any, ...]] = set()  # torch.compile steps that matched the eager step
        self.eager: set[tuple[Any, ...]] = set()  # ... and that did not: they run eager

    def run(self, padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any], data: Any,
            fallback: Callable[[], Any], elsewhere: Callable[[str], str | None] | None = None) -> Any:
        """The step at ``padded``'s caps through its package; ``fallback()``
        (the ``torch.compile`` path) where the route cannot take it, and
        while ``elsewhere`` (given a package's signature: None while it is
        built in another process, ``""`` once built, else why not) builds it."""
        one = _Call.of(padded, args, kwargs)
        key = _form(one)
        package = self.packages.get(key)
        if package is not None:
            return package(one.tensors)
        form = one.constants
        if form in self.refused:
            return self._fallback(key, padded, args, kwargs, fallback)
        try:
            if _differentiable(data):
                raise Refused("the caller differentiates the returned outputs (an input requires grad); "
                              "a package returns plain tensors")
            signature = _signature(key)
            if elsewhere is not None and self.store is not None:
                if key in self.waiting or self._stored(signature) is None:
                    self.waiting.add(key)
                    why = elsewhere(signature)
                    if why is None:  # still building: this process runs torch.compile meanwhile
                        return self._fallback(key, padded, args, kwargs, fallback)
                    self.waiting.discard(key)
                    if why:
                        raise Refused(why)
            package = self._obtain(one, signature)
        except Refused as exc:
            self._refuse(form, str(exc))
            return self._fallback(key, padded, args, kwargs, fallback)
        out = package(one.tensors)
        ref = self._eager(padded, args, kwargs)
        mismatch = _close(out, ref, self.model)
        if mismatch is not None:
            self._refuse(form, f"its package disagrees with the eager step ({mismatch})")
            return ref
        self.stats.aot_checked += 1
        self.packages[key] = package
        return out

    def _refuse(self, form: tuple[Any, ...], reason: str) -> None:
        self.refused[form] = reason
        self.stats.aot_refused += 1
        log.warning("ddpad: compile_mode='aot' falls back to torch.compile for this call form: %s", reason)

    def _fallback(self, key: tuple[Any, ...], padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  fallback: Callable[[], Any]) -> Any:
        """The ``torch.compile`` step, its first call at each caps checked
        against the eager step as a package's is; where it disagrees too,
        those caps and form run eager (said once)."""
        if key in self.fallback_checked:
            return fallback()
        if key in self.eager:
            return self._eager(padded, args, kwargs)
        out = fallback()
        ref = self._eager(padded, args, kwargs)
        mismatch = _close(out, ref, self.model)
        if mismatch is None:
            self.fallback_checked.add(key)
            return out
        self.eager.add(key)
        self.stats.aot_eager += 1
        log.warning("ddpad: torch.compile disagrees with the eager step too (%s): these caps and call form run "
                    "eager; report it to PyTorch with the model", mismatch)
        return ref

    def _eager(self, padded: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The eager step on the padded input (what every check compares with)."""
        return run_step(self.model, self.call, self.dynamo_config, padded, args, kwargs)

    # -- packages -------------------------------------------------------------

    def _obtain(self, one: _Call, signature: str) -> _Package:
        """The package of this signature: from the store, or built (under the
        entry's lock: one process builds, the others wait and load)."""
        store, path = self.store, None
        if store is not None and self.key is not None:
            path = store.entry(self.key, f"aot-{signature}")
            package = self._load(path)
            if package is not None:
                return package
            with store.lock(path) as build_here:
                if not build_here:
                    package = self._load(path)
                    if package is not None:
                        return package
                return self._build(one, path)
        return self._build(one, None)

    def _stored(self, signature: str) -> Any:
        """The store's entry path of ``signature`` if it exists, else None."""
        assert self.store is not None and self.key is not None
        path = self.store.entry(self.key, f"aot-{signature}")
        return path if path.exists() else None

    def _load(self, path: Any) -> _Package | None:
        assert self.store is not None
        t0 = time.perf_counter()
        payload = self.store.read(path)
        if payload is None:
            return None
        try:
            spec_size = int.from_bytes(payload[:8], "little")
            out_spec = pytree.treespec_loads(payload[8:8 + spec_size].decode())
            runner = _load_package(payload[8 + spec_size:])
        except Exception as exc:  # noqa: BLE001 - a bad entry must never stop a run
            log.warning("compile-store package %s is unusable (%s: %s); moved aside, building", path,
                        type(exc).__name__, exc)
            with contextlib.suppress(OSError):
                os.replace(path, path.with_suffix(".corrupt"))
            return None
        self.stats.aot_loaded += 1
        self.stats.aot_load_seconds += time.perf_counter() - t0
        return _Package(runner, out_spec)

    def _build(self, one: _Call, path: Any) -> _Package:
        """Trace (fake), export, compile with AOTInductor; the package is
        saved to ``path`` (when given) before it first runs."""
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
        try:
            gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
        except Exception as exc:  # noqa: BLE001 - a data-dependent branch, an untraceable op
            raise Refused(f"tracing the step failed ({type(exc).__name__}: {_first_line(exc)})") from exc
        try:
            inputs = tuple(t.detach() for t in tensors)
            phases.append(time.perf_counter())
            exported = torch.export.export(gm, inputs, strict=False)
            phases.append(time.perf_counter())
            with tempfile.TemporaryDirectory(prefix="ddpad-aot-") as tmp:
                built = torch._inductor.aoti_compile_and_package(
                    exported, package_path=os.path.join(tmp, "step.pt2"))
                blob = _read(built)
        except Exception as exc:  # noqa: BLE001 - an op the exporter or AOTInductor refuses
            raise Refused(f"exporting or compiling the step failed ({type(exc).__name__}: {_first_line(exc)})") from exc
        out_spec = out_box[0]
        spec_bytes = pytree.treespec_dumps(out_spec).encode()
        if path is not None and self.store is not None:
            self.store.write(path, len(spec_bytes).to_bytes(8, "little") + spec_bytes + blob)
        runner = _load_package(blob)
        self.stats.aot_compiled += 1
        self.stats.aot_seconds += time.perf_counter() - t0
        phases.append(time.perf_counter())
        log.info("built an ahead-of-time package in %.1f s (trace %.1f s, export %.1f s, AOTInductor %.1f s; "
                 "%d bytes)", phases[-1] - t0, *(b - a for a, b in zip(phases, phases[1:])), len(blob))
        return _Package(runner, out_spec)


def _load_package(blob: bytes) -> Callable[..., Any]:
    """A package's runner, from its bytes. torch's ``aoti_load_package``
    first probes the CPU's vector ISAs by compiling and running test programs
    (1.5 s with a warm Inductor cache, 5-7 s without: most of a warm start)
    only to warn on a mismatch; the store's key holds the CPU capability the
    package was built for instead, and the first call's check against the
    eager step catches any wrong number. The C++ loader reads a file, and
    its ``boxed_run`` takes the flat tensors (torch's Python wrapper would
    parse the call's tree spec again on every call, and importing it pulls in
    ``torch.export``'s serializer and Dynamo: seconds)."""
    with tempfile.NamedTemporaryFile(suffix=".pt2") as fh:
        fh.write(blob)
        fh.flush()
        loader = torch._C._aoti.AOTIModelPackageLoader(fh.name, "model", False, 1, -1)
    return loader.boxed_run


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
