"""Adapter registry: built-ins plus plugins from the ``ddpad.adapters``
entry-point group, discovered by name and loaded on first use."""

from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import importlib.util
import pathlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from ddpad._noise import quiet
from ddpad._version import install_command

from ._adapter import Adapter

__all__ = ["AdapterNotFound", "AdapterUnavailable", "available", "get", "register", "status"]

ENTRY_POINT_GROUP = "ddpad.adapters"


class AdapterNotFound(KeyError):
    """No adapter of that name is built in, registered or installed as a plugin."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class AdapterUnavailable(ImportError):
    """The adapter exists but cannot be used here. ``reason`` says why:
    ``"missing"`` (its model package is not installed), ``"broken"`` (the
    model package or the plugin is installed but fails to import) or
    ``"unavailable"`` (not an adapter, or not implemented yet).
    ``install_hint`` is the command that installs what is missing, when known."""

    def __init__(self, message: str, *, install_hint: str | None = None, reason: str = "unavailable") -> None:
        super().__init__(message)
        self.install_hint = install_hint
        self.reason = reason


@dataclass(frozen=True)
class _Builtin:
    """A built-in adapter's entry: where it is and, read without importing it
    (``ddpad list``), what it needs. The one place ``requires`` and
    ``install_hint`` of a built-in are written (:func:`builtin_declaration`)."""

    target: str | None  # "module:attr"; None while the adapter is not built yet
    requires: tuple[str, ...]  # import names, the model package's first
    install_hint: str


_BUILTINS: Mapping[str, _Builtin] = MappingProxyType({
    "mace": _Builtin("ddpad.adapters.mace:ADAPTER", ("mace", "e3nn"), install_command("mace")),
    "uma": _Builtin("ddpad.adapters.uma:ADAPTER", ("fairchem.core",), install_command("uma")),
    "aimnet2": _Builtin("ddpad.adapters.aimnet2:ADAPTER", ("aimnet",), install_command("aimnet2")),
    "sevennet": _Builtin("ddpad.adapters.sevennet:ADAPTER", ("sevenn",), install_command("sevennet")),
    "nequip": _Builtin("ddpad.adapters.nequip:ADAPTER", ("nequip",), install_command("nequip")),
    "allegro": _Builtin("ddpad.adapters.allegro:ADAPTER", ("allegro", "nequip"), install_command("allegro")),
    "orb": _Builtin("ddpad.adapters.orb:ADAPTER", ("orb_models",), install_command("orb")),
    "mattersim": _Builtin("ddpad.adapters.mattersim:ADAPTER", ("mattersim",), install_command("mattersim")),
})


def builtin_declaration(name: str) -> dict[str, Any]:
    """``requires`` and ``install_hint`` of the built-in adapter ``name``, for
    its :class:`Adapter` declaration."""
    builtin = _BUILTINS[name]
    return {"requires": builtin.requires, "install_hint": builtin.install_hint}


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


def _unavailable(name: str, requires: tuple[str, ...], install_hint: str) -> AdapterUnavailable | None:
    """Why the adapter ``name`` cannot be used here (None when it can): a
    required package is not installed, or one is and fails to import (which
    is what using the adapter would meet first)."""
    missing = _missing(requires)
    if missing:
        return AdapterUnavailable(
            f"ddpad adapter {name!r} needs {', '.join(missing)}, which is not installed: {install_hint}",
            install_hint=install_hint, reason="missing",
        )
    for module in requires:
        try:
            with quiet():  # the package's known import-time warnings and banners
                importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure makes the adapter unusable
            broken = AdapterUnavailable(
                f"ddpad adapter {name!r} is broken: {module} is installed but fails to import: "
                f"{_last_line(exc)}{_culprit(exc, module)}; fix: {install_hint} in a fresh environment "
                "(or reinstall the failing package for this torch)",
                install_hint=install_hint, reason="broken",
            )
            broken.__cause__ = exc  # the whole traceback, for who looks
            return broken
    return None


def _last_line(exc: BaseException) -> str:
    """``Type: message``, the message's last non-empty line (as a traceback ends)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__


def _culprit(exc: BaseException, module: str) -> str:
    """`` (in DIST VERSION, beside torch VERSION)`` naming the installed
    distribution the failure came from, when it is not ``module``'s own nor
    torch's (e.g. a torchvision built for another torch); else ``""``."""
    import traceback

    owners = importlib.metadata.packages_distributions()
    own = {module.split(".")[0], "torch"}
    culprit = None
    for frame in traceback.extract_tb(exc.__traceback__):
        parts = pathlib.PurePath(frame.filename).parts
        site = next((i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")), None)
        if site is None or site + 1 >= len(parts):
            continue
        top = parts[site + 1].removesuffix(".py")
        if top in owners and top not in own:
            culprit = owners[top][0]
    if culprit is None:
        return ""
    try:
        version = importlib.metadata.version(culprit)
    except importlib.metadata.PackageNotFoundError:
        return ""
    import torch

    return f" (in {culprit} {version}, beside torch {torch.__version__})"


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
    with quiet():
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
        The model package is missing (the message gives the pip command), it
        or the plugin is installed but fails to import (``reason ==
        "broken"``: the message is the failure's last line and the fix), or
        the adapter is not implemented yet. Every required package is
        imported here, so a broken one is met here, not halfway through a run.
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
        problem = _unavailable(name, builtin.requires, builtin.install_hint)
        if problem is not None:
            raise problem
        adapter = _check_adapter(name, _load_target(name, builtin.target), "ddpad")
    else:
        plugins = _plugins()
        if name not in plugins:
            raise AdapterNotFound(
                f"unknown ddpad adapter {name!r}; known adapters: {', '.join(available())}"
            )
        ep = plugins[name]
        try:
            with quiet():
                obj = ep.load()
        except Exception as exc:
            raise AdapterUnavailable(
                f"ddpad plugin adapter {name!r} ({ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}",
                reason="broken",
            ) from exc
        adapter = _check_adapter(name, obj, f"plugin {ep.value}")
        problem = _unavailable(name, adapter.requires, adapter.install_hint)
        if problem is not None:
            raise problem
    _STATE.set(_State(state.registered, MappingProxyType({**state.loaded, name: adapter})))
    return adapter


def status(name: str) -> dict[str, Any]:
    """What ``ddpad list`` shows for one adapter, without raising: kind
    (built-in / registered / plugin), ``state`` (``"installed"``: it loads
    and its packages import; else the :attr:`AdapterUnavailable.reason`:
    ``"missing"``, ``"broken"``, ``"unavailable"``), whether it is usable
    (``ok``), what it requires, the install hint and the error if any.
    Loading it imports its model package (the only way to know it works)."""
    kind = "built-in" if name in _BUILTINS else "registered" if name in _STATE.get().registered else "plugin"
    info: dict[str, Any] = {"name": name, "kind": kind, "ok": True, "state": "installed", "error": None}
    if name in _BUILTINS:
        info["requires"] = list(_BUILTINS[name].requires)
    try:
        adapter = get(name)
        info["install_hint"] = adapter.install_hint
        info["requires"] = list(adapter.requires)
    except (AdapterUnavailable, AdapterNotFound) as exc:
        info.update(ok=False, error=str(exc), state=getattr(exc, "reason", "unavailable"))
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
