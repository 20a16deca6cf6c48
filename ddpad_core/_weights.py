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

    def written_only(self, shared: set[int]) -> bool:
        """Whether what changed since :meth:`mark` is only in-place writes to
        the tensors whose ids are in ``shared`` (nothing moved, swapped,
        added or set)."""
        if [t.data_ptr() for t in self._tensors] != self._pointers or list(map(len, self._dicts)) != self._sizes:
            return False
        if not all(_get(held, name) is value for (held, name), value in zip(self._slots, self._values)):
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
    ``source``'s own tensors wherever it holds an equal copy of one: same
    shape, dtype, device and values, the longest common name suffix first.
    A write to ``source``'s weights in place (an optimizer step,
    ``load_state_dict``, ``mul_``) is then a write to ``prepared``'s, and the
    weights sit in memory once. A slot keeps its kind (parameter or buffer)
    and ``requires_grad``: where they differ it holds a view sharing
    ``source``'s storage and version counter. Returns the ids of the
    ``source`` tensors now shared."""
    candidates: dict[tuple[Any, ...], list[tuple[str, Tensor]]] = {}
    for _, _, name, tensor in _tensor_slots(source):
        candidates.setdefault((tuple(tensor.shape), tensor.dtype, tensor.device), []).append((name, tensor))
    shared: set[int] = set()
    for module, slot, name, tensor in _tensor_slots(prepared):
        pool = candidates.get((tuple(tensor.shape), tensor.dtype, tensor.device), [])
        for _, own in sorted(pool, key=lambda c: -_common_suffix(c[0], name)):
            if own is tensor or own.data_ptr() == tensor.data_ptr():
                shared.add(id(own))
                break
            if not torch.equal(own.detach(), tensor.detach()):
                continue
            if slot in module._parameters:
                same = isinstance(own, torch.nn.Parameter) and own.requires_grad == tensor.requires_grad
                module._parameters[slot] = own if same else torch.nn.Parameter(own.detach(), tensor.requires_grad)
            else:
                module._buffers[slot] = own.detach()
            shared.add(id(own))
            break
    return shared


def _common_suffix(a: str, b: str) -> int:
    """How many trailing dotted parts ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(reversed(a.split(".")), reversed(b.split("."))):
        if x != y:
            break
        n += 1
    return n


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

    def stale(self) -> str | None:
        """What changed in ``source`` that the copy does not follow, or None."""
        why = self.watch.changed()
        if why is None:
            return None
        if self.watch.written_only(self.shared):
            self.watch.mark()
            return None
        return why
