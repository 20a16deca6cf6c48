"""The per-model declaration: how ddpad pads, calls and unpads one model family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ddpad import GraphPadder

if TYPE_CHECKING:
    from ddpad import PaddedModel

__all__ = ["Adapter"]


@dataclass(frozen=True)
class Adapter:
    """One model family's declaration (SPEC section 8).

    Attributes
    ----------
    name
        Registry name, e.g. ``"mace"``.
    make_padder
        ``model -> GraphPadder`` configured for the model's native input and cutoff.
    energy_key
        Output key of the per-system energy.
    atom_outputs
        Per-atom output keys (dead rows stripped by ``unpad``).
    system_outputs
        Per-system output keys (the dead system stripped by ``unpad``).
    cutoff
        ``model -> float``: the model's interaction cutoff.
    build_input
        ``(model, atoms, **options) -> native input`` from ``ase.Atoms`` (or a
        list of them).
    install_hint
        The pip command that installs the model package.
    requires
        Import names of the packages the adapter needs.
    pad_in_forward
        The model builds its graph in ``forward`` and pads at its own seam
        through ``current_dd_context().maybe_pad_graph`` (UMA style).
    prepare_model
        Optional ``model -> model`` run once by ``wrap`` before compiling
        (e.g. to install the padding seam on that instance).
    call
        Optional ``(compiled_model, padded_input, *args, **kwargs) -> output``:
        how one step runs, for models whose derivatives are taken outside
        ``forward`` (AIMNet2: forces by autograd around the compiled energy).
        Default: ``compiled_model(padded_input, *args, **kwargs)``.
    dynamo_config
        ``torch._dynamo.config`` values set around each compiled call only
        (scoped with ``config.patch``, restored after), e.g. MACE's
        ``{"trace_autograd_ops": True}`` to keep its forces in the graph.
    """

    name: str
    make_padder: Callable[[torch.nn.Module], GraphPadder]
    energy_key: str
    atom_outputs: tuple[str, ...]
    cutoff: Callable[[torch.nn.Module], float]
    build_input: Callable[..., Any]
    install_hint: str
    system_outputs: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    pad_in_forward: bool = False
    prepare_model: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    call: Callable[..., Any] | None = None
    dynamo_config: Mapping[str, Any] = field(default_factory=dict)

    def wrap(self, model: torch.nn.Module, *, compile: bool = True, **kwargs: Any) -> PaddedModel:
        """``ddpad.wrap(model, self, ...)``: the fixed-shape (compiled) model."""
        from ddpad import wrap

        return wrap(model, self, compile=compile, **kwargs)
