"""The adapter registry: every adapter, built-in or plugin, found through
the ``ddpad.adapters`` entry-point group (ddpad's own distribution declares
the built-ins there, in ``pyproject.toml``), loaded on first use and kept
for the process; adapters registered in the process beside them. Public as
``ddpad.adapters``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import pathlib
import threading
import warnings
from dataclasses import replace
from typing import Any

from ._adapter import Adapter
from ._noise import quiet
from ._version import install_command

__all__ = ["ENTRY_POINT_GROUP", "AdapterNotFound", "AdapterUnavailable", "available", "get", "register", "status",
           "resolve_adapter"]

ENTRY_POINT_GROUP = "ddpad.adapters"
"""The entry-point group adapters are found in, built-in and plugins alike."""
_DISTRIBUTION = "ddpad"  # whose entry points are the built-ins


class AdapterNotFound(KeyError):
    """No adapter of that name is built in, registered or installed as a plugin."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class AdapterUnavailable(ImportError):
    """The adapter exists but cannot be used here. ``reason`` says why:
    ``"missing"`` (its model package is not installed), ``"broken"`` (the
    model package or the plugin is installed but fails to import) or
    ``"unavailable"`` (not an adapter).
    ``install_hint`` is the command that installs what is missing, when known."""

    def __init__(self, message: str, *, install_hint: str | None = None, reason: str = "unavailable") -> None:
        super().__init__(message)
        self.install_hint = install_hint
        self.reason = reason
        self.requires: tuple[str, ...] | None = None  # what the adapter needs, where it loaded


