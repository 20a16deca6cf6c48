"""Compile the next bucket in the background, so a growth only loads.

When a cap's fill passes a threshold, :class:`Background` starts a worker
process (``python -m ddpad._background SPEC``) that rebuilds the padded
model with that cap grown to its next bucket, calls it once on the last
input and so writes the compiled graphs into the compile store. When the
growth comes, the step finds the entry (or waits on its lock for the worker,
which has a head start) and loads. A process, not a thread: Dynamo and
Inductor are not safe to run beside a compiling or running model in one
interpreter, and a process cannot corrupt the run's state.

Workers are bounded (``background_workers``), stopped by
:meth:`Background.close` (``PaddedModel.close``, its ``with`` block, its
garbage collection or interpreter exit), and each one exits by itself when
its parent process is gone: no orphans.
"""

from __future__ import annotations

import contextlib
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


def next_caps(caps: Mapping[str, int], r: CapResolution) -> dict[str, int]:
    """``caps`` with ``r.key`` at the bucket its first overflow would grow it to."""
    policy = r.policy
    overflow = r.cap + 1 if policy.strict_gt else r.cap
    grown = max(policy.stride, bucket(overflow, policy.grow_factor, policy.stride))
    if policy.max_cap is not None:
        grown = min(grown, policy.max_cap)
    return {**caps, r.key: grown}


def ladder(caps: Mapping[str, int], resolved: list[CapResolution], rungs: int) -> list[dict[str, int]]:
    """The next ``rungs`` caps of a growing system: each rung one bucket up in
    every count that grows with it (atoms, edges, a dense padder's neighbour
    columns: every key but ``systems``, the number of systems, which a
    growing system keeps), the other keys as they are.

    A growth takes the smallest rung that fits all its needs (see
    ``PaddedModel``), so the rungs serve whichever key overflows first and
    however fast the edges grow against the atoms. Built from caps and needs
    only (agreed ones under an agreement group)."""
    scaled = [r for r in resolved if r.key != "systems" and r.need > 0]
    current, out = dict(caps), []
    for _ in range(rungs if scaled else 0):
        for r in scaled:
            current = next_caps(current, dataclasses.replace(r, cap=current[r.key]))
        if current == (out[-1] if out else caps):  # every scaling key at its ceiling
            break
        out.append(dict(current))
    return out


class Background:
    """The background compiles of one :class:`~ddpad.PaddedModel`."""

    def __init__(self, owner: PaddedModel, threshold: float, workers: int, compile_kwargs: Mapping[str, Any]) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"ddpad: background_compile is a fill threshold in (0, 1], got {threshold!r}")
        if workers < 1:
            raise ValueError(f"ddpad: background_workers must be >= 1, got {workers!r}")
        assert owner.store is not None and owner.adapter is not None
        self.threshold = threshold
        self.workers = workers
        self.compile_kwargs = dict(compile_kwargs)
        self.stats = owner.stats
        self.folder = owner.store.store.root / "background"
        self.running: dict[tuple[tuple[str, int], ...], subprocess.Popen[bytes]] = {}
        self.targets: set[tuple[tuple[str, int], ...]] = set()  # caps compiled for, started
        self.reached: set[tuple[tuple[str, int], ...]] = set()
        self.disabled = False
        # stop the workers when the model goes away or the interpreter exits
        self._finalizer = weakref.finalize(owner, _stop, self.running)

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
        current = tuple(sorted(owner.cap_state.items()))
        if current in self.targets and current not in self.reached:
            self.reached.add(current)
            self.stats.background_used += 1
        if self.disabled:
            return
        for r in resolved:
            if r.cap == 0 or r.need / r.cap < self.threshold or len(self.running) >= self.workers:
                continue
            # the next rung (every key but systems one bucket up: the growth
            # takes it) when r grows in it, else r alone one bucket up
            rungs = ladder(owner.cap_state, resolved, 1)
            grows = bool(rungs) and rungs[0][r.key] > owner.cap_state[r.key]
            target = tuple(sorted((rungs[0] if grows else next_caps(owner.cap_state, r)).items()))
            if target in self.targets or target == current:
                continue
            self._start(owner, target, data, args, kwargs)

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
        owner.rungs.append(dict(target))  # the growth takes these caps if they fit
        self.stats.background_started += 1
        log.info("compiling caps %s in the background (pid %d)", dict(target), proc.pid)

    def close(self) -> None:
        """Stop running workers; count the compiles no growth reached."""
        self._finalizer()
        self.stats.background_wasted = len(self.targets - self.reached)


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
