"""What the user holds is what runs: an adapter's prepared copy shares the
user's weights and follows every other change to the user's model."""

from __future__ import annotations

import copy
import pathlib
import warnings

import pytest
import torch

import ddpad
from _mpnn import CUTOFF, MPNN, trajectory
from ddpad.padding import COOPadder, Fill
from ddpad.adapters import Adapter, EngineHooks
from ddpad._weights import Follow, share_weights


def _padder(model: torch.nn.Module) -> COOPadder:
    return COOPadder(model.cutoff, atom_fields={"node_attrs": 0.0}, edge_fields={"unit_shifts": Fill.DEAD_UNIT_SHIFT},
                     system_fields={"cell": Fill.DEAD_CELL}, atom_outputs=("forces", "node_energy"),
                     system_outputs=("energy", "stress"))


def _adapter(prepare: object) -> Adapter:
    return Adapter(
        name="mpnn", make_padder=_padder, energy_key="energy",
        atom_outputs=("forces", "node_energy"), system_outputs=("energy", "stress"), cutoff=lambda m: CUTOFF,
        engine=EngineHooks(build_input=lambda m, a: a), install_hint="(tests)", prepare_model=prepare,
    )


def _shift_as_number(model: torch.nn.Module) -> torch.nn.Module:
    """A copy holding the ``shift`` parameter as the Python number it is (as
    the orb adapter's copy holds one): no tensor of the copy shares it."""
    prepared = copy.deepcopy(model)
    value = float(prepared.shift.detach())
    del prepared._parameters["shift"]
    prepared.shift = value
    return prepared


def _energy(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["energy"].detach()


def _eager(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    return _energy(model({k: v.clone() for k, v in data.items()}))


def test_prepared_copy_shares_the_users_tensors() -> None:
    """No second copy of the weights: every tensor of the deep copy is the
    user's own object after sharing."""
    model = MPNN()
    prepared = copy.deepcopy(model)
    shared = share_weights(prepared, model)
    assert shared == {id(p) for p in model.parameters()}
    assert all(a is b for a, b in zip(prepared.parameters(), model.parameters()))


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_changes_to_the_users_model_are_followed(backend: str | None) -> None:
    """In place (no re-prepare, no notice), by ``load_state_dict``, by
    ``load_state_dict(assign=True)`` and a hyper-parameter set on the user's
    object (both prepare the copy again, one warning each): every next call
    equals the user's model. Before, the copy ran its own weights."""
    model = MPNN()
    options = {"compile": False} if backend is None else {"backend": backend}
    wrapped = ddpad.wrap(model, _adapter(copy.deepcopy), **options)
    data = trajectory(1, 2, seed=5)[0]
    torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-12, rtol=0)
    first = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in place: followed through the shared tensors, no notice
        with torch.no_grad():
            model.readout.weight.mul_(1.5)
        torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-12, rtol=0)
        model.load_state_dict(first)
        torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-12, rtol=0)
    model.load_state_dict({k: v * 1.25 for k, v in first.items()}, assign=True)
    with pytest.warns(RuntimeWarning, match=r"replaced.*prepared the copy again"):
        torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-12, rtol=0)
    model.cutoff = CUTOFF * 0.9
    with pytest.warns(RuntimeWarning, match=r"hyper-parameter was set \(MPNN.cutoff"):
        torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-12, rtol=0)


def test_a_weight_the_copy_does_not_share_prepares_it_again() -> None:
    """A weight the copy holds in another form (not shared) written in place
    by the user: the copy is prepared again, with one warning."""
    model = MPNN()
    wrapped = ddpad.wrap(model, _adapter(_shift_as_number), compile=False)
    data = trajectory(1, 1, seed=6)[0]
    torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-12, rtol=0)
    with torch.no_grad():
        model.shift.add_(0.5)
    with pytest.warns(RuntimeWarning, match=r"written in place.*prepared the copy again"):
        torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-12, rtol=0)
    assert wrapped.model.shift == float(model.shift)


def test_torchscript_submodules_are_watched() -> None:
    """A user's model holding TorchScript modules (e3nn's generated code in
    MACE) is watched: their dicts are wrappers without ``get`` that iterate
    by index."""

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.script = torch.jit.script(torch.nn.Linear(3, 3))

    model = Holder()
    follow = Follow(model, copy.deepcopy(model))
    assert follow.stale() is None
    with torch.no_grad():
        model.script.weight.mul_(2.0)
    assert follow.stale() is None  # shared: followed


def test_sharing_keeps_tied_tensors_tied() -> None:
    """A buffer two submodules hold (fairchem's SO3 grids) stays one tensor
    in the copy: the store key counts tensors (before: untied by sharing, so
    a background worker's model had another key than the run's)."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Module(), torch.nn.Module()
            grid = torch.arange(6.0)
            self.a.register_buffer("grid", grid)
            self.b.register_buffer("grid", grid)
            self.a.scale = torch.nn.Parameter(torch.ones(3), requires_grad=True)
            self.b.scale = self.a.scale

    model = Tied()
    prepared = copy.deepcopy(model).requires_grad_(False)  # (another requires_grad: a view per tensor)
    share_weights(prepared, model)
    assert prepared.a.grid is prepared.b.grid and prepared.a.scale is prepared.b.scale
    assert len(list(prepared.buffers())) == len(list(model.buffers())) == 1
    assert prepared.a.grid.data_ptr() == model.a.grid.data_ptr() and not prepared.a.scale.requires_grad


def test_an_attribute_the_model_sets_itself_to_what_the_copy_holds_is_followed() -> None:
    """fairchem's model sets ``self.device`` on its first call; the copy
    already holds that value: no re-prepare (before: every user's own call
    of the model prepared the copy again, and a deepcopy of a model that
    had run failed on its non-leaf tensors)."""
    model = MPNN()
    model.device = None
    prepared = copy.deepcopy(model)
    prepared.device = "cpu"
    follow = Follow(model, prepared)
    model.device = "cpu"  # as the model's own first call does
    assert follow.stale() is None
    model.device = "cuda"  # a value the copy does not hold
    assert follow.stale() is not None


def test_a_package_follows_the_users_weights(tmp_path: pathlib.Path) -> None:
    """The package route: a package holds the weights it was built with; a
    write to the user's weights in place reaches the copy's shared tensors,
    so the route notices it and runs the package of the model as it now
    is."""
    model = MPNN()
    wrapped = ddpad.wrap(model, _adapter(copy.deepcopy), compile_mode="aot", compile_cache=tmp_path,
                         aot_build="foreground", cap_policy="headroom")
    data = trajectory(1, 1, seed=7)[0]
    torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-10, rtol=0)
    with torch.no_grad():
        model.readout.weight.mul_(1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(_energy(wrapped(data)), _eager(model, data), atol=1e-10, rtol=0)
    assert wrapped.stats.aot_compiled + wrapped.stats.aot_loaded == 2
