"""Per-model adapters, and the registry's public face.

``get(name)`` returns an :class:`Adapter`; ``available()`` lists names
without importing any model package or plugin. The registry is the core's
(``ddpad._registry``): the built-in adapters below are entry points of
ddpad's own distribution, in the same group third-party packages add theirs
to, ``ddpad.adapters``::

    [project.entry-points."ddpad.adapters"]
    mymodel = "mypkg.ddpad_adapter:ADAPTER"
"""

from ddpad._adapter import Adapter, EngineHooks, ToolHooks
from ddpad._registry import (
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
    "EngineHooks",
    "ToolHooks",
    "available",
    "get",
    "register",
    "status",
]
