"""A background compile's worker process: ``python -m ddpad._worker SPEC PARENT``.

Rebuilds the padded model at the target caps from the spec
:func:`~._background.write_spec` wrote, calls it once (compiling into the
compile store, or under ``compile_mode="aot"`` building the package) and
exits; it stops by itself when its parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import threading
import time

import torch


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
    from ._wrap import padded_model, resolve_adapter

    adapter = resolve_adapter(spec["adapter"])
    options = {"on_recompile": "ignore", **spec.get("options", {})}
    model = padded_model(spec["model"], adapter, caps=spec["caps"], compile_cache=spec["store"], **options,
                         **spec["compile_kwargs"])
    t0 = time.perf_counter()
    model(spec["data"], *spec["args"], **spec["kwargs"])
    s = model.stats
    if model.caps != spec["caps"]:  # (the input outgrew the caps it was sent for: nothing to build)
        print(f"ddpad background worker: the input needs caps {model.caps}, not {spec['caps']}", flush=True)
        return 3
    if s.aot_refused:
        print(f"ddpad background worker: caps {spec['caps']}: the ahead-of-time route refused the step "
              f"({'; '.join(model.aot.refused.values()) if model.aot else ''})", flush=True)
        return 2
    print(f"ddpad background compile: caps {spec['caps']} in {time.perf_counter() - t0:.1f} s "
          f"({s.graphs_compiled} compiled, {s.graphs_loaded} loaded, {s.aot_compiled} package(s) built, "
          f"{s.aot_loaded} loaded)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
