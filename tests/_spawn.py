"""Run a function on N gloo ranks in real processes, with a hard timeout."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, out_dir: pathlib.Path, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Spawn ``world`` processes running ``fn(rank, world, *args)``; return their
    JSON results in rank order. A hang past ``timeout`` kills them and fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), str(out_dir), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout:.0f} s (a collective hung?)")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    return [json.loads(pathlib.Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
