"""Allegro (``nequip-allegro``): a nequip-framework model, padded and
compiled exactly as NequIP is (:mod:`ddpad.adapters.nequip`).

Allegro is strictly local: each atom's energy is a sum over its own edges
(no message passing), so a domain's owned atomic energies
(``atomic_energy``) need ghost atoms only one cutoff deep. That is what the
LAMMPS engine sums (``atom_energy_key``); ``do_derivatives=False`` returns
energies still attached to ``pos`` for the engine to differentiate.
Dead atoms, dead edges (self-loops through the dead system's cell, longer
than ``r_max``) and the one-graph arrangement are nequip's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ddpad.adapters import ToolHooks
from ddpad.adapters.nequip import (
    build_named,
    build_random,
    dtype_name,
    load_model,
    make_adapter,
    oam_config,
)

__all__ = ["ADAPTER", "foundation_model_config", "foundation_models", "random_model", "random_model_config"]


def random_model_config(
    dtype: torch.dtype = torch.float64,
    *,
    r_max: float = 4.0,
    atomic_numbers: Sequence[int] = (1, 6, 8),
    seed: int = 0,
) -> dict[str, Any]:
    """The config of a small Allegro model (2 layers, ``l_max = 1``, 16 scalar
    and 4 tensor features, Bessel two-body embedding) with non-zero per-type
    energy shifts and scales (so a dead atom joined to a real system would leak)."""
    from ase.data import chemical_symbols

    names = [chemical_symbols[int(z)] for z in atomic_numbers]  # type names = element symbols
    return {
        "_target_": "allegro.model.AllegroModel",
        "seed": seed, "model_dtype": dtype_name(dtype), "type_names": names, "r_max": r_max,
        "l_max": 1, "num_layers": 2, "num_scalar_features": 16, "num_tensor_features": 4,
        "radial_chemical_embed": {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed", "num_bessels": 8},
        "allegro_mlp_hidden_layers_depth": 1, "allegro_mlp_hidden_layers_width": 16,
        "readout_mlp_hidden_layers_depth": 1, "readout_mlp_hidden_layers_width": 8,
        "avg_num_neighbors": 20.0,
        "per_type_energy_shifts": {t: -1.0 - 0.8 * i for i, t in enumerate(names)},
        "per_type_energy_scales": {t: 1.5 + 0.25 * i for i, t in enumerate(names)},
    }


def random_model(dtype: torch.dtype = torch.float64, device: str = "cpu", **config: Any) -> torch.nn.Module:
    """A small randomly initialised Allegro model from allegro's own builder
    (:func:`random_model_config`; other keyword arguments replace its
    entries, e.g. ``num_layers=3``)."""
    return build_random(random_model_config, dtype, device, config)


# Allegro-OAM: the published training configs' model section (allegro ships no
# presets); keys are AllegroModel's arguments
ALLEGRO_OAM: dict[str, dict[str, Any]] = {
    "Allegro-OAM-L": {
        "r_max": 7.0, "l_max": 3, "parity": False, "num_layers": 4,
        "num_scalar_features": 256, "num_tensor_features": 64, "tp_path_channel_coupling": True,
        "allegro_mlp_hidden_layers_depth": 2, "allegro_mlp_hidden_layers_width": 1024,
        "readout_mlp_hidden_layers_depth": 1, "readout_mlp_hidden_layers_width": 128,
        "radial_chemical_embed": {"_target_": "allegro.nn.TwoBodyBesselScalarEmbed", "num_bessels": 12,
                                  "bessel_trainable": True, "polynomial_cutoff_p": 8},
        "radial_chemical_embed_dim": 512, "scalar_embed_mlp_hidden_layers_width": 512,
        "avg_num_neighbors": 9986.0,  # as published (the config's num_neighbours_mean_squared at 7 A)
    },
}


def foundation_model_config(name: str, seed: int = 0) -> dict[str, Any]:
    """The model config of an Allegro-OAM foundation model (``ALLEGRO_OAM``).

    Built by allegro's own ``AllegroModel`` with the ``model:`` section of
    the published training config (allegro-OAM-L-0.1, as submitted to
    Matbench Discovery; allegro ships no presets): ``r_max = 7`` A, 4
    layers, ``l_max = 3`` without parity, 256 scalar / 64 tensor features,
    Allegro MLPs 2 x 1024, readout 1 x 128, a two-body Bessel embedding (12
    trainable Bessels, ``p = 8``) of width 512, float32, the 89 OAM
    elements. Per-type energy shifts and scales are random and non-zero
    (:func:`ddpad.adapters.nequip.oam_per_type_energies`); weights are
    allegro's random initialisation from ``seed``.
    """
    return oam_config("allegro.model.AllegroModel", ALLEGRO_OAM, name, seed)


def foundation_models() -> dict[str, Callable[[], torch.nn.Module]]:
    """The nequip.net Allegro foundation architecture users run, with random
    weights (nothing is downloaded): Allegro-OAM-L (:func:`foundation_model_config`)."""
    return {name: functools.partial(build_named, foundation_model_config, name) for name in ALLEGRO_OAM}


ADAPTER = make_adapter(
    "allegro",
    requires=("allegro", "nequip"),  # import names, the model package's first
    tools=ToolHooks(random_model=random_model, load_model=load_model, foundation_models=foundation_models),
    message_layers=lambda model: 1,  # strictly local: its layers act on an atom's own edges
)
