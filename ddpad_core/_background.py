"""Compile the next rung in the background, so a growth only loads.

When a cap's need rises past every need seen at the current caps, to a
fill past a threshold, :class:`Background` starts a worker process (``python -m ddpad._worker SPEC``, :mod:`._worker`) that rebuilds
the padded model at the next rung of caps, calls it once on the last input
and so writes the compiled graphs into the compile store; the rung joins
the model's :class:`~._ladder.Ladder`, so the growth takes it and finds the
entry (or waits on its lock for the worker, which has a head start) and
loads. A process, not a thread: Dynamo and Inductor are not safe to run
beside a compiling or running model in one interpreter, and a process
cannot corrupt the run's state.

Workers are bounded (``background_workers``), stopped by
:meth:`Background.close` (``PaddedModel.close``, its ``with`` block, its
garbage collection or interpreter exit), and each one exits by itself when
its parent process is gone: no orphans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ._capacity import CapResolution, TightCaps
from ._ladder import Ladder, ladder, next_caps
from ._registry import portable
from ._store import CompileStore, aot_binding, bind_store, storable
from ._weights import packages_key

__all__ = ["PACKAGE_BUILD", "Background", "PackageBuilds", "WorkerError", "expected_key", "launch", "write_spec"]

log = logging.getLogger("ddpad")

_Target = tuple[tuple[str, int], ...]


class _Owner(Protocol):
    """What a background compile reads of the model it serves."""

    cap_state: dict[str, int]
    model: torch.nn.Module
    adapter: Any
    source: torch.nn.Module | None  # the model before the adapter prepared it (None: not prepared)


class Background:
    """The background compiles of one :class:`~ddpad.PaddedModel`."""

    def __init__(self, owner: _Owner, ladder: Ladder, store_root: pathlib.Path, threshold: float, workers: int,
                 compile_kwargs: Mapping[str, Any], sizer: TightCaps | None = None,
                 options: Mapping[str, Any] | None = None) -> None:
        self.ladder = ladder
        self.options = dict(options or {})  # the worker's wrap options (compile_mode="aot": it builds packages)
        self.sizer = sizer  # a tight sizing's rungs are its fine ones
        self.store_root = store_root
        self.threshold = threshold
        self.workers = workers
        self.compile_kwargs = dict(compile_kwargs)
        self.folder = store_root / "background"
        self.running: dict[_Target, subprocess.Popen[bytes]] = {}
        self.targets: set[_Target] = set()  # caps compiled for, started
        self.logs: dict[_Target, pathlib.Path] = {}  # each running worker's log
        self.disabled = False
        # the caps the needs below were seen at, and each key's highest need there (a tight fit's
        # window included): a worker starts for a need that rises past them, not for one already seen
        self.sized: _Target | None = None
        self.peaks: dict[str, int] = {}
        # stop the workers when the model goes away or the interpreter exits
        self._finalizer = weakref.finalize(owner, _stop, self.running)

    def after_call(self, owner: _Owner, data: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   resolved: list[CapResolution]) -> None:
        """Reap finished workers; start workers for caps the run is likely to
        need: a key whose need rose past every need seen at these caps, to a
        fill past the threshold (a fill already there when the caps were
        sized, as right after a tight fit, says nothing about growth)."""
        for target, code in _reap(self.running, self.logs).items():
            log.warning("ddpad: a background compile for caps %s failed: %s; the growth compiles in the "
                        "foreground", dict(target), _failure(self.logs.pop(target), code))
        if self.sizer is not None and not self.sizer.settled:
            return  # rungs above caps about to be fitted would never be reached
        current = tuple(sorted(owner.cap_state.items()))
        if current != self.sized:  # just sized (first call, fit, growth, shrink): for the needs seen so far
            self.sized = current
            self.peaks = {r.key: max(r.need, self._seen(r)) for r in resolved}
            return
        for r in resolved:
            if self.disabled:  # (a start that failed turns them off: said once)
                return
            peak = self.peaks.get(r.key, r.need)
            self.peaks[r.key] = max(peak, r.need)
            if r.need <= peak or r.cap == 0 or r.need / r.cap < self.threshold or len(self.running) >= self.workers:
                continue
            # the next rung (every key but systems one bucket up: the growth
            # takes it) when r grows in it, else r alone one bucket up
            rungs = ladder(owner.cap_state, resolved, 1, self.sizer)
            grows = bool(rungs) and rungs[0][r.key] > owner.cap_state[r.key]
            target = tuple(sorted((rungs[0] if grows else next_caps(owner.cap_state, r, self.sizer)).items()))
            if target in self.targets or target == current:
                continue
            self._start(owner, target, data, args, kwargs)

    def _seen(self, r: CapResolution) -> int:
        """The highest need ``r.key``'s cap was sized for: a tight fit's window
        maximum; for caps fitted by an earlier run (a caps file: no window
        here) the need the fit's margin puts under the cap."""
        sizer = self.sizer
        if sizer is None:
            return 0
        if sizer.high:
            return sizer.high.get(r.key, 0)
        return int(r.cap / (1 + sizer.policy.margin))

    def _start(self, owner: _Owner, target: _Target, data: Any, args: tuple[Any, ...],
               kwargs: Mapping[str, Any]) -> None:
        try:
            proc, log_path = launch(write_spec(self.folder, owner, dict(target), self.store_root,
                                               self.compile_kwargs, data, args, kwargs, self.options))
        except WorkerError as exc:
            self._off(str(exc))
            return
        self.running[target] = proc
        self.logs[target] = log_path
        self.targets.add(target)
        self.ladder.add(dict(target), "background")  # the growth takes these caps if they fit
        log.info("compiling caps %s in the background (pid %d)", dict(target), proc.pid)

    def _off(self, reason: str) -> None:
        """No background compiles for this model from now on (one warning)."""
        log.warning("background compiles are off for this model: %s; growths compile in the foreground", reason)
        self.disabled = True

    def close(self) -> None:
        """Stop running workers; count the compiles no growth reached."""
        self._finalizer()
        self.ladder.close_background()