class _Registry:
    """The registry's one piece of state: adapters registered in this
    process and adapters loaded from entry points, by name, behind a lock,
    so that a registration in one thread is seen by every other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered: dict[str, Adapter] = {}
        self._loaded: dict[str, Adapter] = {}

    def known(self, name: str) -> Adapter | None:
        with self._lock:
            return self._loaded.get(name) or self._registered.get(name)

    def registered(self) -> set[str]:
        with self._lock:
            return set(self._registered)

    def register(self, adapter: Adapter, replace_existing: bool) -> None:
        with self._lock:
            if adapter.name in self._registered and not replace_existing:
                raise ValueError(f"adapter {adapter.name!r} is already registered (pass replace_existing=True)")
            self._registered[adapter.name] = adapter
            self._loaded.pop(adapter.name, None)

    def loaded(self, adapter: Adapter) -> Adapter:
        """``adapter`` kept as loaded; the one kept first where two threads loaded it at once."""
        with self._lock:
            return self._loaded.setdefault(adapter.name, adapter)


_REGISTRY = _Registry()


_EntryPoints = dict[str, importlib.metadata.EntryPoint]


def _entry_points(warn: bool = False) -> tuple[_EntryPoints, _EntryPoints]:
    """The group's entry points by name: ddpad's own (the built-ins) and
    the plugins'; a plugin that takes a built-in's name loses (and, with
    ``warn``, says so: where a listing or a plugin's lookup reads them)."""
    builtins: _EntryPoints = {}
    plugins: _EntryPoints = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        if dist is not None and _normal(dist.name) == _DISTRIBUTION:
            builtins.setdefault(ep.name, ep)
        else:
            plugins.setdefault(ep.name, ep)
    for name in sorted(set(plugins) & set(builtins)):
        clash = plugins.pop(name)
        if warn:
            warnings.warn(
                f"ddpad: plugin adapter {name!r} ({clash.value}) clashes with the "
                "built-in adapter of that name; the built-in is used",
                RuntimeWarning,
                stacklevel=3,
            )
    return builtins, plugins


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def available() -> list[str]:
    """Names of every known adapter: built-in, registered and plugins.

    Imports no model package and no plugin.
    """
    builtins, plugins = _entry_points(warn=True)
    return sorted(set(builtins) | _REGISTRY.registered() | set(plugins))


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
    """Register ``adapter`` in this process (seen from every thread) under its name.

    Raises
    ------
    ValueError
        When the name is built in, or already registered and
        ``replace_existing`` is False.
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register() takes an Adapter, got {type(adapter).__name__}")
    if adapter.name in _entry_points()[0]:
        raise ValueError(f"{adapter.name!r} is a built-in adapter name; choose another")
    _REGISTRY.register(adapter, replace_existing)


def portable(adapter: Adapter) -> Adapter | str:
    """``adapter`` as another process (a build worker) gets it: its name
    where that process loads this very adapter by it (a built-in's or a
    plugin's entry point; :func:`register` registers in this process only,
    and a copy made here has no entry point), else the adapter itself, to be
    pickled."""
    builtins, plugins = _entry_points()
    if adapter.name in builtins or adapter.name in plugins:
        with contextlib.suppress(Exception):  # (a name that does not load here is no way back to it)
            if get(adapter.name) is adapter:
                return adapter.name
    return adapter


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
        "broken"``: the message is the failure's last line and the fix).
        Every required package is
        imported here, so a broken one is met here, not halfway through a run.
    """
    known = _REGISTRY.known(name)
    if known is not None:
        return known
    builtins, plugins = _entry_points()
    builtin = name in builtins
    if not builtin:  # a plugin's lookup names the plugins that lost to a built-in
        builtins, plugins = _entry_points(warn=True)
    ep = builtins.get(name) or plugins.get(name)
    if ep is None:
        raise AdapterNotFound(f"unknown ddpad adapter {name!r}; known adapters: {', '.join(available())}"
                              + ("" if builtins else _UNINSTALLED))
    origin = "ddpad" if builtin else f"plugin {ep.value}"
    try:
        with quiet():
            obj = ep.load()
    except Exception as exc:
        raise AdapterUnavailable(
            f"ddpad {'adapter' if builtin else 'plugin adapter'} {name!r} ({ep.value}) failed to import: "
            f"{type(exc).__name__}: {exc}",
            reason="broken",
        ) from exc
    adapter = _check_adapter(name, obj, origin)
    if builtin and not adapter.install_hint:
        adapter = replace(adapter, install_hint=install_command(name))  # ddpad's extra of that name
    problem = _unavailable(name, adapter.requires, adapter.install_hint)
    if problem is not None:
        problem.requires = adapter.requires
        raise problem
    return _REGISTRY.loaded(adapter)


# where ddpad runs from a source tree that was never installed, its entry points are not there
_UNINSTALLED = (" (no built-in adapter found: ddpad's built-ins are entry points of its installed "
                "distribution; install it: pip install -e .)")


def resolve_adapter(adapter: Adapter | str) -> Adapter:
    """An :class:`Adapter`, looked up by name if need be."""
    return get(adapter) if isinstance(adapter, str) else adapter


def unmet_requirements(requires: Any) -> list[str]:
    """What the distribution of the model package (the first import name of
    ``requires``) requires and this environment does not satisfy, one line
    each (``"mace-torch needs e3nn==0.4.4, 0.6.0 is installed"``): a package
    that imports may still break at run time. Empty where it cannot tell."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # (pip's own copy is not ours to import)
        return []
    owners = importlib.metadata.packages_distributions()
    unmet = []
    for dist in owners.get(str(next(iter(requires), "")).split(".")[0], [])[:1]:
        for text in importlib.metadata.requires(dist) or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                continue  # (an optional dependency pip did not install: import errors say so)
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{dist} needs {req.name}{req.specifier}, {have} is installed")
    return unmet


def status(name: str) -> dict[str, Any]:
    """What ``ddpad list`` shows for one adapter, without raising: kind
    (built-in / registered / plugin), ``state`` (``"installed"``: it loads
    and its packages import; else the :attr:`AdapterUnavailable.reason`:
    ``"missing"``, ``"broken"``, ``"unavailable"``), whether it is usable
    (``ok``), what it requires, the install hint and the error if any.
    Loading it imports its model package (the only way to know it works)."""
    builtin = name in _entry_points()[0]
    kind = "built-in" if builtin else "registered" if name in _REGISTRY.registered() else "plugin"
    info: dict[str, Any] = {"name": name, "kind": kind, "ok": True, "state": "installed", "error": None}
    try:
        adapter = get(name)
        info["install_hint"] = adapter.install_hint
        info["requires"] = list(adapter.requires)
        unmet = unmet_requirements(adapter.requires)
        if unmet:  # it imports, but another install moved a package it pins (mace's e3nn)
            info.update(ok=False, state="broken", error="; ".join(unmet) + ": reinstall its extra in an "
                        "environment of its own (model packages conflict: one environment per adapter)")
    except (AdapterUnavailable, AdapterNotFound) as exc:
        info.update(ok=False, error=str(exc), state=getattr(exc, "reason", "unavailable"))
        hint = getattr(exc, "install_hint", None)
        if hint is None and builtin:
            hint = install_command(name)
        if hint is not None:
            info["install_hint"] = hint
        requires = getattr(exc, "requires", None)
        if requires is not None:
            info["requires"] = list(requires)
    return info
