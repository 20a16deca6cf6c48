"""A background compile's worker process: ``python -m ddpad._worker SPEC PARENT``.

Rebuilds the padded model at the target caps from the spec
:func:`~._background.write_spec` wrote, calls it once (compiling into the
compile store, or under ``compile_mode="aot"`` building the package) and
exits; it stops by itself when its parent is gone.

The model arrives pickled, and unpickling is not always the way back to the
model the run holds (e3nn regenerates its code-generated modules as
TorchScript, which mace had prepared without): a prepared model is sent as
the model it was prepared from and its weights, the worker prepares it again
as :func:`~ddpad.wrap` did, and it refuses to build under a store key other
than the one the run looks under.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import torch


def _exit_with_parent(parent: int) -> None:
    """A worker whose parent died (killed, crashed) stops too: SIGTERM first
    (its ``finally`` blocks release the store's locks), SIGKILL if it lingers."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os.kill(os.getpid(), signal.SIGKILL)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: locks released, lock files removed


def _prepared(spec: dict[str, Any], adapter: Any) -> torch.nn.Module:
    """The model the run holds: sent as it is, or prepared here from the model
    it was prepared from, with the run's weights loaded
    (:func:`~._background.write_spec`)."""
    if "source" not in spec:
        return spec["model"]
    model = adapter.prepare_model(spec["source"])
    model.load_state_dict(spec["state"])
    return model


def main(spec_path: str, parent: int) -> int:
    """The worker: rebuild the padded model at the target caps, call it once
    (compiling into the store), exit."""
    signal.signal(signal.SIGTERM, _terminated)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    path = pathlib.Path(spec_path)
    try:
        spec = torch.load(path, weights_only=False)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    from ._registry import resolve_adapter
    from ._wrap import padded_model

    adapter = resolve_adapter(spec["adapter"])
    # (unchecked here: the run checks what it loads on its first use, as it checks all it compiles)
    options = {"on_recompile": "ignore", "verify": False, **spec.get("options", {})}
    model = padded_model(_prepared(spec, adapter), adapter, caps=spec["caps"], compile_cache=spec["store"],
                         **options, compile_kwargs=spec["compile_kwargs"])
    expected = spec.get("expect")
    key = model.manager.store_key
    if expected is not None and key != expected:
        print(f"ddpad background worker: the model rebuilt here has store key {key}, the run's is {expected}: "
              f"what it built would land where the run does not look (each key's model.json in {spec['store']} "
              "says what it was made of); nothing built", flush=True)
        return 4
    t0 = time.perf_counter()
    model(spec["data"], *spec["args"], **spec["kwargs"])
    s = model.stats
    if model.caps != spec["caps"]:  # (the input outgrew the caps it was sent for: nothing to build)
        print(f"ddpad background worker: the input needs caps {model.caps}, not {spec['caps']}", flush=True)
        return 3
    if s.aot_refused:
        print(f"ddpad background worker: caps {spec['caps']}: the ahead-of-time route refused the step "
              f"({'; '.join(model.manager.refused.values())})", flush=True)
        return 2
    print(f"ddpad background compile: caps {spec['caps']} in {time.perf_counter() - t0:.1f} s "
          f"({s.graphs_compiled} compiled, {s.graphs_loaded} loaded, {s.aot_compiled} package(s) built, "
          f"{s.aot_loaded} loaded)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