class PackageBuilds:
    """Ahead-of-time packages built in worker processes (``compile_mode="aot"``
    with ``aot_build="background"``), one per package signature, at most
    ``workers`` at once and the others queued, so that the run itself never
    waits for an AOTInductor build: it runs ``torch.compile`` at those caps
    until the package is in the store, then loads it."""

    def __init__(self, owner: _Owner, store_root: pathlib.Path, workers: int,
                 compile_kwargs: Mapping[str, Any], stats: Any) -> None:
        self.stats = stats  # its aot_background counts the builds started
        self.store_root = store_root
        self.folder = store_root / "background"
        self.workers = workers
        self.compile_kwargs = dict(compile_kwargs)
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, pathlib.Path] = {}
        self.queued: dict[str, pathlib.Path] = {}  # name -> its written spec, in order
        self.finished: dict[str, str] = {}  # name -> "" (built) or why not
        self.caps: dict[str, dict[str, int]] = {}  # name -> the caps it is built at (for the warning)
        self._finalizer = weakref.finalize(owner, _stop, self.running)

    @property
    def pending(self) -> int:
        """Builds running or queued."""
        return len(self.running) + len(self.queued)

    @property
    def active(self) -> bool:
        """Whether a build is running or queued (the run polls them)."""
        return self.pending > 0

    def status(self, name: str, owner: _Owner, caps: Mapping[str, int], data: Any, args: tuple[Any, ...],
               kwargs: Mapping[str, Any]) -> str | None:
        """None while the package ``name`` (its store key and signature) is
        built elsewhere (its build starts here if it is new); ``""`` once it
        is built (load it from the store); else why it was not (said once, as
        a warning, when it failed)."""
        if name not in self.finished and name not in self.running and name not in self.queued:
            self.caps[name] = dict(caps)
            try:
                self.queued[name] = write_spec(self.folder, owner, caps, self.store_root, self.compile_kwargs,
                                               data, args, kwargs, PACKAGE_BUILD)
            except WorkerError as exc:
                self._failed(name, str(exc))
        self.poll()
        return self.finished.get(name)

    def _failed(self, name: str, why: str) -> None:
        self.finished[name] = why
        log.warning("ddpad: an ahead-of-time package build for caps %s failed: %s; those caps run torch.compile",
                    self.caps.get(name, "?"), why)

    def poll(self) -> None:
        """Reap finished builds; start queued ones while a slot is free."""
        before = set(self.running)
        failed = _reap(self.running, self.logs)
        for name in before - set(self.running):
            if name in failed:
                self._failed(name, _failure(self.logs.pop(name), failed[name]))
            else:
                self.finished[name] = ""
        while self.queued and len(self.running) < self.workers:
            name, spec = next(iter(self.queued.items()))
            del self.queued[name]
            try:
                self.running[name], self.logs[name] = launch(spec)
                self.stats.aot_background += 1
                log.info("building an ahead-of-time package in the background (pid %d)", self.running[name].pid)
            except WorkerError as exc:
                self._failed(name, str(exc))

    def wait(self, timeout: float | None = None) -> int:
        """Poll until no build runs or is queued, or ``timeout`` seconds
        passed; returns how many are left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.active and (deadline is None or time.monotonic() < deadline):
            self.poll()
            time.sleep(0.2)
        self.poll()
        return self.pending

    def close(self) -> None:
        """Stop running builds (a stopped one leaves no entry) and drop the queue."""
        self._finalizer()
        for spec in self.queued.values():
            with contextlib.suppress(OSError):
                spec.unlink()
        self.queued.clear()


# a package build's worker: the ahead-of-time route, built in its process, at exactly the caps sent
PACKAGE_BUILD = {"compile_mode": "aot", "aot_build": "foreground", "cap_policy": "headroom"}


class WorkerError(Exception):
    """A worker could not be started (the message says why)."""


def reaches_worker(adapter: Any) -> bool:
    """Whether a worker process can rebuild ``adapter``: by its name
    (:func:`~._registry.portable`), or from its pickle (an adapter built or
    registered in a script, holding a lambda, has neither)."""
    import pickle

    sent = portable(adapter)
    if isinstance(sent, str):
        return True
    try:
        pickle.dumps(sent)
    except Exception:  # noqa: BLE001 - any pickling failure
        return False
    return True


def write_spec(folder: pathlib.Path, owner: _Owner, caps: Mapping[str, int], store_root: pathlib.Path,
               compile_kwargs: Mapping[str, Any], data: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
               options: Mapping[str, Any]) -> pathlib.Path:
    """Save what a worker needs to rebuild ``owner``'s model at ``caps`` and
    call it once on ``data`` (now: the caller may reuse its input's tensors
    before the worker starts); returns the spec's path."""
    adapter = portable(owner.adapter)
    spec = folder / f"{uuid.uuid4().hex}.pt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _prune(folder)
        torch.save({
            **_model_spec(owner), "adapter": adapter, "caps": dict(caps), "store": str(store_root),
            "compile_kwargs": dict(compile_kwargs), "options": dict(options), "data": data, "args": args,
            "kwargs": dict(kwargs), "expect": expected_key(owner, store_root, compile_kwargs, options),
        }, spec)
    except OSError as exc:  # a read-only or full store
        with contextlib.suppress(OSError):
            spec.unlink()
        raise WorkerError(f"the store cannot be written ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # noqa: BLE001 - a model that does not pickle
        with contextlib.suppress(OSError):
            spec.unlink()
        raise WorkerError(f"the model cannot be pickled for a worker ({type(exc).__name__}: {exc})") from exc
    return spec


def _model_spec(owner: _Owner) -> dict[str, Any]:
    """How a worker rebuilds the model ``owner`` runs. A model the adapter
    prepared goes as the model it was prepared from and the prepared model's
    weights (its state dict, ``torch.compile``'s ``_orig_mod.`` level left
    out): a pickle is not always the way back to a prepared model (e3nn pickles
    its code-generated fx modules as TorchScript, which mace had prepared
    without), so the worker prepares it again, as ``wrap`` did, and loads the
    weights the run holds now. Any other model goes as it is."""
    source = getattr(owner, "source", None)
    if source is None:
        return {"model": owner.model}
    state = {key.replace("_orig_mod.", ""): value for key, value in owner.model.state_dict().items()}
    return {"source": source, "state": state}


def expected_key(owner: _Owner, store_root: pathlib.Path, compile_kwargs: Mapping[str, Any],
                 options: Mapping[str, Any]) -> str | None:
    """The store key under which this process looks for what a worker builds
    for ``owner``: its packages' folder (``compile_mode="aot"``) or its
    graphs'. The worker, which rebuilds the model from a pickle, must arrive
    at the same key, or its work lands where nobody looks."""
    adapter = owner.adapter
    dynamo_config = adapter.dynamo_config if adapter is not None else {}
    if options.get("compile_mode") == "aot":
        packaged = _packaged(owner.model, adapter)
        _, key = aot_binding(packaged, CompileStore(store_root), adapter, dynamo_config)
        return packages_key(key, packaged)
    if not storable(compile_kwargs.get("backend", "inductor")):
        return None
    binding = bind_store(owner.model, store_root, adapter, dynamo_config, **compile_kwargs)
    return binding.model_key if binding is not None else None


def _packaged(model: torch.nn.Module, adapter: Any) -> torch.nn.Module:
    """What a package of ``model`` is built of: the model, or for a model
    padding at its own seam the part after it that its adapter's compile
    region names (found by handing the region the part itself: the model is
    left as it is)."""
    if adapter is None or not adapter.pad_in_forward or adapter.compile_region is None:
        return model
    parts: list[torch.nn.Module] = []
    adapter.compile_region(model, lambda part: parts.append(part) or part)
    return parts[0] if parts else model


def launch(spec: pathlib.Path) -> tuple[subprocess.Popen[bytes], pathlib.Path]:
    """Start ``python -m ddpad._worker SPEC`` (it removes the spec once read);
    returns the process and its log's path."""
    log_path = spec.with_suffix(".log")
    try:
        log_file = open(log_path, "wb")  # noqa: SIM115 - the child owns it
    except OSError as exc:
        with contextlib.suppress(OSError):
            spec.unlink()
        raise WorkerError(f"the store cannot be written ({type(exc).__name__}: {exc})") from exc
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ddpad._worker", str(spec), str(os.getpid())],
                                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log_file.close()
    return proc, log_path


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _failure(log_path: pathlib.Path, code: int) -> str:
    """Why a worker failed: how it ended (an exit status, or the signal that
    killed it), its log's last line, and where the log is."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    ended = f"exit status {code}" if code >= 0 else f"killed by {_signal_name(-code)}"
    said = lines[-1].strip()[:300] if lines else "it printed nothing"
    return f"its worker process ended with {ended} ({said}; log: {log_path})"


def _reap(running: dict[Any, subprocess.Popen[bytes]], logs: dict[Any, pathlib.Path]) -> dict[Any, int]:
    """Drop finished workers from ``running`` (and a clean exit's log);
    returns the exit codes of those that failed (their logs stay in ``logs``)."""
    failed = {}
    for key, proc in list(running.items()):
        if proc.poll() is None:
            continue
        del running[key]
        if proc.returncode == 0:  # its log said nothing anyone needs
            with contextlib.suppress(OSError):
                logs.pop(key).unlink()
        else:
            failed[key] = proc.returncode
    return failed


# failed workers' logs kept in STORE/background (a finished worker's log is removed)
_KEEP_LOGS = 20


def _prune(folder: pathlib.Path) -> None:
    """Keep only the newest ``_KEEP_LOGS`` worker logs (and no leftover specs
    older than a day: a worker killed before it read its spec)."""
    def age(path: pathlib.Path) -> float:
        try:
            return time.time() - path.stat().st_mtime
        except OSError:  # removed meanwhile (another run's worker)
            return 0.0

    logs = sorted(folder.glob("*.log"), key=age)
    stale = [p for p in folder.glob("*.pt") if age(p) > 86400]
    for path in [*logs[_KEEP_LOGS:], *stale]:
        with contextlib.suppress(OSError):
            path.unlink()


def _stop(running: dict[Any, subprocess.Popen[bytes]]) -> None:
    for proc in running.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in running.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    running.clear()
