"""What an ahead-of-time package was built from: the model's weights and
hyper-parameters, digested for the store's key and watched between calls.

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

__all__ = ["Watch", "packages_key", "plain", "weights_digest"]

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
            slots += [(held, name) for held in (module._parameters, module._buffers, module._modules) for name in held]
            self._slots += slots
            self._owners += [module] * len(slots)
        self._sizes = [len(d) for d in self._dicts]
        self._values = [held.get(name) for held, name in self._slots]
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
        now = [held.get(name, _MISSING) for held, name in self._slots]
        if all(map(operator.is_, now, self._values)):
            return None
        i = next(i for i, (a, b) in enumerate(zip(now, self._values)) if a is not b)
        (held, name), owner = self._slots[i], type(self._owners[i]).__name__
        if held is self._owners[i].__dict__:
            return f"a hyper-parameter was set ({owner}.{name} = {now[i]!r})"
        return f"{owner}.{name} was replaced"


_MISSING = object()
