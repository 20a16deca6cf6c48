"""Adapter registry: built-ins plus plugins from the ``ddpad.adapters``
entry-point group, discovered by name and loaded on first use."""

from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import importlib.util
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from ._adapter import Adapter

__all__ = ["AdapterNotFound", "AdapterUnavailable", "available", "get", "register", "status"]

ENTRY_POINT_GROUP = "ddpad.adapters"


class AdapterNotFound(KeyError):
    """No adapter of that name is built in, registered or installed as a plugin."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class AdapterUnavailable(ImportError):
    """The adapter exists but cannot be used here (its model package is missing,
    its plugin fails to import, or it is not implemented yet). ``install_hint``
    is the command that installs what is missing, when known."""

    def __init__(self, message: str, *, install_hint: str | None = None) -> None:
        super().__init__(message)
        self.install_hint = install_hint


@dataclass(frozen=True)
class _Builtin:
    target: str | None  # "module:attr"; None while the adapter is not built yet
    requires: tuple[str, ...]
    install_hint: str


_BUILTINS: Mapping[str, _Builtin] = MappingProxyType({
    "mace": _Builtin("ddpad.adapters.mace:ADAPTER", ("mace", "e3nn"), "pip install 'ddpad[mace]'"),
    "uma": _Builtin("ddpad.adapters.uma:ADAPTER", ("fairchem.core",), "pip install 'ddpad[uma]'"),
    "aimnet2": _Builtin("ddpad.adapters.aimnet2:ADAPTER", ("aimnet",), "pip install 'ddpad[aimnet2]'"),
    "sevennet": _Builtin("ddpad.adapters.sevennet:ADAPTER", ("sevenn",), "pip install 'ddpad[sevennet]'"),
    "nequip": _Builtin("ddpad.adapters.nequip:ADAPTER", ("nequip",), "pip install 'ddpad[nequip]'"),
    "allegro": _Builtin("ddpad.adapters.allegro:ADAPTER", ("allegro", "nequip"), "pip install 'ddpad[allegro]'"),
    "orb": _Builtin("ddpad.adapters.orb:ADAPTER", ("orb_models",), "pip install 'ddpad[orb]'"),
    "mattersim": _Builtin("ddpad.adapters.mattersim:ADAPTER", ("mattersim",), "pip install 'ddpad[mattersim]'"),
})


@dataclass(frozen=True)
class _State:
    registered: Mapping[str, Adapter]
    loaded: Mapping[str, Adapter]


# Registrations and the load cache live in a context variable (no module-level
# mutable state); updates replace the immutable value.
_STATE: contextvars.ContextVar[_State] = contextvars.ContextVar(
    "ddpad_adapters", default=_State(MappingProxyType({}), MappingProxyType({}))  # noqa: B039 - frozen, read-only
)


def _plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the group, by name; clashes with built-ins warn and lose."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTINS:
            warnings.warn(
                f"ddpad: plugin adapter {ep.name!r} ({ep.value}) clashes with the "
                "built-in adapter of that name; the built-in is used",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        found.setdefault(ep.name, ep)
    return found


def available() -> list[str]:
    """Names of every known adapter: built-in, registered and plugins.

    Imports no model package and no plugin.
    """
    names = set(_BUILTINS) | set(_STATE.get().registered) | set(_plugins())
    return sorted(names)


def _missing(requires: tuple[str, ...]) -> list[str]:
    missing = []
    for name in requires:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def register(adapter: Adapter, *, replace_existing: bool = False) -> None:
    """Register ``adapter`` in this process (and this context) under its name.

    Raises
    ------
    ValueError
        When the name is built in, or already registered and
        ``replace_existing`` is False.
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register() takes an Adapter, got {type(adapter).__name__}")
    if adapter.name in _BUILTINS:
        raise ValueError(f"{adapter.name!r} is a built-in adapter name; choose another")
    state = _STATE.get()
    if adapter.name in state.registered and not replace_existing:
        raise ValueError(f"adapter {adapter.name!r} is already registered (pass replace_existing=True)")
    loaded = {k: v for k, v in state.loaded.items() if k != adapter.name}
    _STATE.set(_State(MappingProxyType({**state.registered, adapter.name: adapter}), MappingProxyType(loaded)))


def _load_target(name: str, target: str) -> Any:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def _check_adapter(name: str, obj: Any, origin: str) -> Adapter:
    if callable(obj) and not isinstance(obj, Adapter):
        obj = obj()
    if not isinstance(obj, Adapter):
        raise AdapterUnavailable(
            f"ddpad adapter {name!r} from {origin} is a {type(obj).__name__}, not a ddpad.adapters.Adapter"
        )
    if obj.name != name:
        obj = replace(obj, name=name)
    return obj


def get(name: str) -> Adapter:
    """The adapter called ``name``, loaded on first use and cached.

    Raises
    ------
    AdapterNotFound
        Unknown name; the message lists the known ones.
    AdapterUnavailable
        The model package is missing (the message gives the pip command), the
        plugin fails to import, or the adapter is not implemented yet.
    """
    state = _STATE.get()
    if name in state.loaded:
        return state.loaded[name]
    if name in state.registered:
        return state.registered[name]
    builtin = _BUILTINS.get(name)
    if builtin is not None:
        if builtin.target is None:
            raise AdapterUnavailable(
                f"ddpad adapter {name!r} is declared but not implemented in ddpad "
                f"{_version()} yet; no model can be wrapped with it"
            )
        missing = _missing(builtin.requires)
        if missing:
            raise AdapterUnavailable(
                f"ddpad adapter {name!r} needs {', '.join(missing)}, which is not installed: "
                f"{builtin.install_hint}",
                install_hint=builtin.install_hint,
            )
        adapter = _check_adapter(name, _load_target(name, builtin.target), "ddpad")
    else:
        plugins = _plugins()
        if name not in plugins:
            raise AdapterNotFound(
                f"unknown ddpad adapter {name!r}; known adapters: {', '.join(available())}"
            )
        ep = plugins[name]
        try:
            obj = ep.load()
        except Exception as exc:
            raise AdapterUnavailable(
                f"ddpad plugin adapter {name!r} ({ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        adapter = _check_adapter(name, obj, f"plugin {ep.value}")
        missing = _missing(adapter.requires)
        if missing:
            raise AdapterUnavailable(
                f"ddpad adapter {name!r} needs {', '.join(missing)}, which is not installed: "
                f"{adapter.install_hint}",
                install_hint=adapter.install_hint,
            )
    _STATE.set(_State(state.registered, MappingProxyType({**state.loaded, name: adapter})))
    return adapter


def status(name: str) -> dict[str, Any]:
    """What ``ddpad list`` shows for one adapter, without raising: kind
    (built-in / registered / plugin), whether it loads, the install hint and
    the error if it does not."""
    kind = "built-in" if name in _BUILTINS else "registered" if name in _STATE.get().registered else "plugin"
    info: dict[str, Any] = {"name": name, "kind": kind, "ok": True, "error": None}
    try:
        adapter = get(name)
        info["install_hint"] = adapter.install_hint
        info["requires"] = list(adapter.requires)
    except (AdapterUnavailable, AdapterNotFound) as exc:
        info.update(ok=False, error=str(exc))
        hint = getattr(exc, "install_hint", None)
        if hint is None and name in _BUILTINS:
            hint = _BUILTINS[name].install_hint
        if hint is not None:
            info["install_hint"] = hint
    return info


def _version() -> str:
    try:
        return importlib.metadata.version("ddpad")
    except importlib.metadata.PackageNotFoundError:
        return "(uninstalled)"
