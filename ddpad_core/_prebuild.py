"""``ddpad precompile --aot``: the packages of a system's caps and of the
ladder's next rungs, built side by side in worker processes.

An AOTInductor build is CPU-bound and independent per rung, so each rung is
its own worker (:func:`~._background.write_spec` / ``python -m
ddpad._worker``), as many at once as asked; nothing is traced or compiled in
this process. A later run with ``warm_ladder`` loads every rung's package
at its first call (each checked once against the eager step there), so a
growth into any of them costs no trace, no compile and no load.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._background import PackageBuilds
from ._capacity import TightPolicy
from ._store import CompileStore
from ._warm import warm_rungs

__all__ = ["Prebuilt", "prebuild_packages"]


@dataclass
class Prebuilt:
    """What :func:`prebuild_packages` built: the run's caps (fitted under a
    tight policy), the rungs, how long it took and which builds failed."""

    caps: dict[str, int]
    rungs: list[dict[str, int]]
    seconds: float
    failed: dict[str, str]  # caps (as text) -> why
    sizing: Any  # the uncompiled PaddedModel that sized the caps (its save_caps writes them for a run)

    @property
    def fitted(self) -> bool:
        """Whether a tight sizing fitted the caps (a run from them keeps them)."""
        return self.sizing.sizer is not None and self.sizing.sizer.settled


def prebuild_packages(model: torch.nn.Module, adapter: Any, data: Any, *, store: str | os.PathLike[str] | CompileStore,
                      rungs: int = 2, workers: int | None = None, caps: Mapping[str, int] | None = None,
                      tight: bool = True, call_kwargs: Mapping[str, Any] | None = None,
                      compile_kwargs: Mapping[str, Any] | None = None, timeout: float | None = None) -> Prebuilt:
    """Build the packages of ``data``'s caps and of the next ``rungs`` rungs
    into ``store``, ``workers`` (default: one per CPU, at most one per
    package) at once.

    Parameters
    ----------
    model, adapter
        The model (prepared or not: it is wrapped here) and its adapter.
    data
        One input at the caps the run starts from.
    caps
        Preset caps (kept); else the padders' (``tight``: fitted to ``data``
        as ``ddpad precompile`` does, so the run that reads them starts there).
    timeout
        Seconds to wait for the builds (None: until they end); builds still
        running then are stopped and reported as failed.
    """
    from ._wrap import wrap

    root = store.root if isinstance(store, CompileStore) else pathlib.Path(store).expanduser()
    t0 = time.perf_counter()
    policy: Any = TightPolicy(settle=1) if tight else "headroom"
    sizing = wrap(model, adapter, compile=False, caps=caps, cap_policy=policy)
    kwargs = dict(call_kwargs or {})
    sizing(data, **kwargs)  # sizes (and fits) the caps on one eager call
    ladder = warm_rungs(sizing.cap_state, sizing.last_resolutions, rungs, sizing.max_caps, sizing.sizer)
    targets = [dict(sizing.cap_state), *ladder]
    count = workers if workers is not None else min(len(targets), os.cpu_count() or 1)
    builds = PackageBuilds(sizing, root, max(1, count), dict(compile_kwargs or {}), sizing.stats)
    names = [repr(sorted(target.items())) for target in targets]
    try:
        for name, target in zip(names, targets):
            builds.status(name, sizing, target, data, (), kwargs)
        left = builds.wait(timeout)
    finally:
        builds.close()
    failed = {name: why for name, why in builds.finished.items() if why}
    if left:
        failed.update({name: f"still building after {timeout} s: stopped" for name in names
                       if name not in builds.finished})
    return Prebuilt(dict(sizing.cap_state), ladder, time.perf_counter() - t0, failed, sizing)
