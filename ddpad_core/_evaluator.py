"""What engine integrations call: ``atoms -> flat properties`` through the
padded model, the unpadded compiled model or the plain eager model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._compile import compile_model, run_step
from ._options import WrapOptions
from ._padded import PaddedModel
from ._stats import Stats
from ._store import default_store_dir, storable
from ._structures import Structures
from ._registry import resolve_adapter
from ._wrap import wrap

if TYPE_CHECKING:
    from ._adapter import Adapter

__all__ = ["Evaluator", "UnpaddedCompiled"]


class UnpaddedCompiled:
    """The adapter's model compiled *without* padding: what ddpad is measured
    against (``ddpad bench``, ``ddpad.torchsim.Model(pad=False)``). Compile
    events land in ``stats``; every call advances ``stats.calls``."""

    def __init__(self, model: torch.nn.Module, adapter: Adapter | str, **compile_kwargs: Any) -> None:
        self.adapter = resolve_adapter(adapter)
        prepared = self.adapter.prepare_model(model) if self.adapter.prepare_model is not None else model
        self.stats = Stats()
        # outside a ddpad context a seam (compile_region) pads nothing
        self.compiled = compile_model(prepared, self.stats, self.adapter.compile_region, **compile_kwargs)

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(data, Mapping):  # the model may write into its input; inputs
            # that require grad stay connected (the caller differentiates them)
            data = {k: (_private_copy(v) if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
        try:
            return run_step(self.compiled, self.adapter.call, self.adapter.dynamo_config, data, args, kwargs)
        finally:
            self.stats.calls += 1


def _private_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.requires_grad else tensor.detach().clone()


def engine_wrap_options(wrap_kwargs: dict[str, Any], *, pad: bool, compile: bool) -> dict[str, Any]:
    """An engine's :func:`ddpad.wrap` options: a padded model compiled by
    Inductor keeps its graphs in ddpad's compile store
    (:func:`ddpad.default_store_dir`) unless given ``compile_cache`` (None:
    none), so it runs on tight caps and the next process finds its graphs;
    the engines (ASE, torch-sim, LAMMPS) share this default. Other backends
    store nothing, and get no store."""
    if pad and compile and storable(wrap_kwargs.get("backend", "inductor")):
        wrap_kwargs.setdefault("compile_cache", default_store_dir())
    return wrap_kwargs


def tensor_builder(adapter: Adapter, model: torch.nn.Module, tensor_input: bool | None = None) -> Any:
    """The adapter's ``Structures -> native input`` for ``model``, or None
    for its ASE pipeline. ``tensor_input``: ``None`` where the adapter has one
    and what it needs is installed (vesin-torch for a neighbour list),
    ``True`` always (an error naming what is missing), ``False`` never."""
    if tensor_input is False:
        return None
    if adapter.engine.tensor_input is None:
        if tensor_input:
            raise ValueError(f"ddpad: adapter {adapter.name!r} has no tensor_input; pass tensor_input=None "
                             "(its ASE pipeline)")
        return None
    try:
        return adapter.engine.tensor_input(model)
    except ImportError:
        if tensor_input:
            raise
        return None


def engine_input(adapter: Adapter, model: torch.nn.Module, atoms: Any) -> Any:
    """``atoms``' native input as the engines build it: through the adapter's
    ``tensor_input`` on the model's device where it has one, else its ASE
    pipeline. What ``ddpad precompile`` compiles for, so that its graphs and
    packages are the ones a run through the ASE calculator looks up."""
    build = tensor_builder(adapter, model)
    if build is None:
        return adapter.input_builder(model)(atoms)
    return build(Structures.from_atoms(atoms, device=next(model.parameters()).device,
                                       molecules=adapter.engine.molecules))


class Evaluator:
    """``atoms -> flat properties`` for engine integrations (ASE, torch-sim):
    builds the adapter's native input and runs the padded model (``pad=True``),
    the unpadded compiled model (``pad=False, compile=True``) or the plain
    eager model (``pad=False, compile=False``, the reference).

    The input is ``ase.Atoms`` (or a list of them), built by the adapter's
    ``build_input``, or a :class:`~ddpad.padding.Structures`, built on its device by
    the adapter's ``tensor_input`` (:attr:`takes_tensors`; ``tensor_input``
    says whether to build that, as in :func:`tensor_builder`)."""

    def __init__(self, model: torch.nn.Module, adapter: Adapter | str, *, pad: bool = True,
                 compile: bool = True, tensor_input: bool | None = None, **wrap_kwargs: Any) -> None:
        self.adapter = resolve_adapter(adapter)
        self.model = model
        self.build = self.adapter.input_builder(model)
        self.build_tensors = tensor_builder(self.adapter, model, tensor_input)
        self.wrapped: PaddedModel | None = wrap(model, self.adapter, compile=compile, **wrap_kwargs) if pad else None
        compile_kwargs = WrapOptions.split(wrap_kwargs)[1]
        self.unpadded = UnpaddedCompiled(model, self.adapter, **compile_kwargs) if compile and not pad else None

    @property
    def stats(self) -> Stats | None:
        """Compile and cap statistics (``None`` for the plain eager model)."""
        runner = self.wrapped if self.wrapped is not None else self.unpadded
        return None if runner is None else runner.stats

    @property
    def takes_tensors(self) -> bool:
        """Whether a :class:`~ddpad.padding.Structures` is built on its device
        (else the caller converts it to ``ase.Atoms``)."""
        return self.build_tensors is not None

    def __call__(self, atoms: Any, *, stress: bool = False, **kwargs: Any) -> dict[str, Any]:
        if isinstance(atoms, Structures):
            if self.build_tensors is None:
                raise TypeError(f"ddpad: adapter {self.adapter.name!r} has no tensor_input; pass ase.Atoms")
            data = self.build_tensors(atoms)
        else:
            data = self.build(atoms)
        options = {**self.adapter.call_options(stress), **kwargs}
        if self.wrapped is not None:
            out = self.wrapped(data, **options)
        elif self.unpadded is not None:
            out = self.unpadded(data, **options)
        else:
            out = self.adapter.reference(self.model, data, **options)
        return self.adapter.flat(out)
