"""Compile the next rung in the background, so a growth only loads.

When a cap's fill passes a threshold, :class:`Background` starts a worker
process (``python -m ddpad._worker SPEC``, :mod:`._worker`) that rebuilds
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

__all__ = ["Background"]

log = logging.getLogger("ddpad")

_Target = tuple[tuple[str, int], ...]


class _Owner(Protocol):
    """What a background compile reads of the model it serves."""

    cap_state: dict[str, int]
    model: torch.nn.Module
    adapter: Any


class Background:
    """The background compiles of one :class:`~ddpad.PaddedModel`."""

    def __init__(self, owner: _Owner, ladder: Ladder, store_root: pathlib.Path, threshold: float, workers: int,
                 compile_kwargs: Mapping[str, Any], sizer: TightCaps | None = None) -> None:
        self.ladder = ladder
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
        # stop the workers when the model goes away or the interpreter exits
        self._finalizer = weakref.finalize(owner, _stop, self.running)

    def after_call(self, owner: _Owner, data: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   resolved: list[CapResolution]) -> None:
        """Reap finished workers; start workers for caps whose fill passed the threshold."""
        for target, proc in list(self.running.items()):
            if proc.poll() is not None:
                del self.running[target]
                log_path = self.logs.pop(target)
                if proc.returncode == 0:  # its log said nothing anyone needs
                    with contextlib.suppress(OSError):
                        log_path.unlink()
                else:
                    log.warning("a background compile for caps %s failed (exit %s); see %s",
                                dict(target), proc.returncode, log_path)
        if self.sizer is not None and not self.sizer.settled:
            return  # rungs above caps about to be fitted would never be reached
        current = tuple(sorted(owner.cap_state.items()))
        for r in resolved:
            if self.disabled:  # (a start that failed turns them off: said once)
                return
            if r.cap == 0 or r.need / r.cap < self.threshold or len(self.running) >= self.workers:
                continue
            # the next rung (every key but systems one bucket up: the growth
            # takes it) when r grows in it, else r alone one bucket up
            rungs = ladder(owner.cap_state, resolved, 1, self.sizer)
            grows = bool(rungs) and rungs[0][r.key] > owner.cap_state[r.key]
            target = tuple(sorted((rungs[0] if grows else next_caps(owner.cap_state, r, self.sizer)).items()))
            if target in self.targets or target == current:
                continue
            self._start(owner, target, data, args, kwargs)

    def _start(self, owner: _Owner, target: _Target, data: Any, args: tuple[Any, ...],
               kwargs: Mapping[str, Any]) -> None:
        from ddpad import adapters

        adapter: Any = owner.adapter.name
        with contextlib.suppress(Exception):
            if adapters.get(adapter) is not owner.adapter:
                adapter = owner.adapter
        spec = self.folder / f"{uuid.uuid4().hex}.pt"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _prune(self.folder)
            torch.save({
                "model": owner.model, "adapter": adapter, "caps": dict(target), "store": str(self.store_root),
                "compile_kwargs": self.compile_kwargs, "data": data, "args": args, "kwargs": dict(kwargs),
            }, spec)
            log_file = open(spec.with_suffix(".log"), "wb")  # noqa: SIM115 - the child owns it
        except OSError as exc:  # a read-only or full store
            self._off(spec, f"the store cannot be written ({type(exc).__name__}: {exc})")
            return
        except Exception as exc:  # noqa: BLE001 - a model that does not pickle
            self._off(spec, f"the model cannot be pickled for a worker ({type(exc).__name__}: {exc})")
            return
        try:
            proc = subprocess.Popen([sys.executable, "-m", "ddpad._worker", str(spec), str(os.getpid())],
                                    stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log_file.close()
        self.running[target] = proc
        self.logs[target] = spec.with_suffix(".log")
        self.targets.add(target)
        self.ladder.add(dict(target), "background")  # the growth takes these caps if they fit
        log.info("compiling caps %s in the background (pid %d)", dict(target), proc.pid)

    def _off(self, spec: pathlib.Path, reason: str) -> None:
        """No background compiles for this model from now on (one warning)."""
        with contextlib.suppress(OSError):
            spec.unlink()
        log.warning("background compiles are off for this model: %s; growths compile in the foreground", reason)
        self.disabled = True

    def close(self) -> None:
        """Stop running workers; count the compiles no growth reached."""
        self._finalizer()
        self.ladder.close_background()


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
