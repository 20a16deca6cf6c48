"""What an ahead-of-time package was built from: the model's weights and
hyper-parameters, digested for the store's key and watched between calls;
and the user's model behind an adapter's prepared copy, whose weights the
copy shares (:func:`share_weights`) and whose other changes are followed
(:class:`Follow`).

A package holds the weights it was traced with and the hyper-parameters its
graph baked in. :class:`Watch` notices, before a call, that either changed
since the package was built: a tensor written in place (its version
counter), a parameter or buffer swapped or re-pointed (``load_state_dict``,
``assign=True``, ``.to()``, ``.data =``), a submodule replaced, or a plain
attribute rebound (``model.cutoff = 2.5``). Identity and counter reads only:
tens of microseconds for a model of hundreds of tensors.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any

import torch
from torch import Tensor

__all__ = ["Follow", "Watch", "packages_key", "plain", "share_weights", "weights_digest"]

_PLAIN = (bool, int, float, str, type(None))


def plain(value: Any) -> bool:
    """Whether ``value`` is a hyper-parameter as the store's fingerprint reads
    them: a scalar, a string, or a short tuple / list of them."""
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list)) and len(value) <= 64 and all(isinstance(v, _PLAIN) for v in value)


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


def packages_key(architecture: str, model: torch.nn.Module) -> str:
    """Where ``model``'s packages live in a store: its architecture's key and
    its weights' digest (the run and its build workers must agree on it)."""
    return f"{architecture}-{weights_digest(model)}"


class Watch:
    """Whether ``model``'s weights or hyper-parameters changed since :meth:`mark`.

    Parameters
    ----------
    model
        The model a package was built from.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.mark()

    def mark(self) -> None:
        """Take the model as it now is as the reference: every submodule's
        attribute, parameter, buffer and child dicts (their sizes), the
        objects in their slots and its plain attributes (their identities),
        and every tensor's version counter and data pointer. Flat lists, so
        that :meth:`changed` compares them in a few C-level passes."""
        modules = list(self.model.modules())
        self._dicts: list[dict[str, Any]] = []
        self._slots: list[tuple[dict[str, Any], str]] = []
        self._owners: list[torch.nn.Module] = []  # the module of each slot, for the message
        for module in modules:
            state = module.__dict__
            self._dicts += [state, module._parameters, module._buffers, module._modules]
            slots = [(state, name) for name, value in state.items() if not name.startswith("_") and plain(value)]
            # (keys(): a TorchScript module's dicts are wrappers that iterate by index)
            slots += [(held, name) for held in (module._parameters, module._buffers, module._modules)
                      for name in held.keys()]
            self._slots += slots
            self._owners += [module] * len(slots)
        self._sizes = [len(d) for d in self._dicts]
        self._values = [_get(held, name) for held, name in self._slots]
        self._tensors = [t for m in modules for t in [*m._parameters.values(), *m._buffers.values()] if t is not None]
        self._versions = [t._version for t in self._tensors]
        self._pointers = [t.data_ptr() for t in self._tensors]
        self._modules = modules

    def changed(self) -> str | None:
        """What changed since :meth:`mark` (one reason), or None."""
        if [t._version for t in self._tensors] != self._versions:
            return "a parameter or buffer was written in place (load_state_dict, an optimizer step, fill_)"
        if [t.data_ptr() for t in self._tensors] != self._pointers:
            return "a parameter or buffer was moved (.to(), .data =)"
        if list(map(len, self._dicts)) != self._sizes:
            return "an attribute, parameter, buffer or submodule was added or removed"
        now = [_get(held, name) for held, name in self._slots]
        if all(map(operator.is_, now, self._values)):
            return None
        i = next(i for i, (a, b) in enumerate(zip(now, self._values)) if a is not b)
        (held, name), owner = self._slots[i], type(self._owners[i]).__name__
        if held is self._owners[i].__dict__:
            return f"a hyper-parameter was set ({owner}.{name} = {now[i]!r})"
        return f"{owner}.{name} was replaced"

    def written_only(self, shared: set[int], held: Any = None) -> bool:
        """Whether what changed since :meth:`mark` is only in-place writes to
        the tensors whose ids are in ``shared`` and plain attributes set to
        what ``held(module, name, value)`` says is held already (nothing
        moved, swapped, added or otherwise set)."""
        if [t.data_ptr() for t in self._tensors] != self._pointers or list(map(len, self._dicts)) != self._sizes:
            return False
        for (slots, name), value, owner in zip(self._slots, self._values, self._owners):
            now = _get(slots, name)
            if now is not value and not (held is not None and slots is owner.__dict__ and held(owner, name, now)):
                return False
        return all(id(t) in shared for t, v in zip(self._tensors, self._versions) if t._version != v)


_MISSING = object()


def _get(held: Any, name: str) -> Any:
    """``held[name]``, or a marker where it is gone (a dict, or a TorchScript
    module's wrapper of one, which has no ``get``)."""
    return held[name] if name in held else _MISSING


def _tensor_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, Tensor]]:
    """``(module, slot, qualified name, tensor)`` of every parameter and buffer."""
    return [(module, name, f"{prefix}.{name}" if prefix else name, tensor)
            for prefix, module in model.named_modules(remove_duplicate=False)
            for held in (module._parameters, module._buffers) for name, tensor in list(held.items()) if tensor is not None]


