"""Per-model adapters and their registry.

``get(name)`` returns an :class:`Adapter`; ``available()`` lists names
without importing any model package or plugin. Third-party packages add
adapters through the entry-point group ``ddpad.adapters``::

    [project.entry-points."ddpad.adapters"]
    mymodel = "mypkg.ddpad_adapter:ADAPTER"
"""

from ._adapter import Adapter
from ._registry import (
    ENTRY_POINT_GROUP,
    AdapterNotFound,
    AdapterUnavailable,
    available,
    get,
    register,
    status,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Adapter",
    "AdapterNotFound",
    "AdapterUnavailable",
    "available",
    "get",
    "register",
    "status",
]
