"""The padder protocol frameworks code against (SPEC section 4)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["GraphPadder"]


@runtime_checkable
class GraphPadder(Protocol):
    """Pads a model input to fixed capacities and strips dead rows from outputs.

    The padder owns *how* its representation is padded and when its caps
    become knowable; the framework owns *when* padding happens and restores
    whatever padding changed, even when the forward raises.
    """

    def pad(self, data: Any, cap_state: dict[str, int], cap_atoms: bool = True) -> Any:
        """Resolve this padder's caps from ``cap_state`` and return ``data``
        padded to them. ``cap_atoms=False`` caps only edges (the atom set is
        fixed). ``None`` data is returned unchanged."""
        ...

    def unpad(self, output: Any, n_real: int | None = None) -> Any:
        """Drop dead rows from a model output. ``n_real`` overrides the real
        row count recorded by the matching :meth:`pad`."""
        ...
