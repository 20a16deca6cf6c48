"""The mattersim adapter's model tools: a random or saved ``Potential``
built from mattersim's own classes (:func:`random_model`,
:func:`load_model`), its EMA made picklable for background builds, and
the package's own calculators for ``ddpad bench --engines``.
:mod:`ddpad.adapters.mattersim` re-exports them."""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ase_calculator", "load_model", "m3gnet_of", "random_model", "torchsim_model"]


def m3gnet_of(model: torch.nn.Module) -> torch.nn.Module:
    """The M3GNet inside a mattersim ``Potential`` (or inside :class:`MatterSimForward`)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "model_args") or not hasattr(inner, "graph_conv"):
        raise TypeError(
            f"the mattersim adapter takes a mattersim Potential (M3GNet), got {type(model).__name__}"
        )
    return inner


@contextlib.contextmanager
def _mattersim_globals() -> Iterator[None]:
    """mattersim's ``Potential`` sets ``torch.backends.cuda.matmul.allow_tf32``
    globally when built: restored after."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def random_model(
    dtype: torch.dtype | None = None, device: str = "cpu", *, cutoff: float = 5.0, threebody_cutoff: float = 4.0,
    num_blocks: int = 2, units: int = 32, max_n: int = 4, max_l: int = 4, max_z: int = 94, seed: int = 0,
) -> torch.nn.Module:
    """A small randomly initialised mattersim ``Potential`` (M3GNet) from
    mattersim's own classes, in evaluation mode.

    mattersim's energy normaliser starts with per-species shift 0 and scale
    1: both are randomised (a dead atom joined to a real system would leak
    its shift), and so are the biases (``normal(0, 0.5)``) and the atom
    embedding (``normal(0, 1)`` instead of mattersim's ``uniform(-0.05,
    0.05)``, which leaves a random model's forces near 1e-3 eV/A). mattersim runs in float32 only (it casts to ``.float()``
    inside ``forward``).
    """
    if dtype not in (None, torch.float32):
        raise ValueError(f"mattersim is float32 only (its M3GNet casts to float32 inside forward); got {dtype}")
    from mattersim.forcefield.m3gnet.m3gnet import M3Gnet
    from mattersim.forcefield.potential import Potential

    torch.manual_seed(seed)
    with _mattersim_globals():
        m3gnet = M3Gnet(
            num_blocks=num_blocks, units=units, max_l=max_l, max_n=max_n, cutoff=cutoff, max_z=max_z,
            threebody_cutoff=threebody_cutoff, device=device,
        )
        with torch.no_grad():
            for p in m3gnet.parameters():
                if p.dim() == 1:  # biases
                    p.normal_(0.0, 0.5)
            # mattersim's +-0.05 embedding makes a random model's forces ~1e-3 eV/A
            m3gnet.atom_embedding.mlp[0].linear.weight.normal_(0.0, 1.0)
            m3gnet.normalizer.shift.normal_(0.0, 1.0)  # mattersim: 0 (a leak of a dead atom's shift would hide)
            m3gnet.normalizer.scale.uniform_(0.5, 2.0)  # mattersim: 1
        potential = Potential(m3gnet.to(device), device=device)
    return _inference(potential)


def _inference(potential: torch.nn.Module) -> torch.nn.Module:
    potential.eval()
    for p in potential.parameters():  # inference: no parameter gradients
        p.requires_grad_(False)
    ema = getattr(potential, "ema", None)
    if ema is not None and type(ema) is _ema_class().__base__:
        # a background build's worker gets the model pickled; torch_ema's EMA
        # holds weak references, which do not pickle (the same EMA, same state)
        ema.__class__ = _ema_class()
    return potential


@functools.cache
def _ema_class() -> type:
    """torch_ema's ``ExponentialMovingAverage`` that pickles (the class the
    potentials built here carry): its weak references to the parameters are
    pickled as the parameters (the model's own, pickled once with it)."""
    from torch_ema import ExponentialMovingAverage

    class PicklableEMA(ExponentialMovingAverage):
        def __reduce__(self) -> tuple[Any, ...]:
            state = dict(self.__dict__)
            state["_params_refs"] = [ref() for ref in state["_params_refs"]]
            return _rebuild_ema, (state,)

    return PicklableEMA


def _rebuild_ema(state: dict[str, Any]) -> Any:
    """Unpickles :func:`_ema_class`'s EMA (by this function's name: its class is made on first use)."""
    cls = _ema_class()
    ema = cls.__new__(cls)
    # a parameter already gone when pickled stays gone (a dead reference returns None)
    state["_params_refs"] = [weakref.ref(p) if p is not None else (lambda: None) for p in state["_params_refs"]]
    ema.__dict__.update(state)
    return ema


def load_model(path: str, device: str = "cpu") -> torch.nn.Module:
    """A local mattersim checkpoint (``Potential.save`` format: ``model_name``,
    ``model_args``, ``model`` state dict, as ``mattersim-v1.0.0-1M.pth``), or
    a whole M3GNet saved with ``torch.save(potential.model)`` (a
    ``Potential`` itself does not pickle: its EMA holds weak references).

    Built as mattersim's ``Potential.from_checkpoint`` builds it (``M3Gnet(**
    model_args)``, ``load_state_dict(strict=False)``), without its training
    state and without its side effects: nothing is downloaded (a pretrained
    model's name is not a file) and no folder is created.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file (mattersim models are not downloaded by ddpad)")
    from mattersim.forcefield.m3gnet.m3gnet import M3Gnet
    from mattersim.forcefield.potential import Potential

    obj = torch.load(path, map_location=device, weights_only=False)
    with _mattersim_globals():
        if isinstance(obj, torch.nn.Module) and hasattr(obj, "graph_conv"):  # a whole M3Gnet
            potential = Potential(obj.to(device), device=device)
        elif isinstance(obj, torch.nn.Module):
            potential = obj.to(device)
            if hasattr(potential, "device"):  # Potential.forward makes its strain on it
                potential.device = str(device)
        elif isinstance(obj, dict) and "model_args" in obj and "model" in obj:
            name = obj.get("model_name", "m3gnet")
            if name != "m3gnet":
                raise ValueError(f"{path}: a mattersim {name!r} checkpoint; only m3gnet is supported")
            m3gnet = M3Gnet(device=device, **obj["model_args"]).to(device)
            m3gnet.load_state_dict(obj["model"], strict=False)
            potential = Potential(m3gnet, device=device, model_name=name)
        else:
            raise TypeError(f"{path} holds a {type(obj).__name__}, not a mattersim checkpoint or Potential")
    m3gnet_of(potential)
    return _inference(potential)


def ase_calculator(model: torch.nn.Module) -> Any:
    """mattersim's own ``MatterSimCalculator`` around the potential ``model``, on its device."""
    from mattersim.forcefield import MatterSimCalculator

    return MatterSimCalculator(potential=model, device=str(next(model.parameters()).device))


def torchsim_model(model: torch.nn.Module) -> Any:
    """torch-sim's own ``MatterSimModel`` around ``model``. torch-sim 0.3.0's
    calls mattersim's ``batch_to_dict`` without a device, whose default is
    ``cuda``: on a CPU a ``RuntimeError`` says so instead of failing at its
    first step."""
    param = next(model.parameters())
    if param.device.type != "cuda":
        raise RuntimeError("torch-sim's MatterSimModel builds its batch on mattersim's default device (cuda) "
                           "whatever the model's: it runs on a GPU only")
    from torch_sim.models.mattersim import MatterSimModel

    return MatterSimModel(model, device=param.device, dtype=param.dtype)