def share_weights(prepared: torch.nn.Module, source: torch.nn.Module) -> set[int]:
    """Make ``prepared`` (an adapter's compile-ready copy of ``source``) hold
    ``source``'s own tensors wherever it holds an equal copy of one under
    the same name (one name ending the other: the copy may sit inside a
    wrapper, ``core.model.x`` for ``x``), of the same shape, dtype, device and
    values. A write to ``source``'s weights in place (an optimizer step,
    ``load_state_dict``, ``mul_``) is then a write to ``prepared``'s, and the
    weights sit in memory once. A slot keeps its kind (parameter or buffer)
    and ``requires_grad``: where they differ it holds a view sharing
    ``source``'s storage and version counter. Returns the ids of the
    ``source`` tensors now shared."""
    own = {name: tensor for _, _, name, tensor in _tensor_slots(source)}
    shared: set[int] = set()
    views: dict[tuple[int, bool | None], Tensor] = {}  # one view per tensor and kind: ties stay ties
    for module, slot, name, tensor in _tensor_slots(prepared):
        match = _same_name(name, own)
        if match is None or (tuple(match.shape), match.dtype, match.device) != (
                tuple(tensor.shape), tensor.dtype, tensor.device):
            continue
        if match is not tensor and match.data_ptr() != tensor.data_ptr():
            if not torch.equal(match.detach(), tensor.detach()):
                continue  # held in another form: a write to it prepares the copy again (Follow)
            if slot in module._parameters:
                same = isinstance(match, torch.nn.Parameter) and match.requires_grad == tensor.requires_grad
                module._parameters[slot] = match if same else views.setdefault(
                    (id(match), tensor.requires_grad), torch.nn.Parameter(match.detach(), tensor.requires_grad))
            else:
                module._buffers[slot] = views.setdefault((id(match), None), match.detach())
        shared.add(id(match))
    return shared


def _same_name(name: str, own: dict[str, Any]) -> Any:
    """The value in ``own`` whose name ends ``name`` or is ended by it (the
    longest such; None where none is, or where several objects are)."""
    parts = name.split(".")
    for i in range(len(parts)):
        if ".".join(parts[i:]) in own:
            return own[".".join(parts[i:])]
    found = {id(v): v for key, v in own.items() if key.endswith("." + name)}
    return next(iter(found.values())) if len(found) == 1 else None


class Follow:
    """The user's model behind an adapter's prepared copy: the copy shares
    its weights (:func:`share_weights`), so writes to them in place need
    nothing; :meth:`stale` says when ``source`` changed in a way the copy
    does not follow (a tensor it does not share written, a tensor moved or
    swapped, a hyper-parameter set, a submodule replaced): the copy must
    then be prepared again.

    Parameters
    ----------
    source
        The model the user holds.
    prepared
        The adapter's copy of it (its tensors are made ``source``'s here).
    """

    def __init__(self, source: torch.nn.Module, prepared: torch.nn.Module) -> None:
        self.shared = share_weights(prepared, source)
        self.watch = Watch(source)
        self._names = {id(module): name for name, module in source.named_modules()}
        self._copies = dict(prepared.named_modules())

    def stale(self) -> str | None:
        """What changed in ``source`` that the copy does not follow, or None."""
        why = self.watch.changed()
        if why is None:
            return None
        if self.watch.written_only(self.shared, self._held):
            self.watch.mark()
            return None
        return why

    def _held(self, module: torch.nn.Module, name: str, value: Any) -> bool:
        """Whether the copy's module for ``module`` (by name, or the one of
        its type for the top) already has ``name = value``: a model that sets
        an attribute on its first call (fairchem's ``device``) does not make
        its copy stale."""
        qualified = self._names.get(id(module))
        if qualified is None:
            return False
        if qualified:
            copy = _same_name(qualified, self._copies)
        else:
            tops = [m for m in self._copies.values() if isinstance(m, type(module))]
            copy = tops[0] if len(tops) == 1 else None
        return copy is not None and isinstance(copy, type(module)) and getattr(copy, name, _MISSING) == value
