"""Compile the next bucket in the background, so a growth only loads.

When a cap's fill passes a threshold, :class:`Background` starts a worker
process (``python -m ddpad._background SPEC``) that rebuilds the padded
model with that cap grown to its next bucket, calls it once on the last
input and so writes the compiled graphs into the compile store. When the
growth comes, the step finds the entry (or waits on its lock for the worker,
which has a head start) and loads. A process is the default: it cannot
touch the run's state, but the growing step still traces the model and
loads the graph (seconds).

``mode="thread"`` warms the next bucket in the run's own interpreter
instead: a thread calls the run's compiled model once at the next caps (on
its own copy of the padder and of the last input), so Dynamo's cache already
holds the graph when the growth comes and the step neither traces nor
loads. Why Dynamo is safe for it: it converts frames under one process-wide
lock (``torch._dynamo.convert_frame.compile_lock``), so the thread's compile
and a recompile of the main thread are serialised; the callback that sends
frames to Dynamo, its tracing state and ddpad's cap contexts are per-thread;
a call of an already compiled graph takes no lock, and a graph enters the
code object's cache only when complete. What ddpad adds: the adapter's
Dynamo flags (a process-wide setting) are held from the thread's start until
the main thread sees it finished, not set and restored around each step,
which would pull them from under the thread's trace; the thread's compiles
are counted as graphs but never as a call's recompile (strict mode); and no
thread starts under an agreement group (the model may hold collectives,
which must not run outside the ranks' lockstep). The tests compare a
thread-warmed growth with a foreground one and run steps during the
thread's compile in strict mode.

Workers are bounded (``background_workers``), stopped by
:meth:`Background.close` (``PaddedModel.close``, its ``with`` block, its
garbage collection or interpreter exit), and each one exits by itself when
its parent process is gone: no orphans. A thread cannot be stopped mid-trace;
it is a daemon, and ``close`` waits for it at most ``join_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._capacity import CapResolution, bucket

if TYPE_CHECKING:
    from ._runtime import PaddedModel

log = logging.getLogger("ddpad")

# set in a warming thread: its compiles are this model's graphs, not a call's recompiles
WARMING: contextvars.ContextVar[bool] = contextvars.ContextVar("ddpad_warming", default=False)
MODES = ("process", "thread")


def next_caps(caps: Mapping[str, int], r: CapResolution) -> dict[str, int]:
    """``caps`` with ``r.key`` at the bucket its first overflow would grow it to."""
    policy = r.policy
    overflow = r.cap + 1 if policy.strict_gt else r.cap
    grown = max(policy.stride, bucket(overflow, policy.grow_factor, policy.stride))
    if policy.max_cap is not None:
        grown = min(grown, policy.max_cap)
    return {**caps, r.key: grown}


def ladder(caps: Mapping[str, int], resolved: list[CapResolution], rungs: int) -> list[dict[str, int]]:
    """The next ``rungs`` caps a uniformly growing system reaches, one growth
    each: every count that scales with the atoms (keys whose real count is at
    least the ``atoms`` key's; ``systems`` does not) grows in proportion, and
    the key that overflows first grows to its next bucket."""
    atoms = next((r.real for r in resolved if r.key == "atoms"), 0)
    scaled = [r for r in resolved if r.real >= atoms and r.need > 0]
    current, out = dict(caps), []
    for _ in range(rungs if scaled else 0):
        # the system growth factor at which each key overflows; the first grows
        first = min(scaled, key=lambda r, c=current: (c[r.key] + (1 if r.policy.strict_gt else 0)) / r.need)
        current = next_caps(current, dataclasses.replace(first, cap=current[first.key]))
        out.append(dict(current))
    return out


class Background:
    """The background compiles of one :class:`~ddpad.PaddedModel`."""

    join_timeout = 60.0

    def __init__(self, owner: PaddedModel, threshold: float, workers: int, compile_kwargs: Mapping[str, Any],
                 mode: str = "process") -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"ddpad: background_compile is a fill threshold in (0, 1], got {threshold!r}")
        if workers < 1:
            raise ValueError(f"ddpad: background_workers must be >= 1, got {workers!r}")
        if mode not in MODES:
            raise ValueError(f"ddpad: background_mode must be one of {MODES}, got {mode!r}")
        if mode == "process" and (owner.store is None or owner.adapter is None):
            raise ValueError("ddpad: background_compile in worker processes needs compile_cache= and an adapter "
                             "(the workers compile into the store and rebuild the padder from the adapter); "
                             "background_mode='thread' needs neither")
        self.threshold = threshold
        self.workers = workers
        self.mode = mode
        self.compile_kwargs = dict(compile_kwargs)
        self.stats = owner.stats
        self.folder = owner.store.store.root / "background" if owner.store is not None else None
        self.running: dict[tuple[tuple[str, int], ...], subprocess.Popen[bytes]] = {}
        self.threads: dict[tuple[tuple[str, int], ...], threading.Thread] = {}
        self.failed: dict[tuple[tuple[str, int], ...], str] = {}  # a thread's exception
        self._flags: contextlib.ExitStack | None = None  # the Dynamo flags held while threads run
        # the caps a finished thread warmed: a growth that fits them takes them
        # (its own bucket, sized from the need at the overflowing step, is
        # often a stride or two off the predicted one)
        self.ready: dict[str, int] | None = None
        self.targets: set[tuple[tuple[str, int], ...]] = set()  # caps compiled for, started
        self.reached: set[tuple[tuple[str, int], ...]] = set()
        self.disabled = False
        # stop the workers (and release held Dynamo flags) when the model goes
        # away or the interpreter exits
        self._finalizer = weakref.finalize(owner, self._shutdown)

    def after_call(self, owner: PaddedModel, data: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   resolved: list[CapResolution]) -> None:
        """Count a growth a worker prepared; start workers for caps whose
        fill passed the threshold."""
        for target, proc in list(self.running.items()):
            if proc.poll() is not None:
                del self.running[target]
                if proc.returncode != 0:
                    log.warning("a background compile for caps %s failed (exit %s); see %s",
                                dict(target), proc.returncode, self.folder)
        self._reap_threads()
        current = tuple(sorted(owner.cap_state.items()))
        if current in self.targets and current not in self.reached:
            self.reached.add(current)
            self.stats.background_used += 1
            if self.ready is not None and tuple(sorted(self.ready.items())) == current:
                self.ready = None
        if self.disabled:
            return
        for r in resolved:
            if r.cap == 0 or r.need / r.cap < self.threshold or len(self.running) + len(self.threads) >= self.workers:
                continue
            # the caps of the next growth: the key that a uniformly growing
            # system overflows first (not necessarily this one) one bucket up
            rungs = ladder(owner.cap_state, resolved, 1)
            target = tuple(sorted((rungs[0] if rungs else next_caps(owner.cap_state, r)).items()))
            if target in self.targets or target == current:
                continue
            if self.mode == "thread":
                self._start_thread(owner, target, data, args, kwargs)
            else:
                self._start(owner, target, data, args, kwargs)

    # -- threads ------------------------------------------------------------------

    def _start_thread(self, owner: PaddedModel, target: tuple[tuple[str, int], ...], data: Any,
                      args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        from ._capacity import current_agreement

        if current_agreement() is not None:
            log.warning("background compiles in a thread are off under an agreement group (the model may hold "
                        "collectives); growths compile in the foreground")
            self.disabled = True
            return
        if self._flags is None and owner.dynamo_config:
            self._flags = contextlib.ExitStack()
            self._flags.enter_context(torch._dynamo.config.patch(**owner.dynamo_config))
        # its own padder and input: the run's buffers and tensors change under it
        padder = copy.deepcopy(owner.padder)
        snapshot = _detached(data)
        grad = torch.is_grad_enabled()  # per thread, and Dynamo guards on it
        thread = threading.Thread(target=self._warm, args=(owner, padder, dict(target), target, snapshot, args,
                                                           dict(kwargs), grad),
                                  name=f"ddpad-warm-{len(self.targets)}", daemon=True)
        self.threads[target] = thread
        self.targets.add(target)
        self.stats.background_started += 1
        log.info("compiling caps %s in a background thread", dict(target))
        thread.start()

    def _warm(self, owner: PaddedModel, padder: Any, caps: dict[str, int], target: tuple[tuple[str, int], ...],
              data: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grad: bool) -> None:
        from ._runtime import _run_step

        WARMING.set(True)  # a new thread's own context
        try:
            with torch.set_grad_enabled(grad):
                if owner.pad_in_forward:
                    from ._context import activate_dd_context

                    with activate_dd_context(owner._context(dict(caps), padder)):
                        _run_step(owner.compiled, owner.call, {}, data, args, kwargs)
                else:
                    _run_step(owner.compiled, owner.call, {}, padder.pad_to(data, caps), args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported on the main thread; the growth compiles there
            self.failed[target] = f"{type(exc).__name__}: {exc}"

    def _reap_threads(self) -> None:
        """On the main thread: forget finished threads, report failures, and
        release the Dynamo flags once none runs."""
        for target, thread in list(self.threads.items()):
            if not thread.is_alive():
                del self.threads[target]
                if target in self.failed:
                    log.warning("a background compile for caps %s failed in its thread (%s); the growth will "
                                "compile in the foreground", dict(target), self.failed.pop(target))
                elif target not in self.reached:
                    self.ready = dict(target)
        if not self.threads and self._flags is not None:
            self._flags.close()
            self._flags = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the running background compiles (threads or processes);
        True when none is left. For tests and benchmarks: a run never needs to."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self.threads.values()):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for proc in list(self.running.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._reap_threads()
        return not self.threads and all(p.poll() is not None for p in self.running.values())

    def _start(self, owner: PaddedModel, target: tuple[tuple[str, int], ...], data: Any,
               args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        assert owner.store is not None and owner.adapter is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        spec = self.folder / f"{uuid.uuid4().hex}.pt"
        from ddpad import adapters

        adapter: Any = owner.adapter.name
        with contextlib.suppress(Exception):
            if adapters.get(adapter) is not owner.adapter:
                adapter = owner.adapter
        try:
            torch.save({
                "model": owner.model, "adapter": adapter, "caps": dict(target), "store": str(owner.store.store.root),
                "compile_kwargs": self.compile_kwargs, "data": data, "args": args, "kwargs": dict(kwargs),
            }, spec)
        except Exception as exc:  # noqa: BLE001 - a model that does not pickle: no background compiles
            with contextlib.suppress(OSError):
                spec.unlink()
            log.warning("background compiles are off for this model: it cannot be pickled for a worker "
                        "(%s: %s); growths compile in the foreground", type(exc).__name__, exc)
            self.disabled = True
            return
        log_file = open(spec.with_suffix(".log"), "wb")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen([sys.executable, "-m", "ddpad._background", str(spec), str(os.getpid())],
                                    stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log_file.close()
        self.running[target] = proc
        self.targets.add(target)
        self.stats.background_started += 1
        log.info("compiling caps %s in the background (pid %d)", dict(target), proc.pid)

    def close(self) -> None:
        """Stop running workers (a thread cannot be stopped mid-trace: waited
        for at most ``join_timeout`` s, then left to finish as a daemon);
        count the compiles no growth reached."""
        for target, thread in list(self.threads.items()):
            thread.join(self.join_timeout)
            if thread.is_alive():
                log.warning("a background compile for caps %s is still running in its thread after %.0f s; "
                            "left to finish", dict(target), self.join_timeout)
        self._finalizer()
        self.stats.background_wasted = len(self.targets - self.reached)

    def _shutdown(self) -> None:
        _stop(self.running)
        self._reap_threads()
        if self._flags is not None:  # a thread still running at exit: its flags go with it
            self._flags.close()
            self._flags = None


def _detached(data: Any) -> Any:
    """A copy of a call's input (tensors cloned and detached, containers rebuilt)."""
    if isinstance(data, torch.Tensor):
        return data.detach().clone()
    if isinstance(data, Mapping):
        return {k: _detached(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_detached(v) for v in data) if not hasattr(data, "_fields") else data
    return copy.copy(data)


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


def _exit_with_parent(parent: int) -> None:
    """A worker whose parent died (killed, crashed) stops too."""
    while True:
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)


def main(spec_path: str, parent: int) -> int:
    """The worker: rebuild the padded model at the target caps, call it once
    (compiling into the store), exit."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    path = pathlib.Path(spec_path)
    try:
        spec = torch.load(path, weights_only=False)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    from ._runtime import padded_model, resolve_adapter

    adapter = resolve_adapter(spec["adapter"])
    model = padded_model(spec["model"], adapter, caps=spec["caps"], compile_cache=spec["store"],
                         on_recompile="ignore", **spec["compile_kwargs"])
    t0 = time.perf_counter()
    model(spec["data"], *spec["args"], **spec["kwargs"])
    print(f"ddpad background compile: caps {spec['caps']} in {time.perf_counter() - t0:.1f} s "
          f"({model.stats.graphs_compiled} compiled, {model.stats.graphs_loaded} loaded)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
