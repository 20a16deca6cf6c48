"""A persistent compile store: compile a model at a set of caps once, ever.

What compiling produced is kept with torch's own portable cache artifacts
(``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``: the
Inductor FX-graph and AOTAutograd cache entries of a graph). ddpad keys them
by what changes the compiled code and hands them to a fresh process (a
restart, the next job, another rank, a background worker) before Inductor
would compile the same graph, so Inductor loads instead of compiling.

Why these artifacts and not the precompile API (``torch._dynamo.aot_compile``
/ ``torch.compiler.load_compiled_function``): they work for every adapter,
graph breaks and lazily compiled backwards included, and a stale or foreign
entry cannot give a wrong graph: torch checks its own cache keys (the traced
graph, its constants, shapes and config) on every lookup, so an entry that
does not fit is a cache miss and a normal compile. The price is that Dynamo
still traces the model in each new process (the time a warm start still
takes; ``docs/pages/compile-store.md`` has the numbers).

Layout: ``ROOT/<model key>/model.json`` (what the key was made of) and one
``<graph key>.bin`` per compiled graph, where the graph key hashes the
traced graph's code and its example inputs' shapes, strides and dtypes: two
processes that trace the same model at the same caps name the same entry.
Entries are written atomically (a temporary file, fsync, rename) and carry
a SHA-256 of their payload; a lock file per entry lets one process compile
while the others wait for it (bounded) and load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CompileStore", "default_store_dir", "model_fingerprint"]

log = logging.getLogger("ddpad")

_MAGIC = b"ddpad-compile/1\n"
_PLAIN = (bool, int, float, str, type(None))


def default_store_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/ddpad/compile`` (``~/.cache/ddpad/compile``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ddpad" / "compile"


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, list)) and len(value) <= 64 and all(isinstance(v, _PLAIN) for v in value)


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """The architecture of ``model`` without its weight values: every
    submodule's class and plain (scalar, string, short tuple) attributes -
    the hyper-parameters Dynamo may bake into the graph - and every
    parameter's and buffer's name, shape, dtype, device type and
    ``requires_grad``."""
    modules = []
    for name, module in model.named_modules():
        attrs = {k: v for k, v in sorted(vars(module).items()) if not k.startswith("_") and _plain(v)}
        modules.append([name, f"{type(module).__module__}.{type(module).__qualname__}", attrs])
    tensors = [
        [name, list(t.shape), str(t.dtype), t.device.type, bool(t.requires_grad)]
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]
    return {"modules": modules, "tensors": tensors}


def _device_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    tensor = next(iter([*model.parameters(), *model.buffers()]), None)
    device = tensor.device if tensor is not None else torch.device("cpu")
    info: dict[str, Any] = {"type": device.type, "machine": platform.machine()}
    if device.type == "cuda":
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["name"] = torch.cuda.get_device_name(device)
    return info


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=repr).encode()).hexdigest()


def _graph_key(model_key: str, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str:
    """Names a traced graph: its code and its inputs' metadata (the same
    model traced at the same caps gives the same key in any process)."""
    inputs = [
        ["tensor", list(x.shape), list(x.stride()), str(x.dtype), x.device.type, bool(x.requires_grad)]
        if isinstance(x, torch.Tensor) else [type(x).__name__, repr(x)]
        for x in example_inputs
    ]
    return _digest([model_key, gm.code, inputs])[:32]


@dataclasses.dataclass
class CompileStore:
    """A directory of compiled graphs shared by processes and ranks.

    Parameters
    ----------
    root
        The store's directory (created on first write). Share one directory
        between ranks (a shared file system) or jobs.
    wait_timeout
        Seconds a process waits for another that is compiling the same graph
        before compiling it itself (never forever).
    """

    root: pathlib.Path
    wait_timeout: float = 1800.0

    def __post_init__(self) -> None:
        self.root = pathlib.Path(self.root).expanduser()

    # -- keys -------------------------------------------------------------------

    def model_key(self, model: torch.nn.Module, **environment: Any) -> str:
        """The key of everything that changes ``model``'s compiled code, and
        ``model.json`` beside its entries saying what it was made of."""
        from ddpad import __version__

        doc = {
            "model": model_fingerprint(model),
            "device": _device_fingerprint(model),
            "torch": torch.__version__,
            "ddpad": __version__,
            "python": sys.version.split()[0],
            **environment,
        }
        key = _digest(doc)[:32]
        folder = self.root / key
        if not (folder / "model.json").exists():
            with contextlib.suppress(OSError):
                folder.mkdir(parents=True, exist_ok=True)
                _atomic_write(folder / "model.json", json.dumps(doc, indent=1, sort_keys=True, default=repr).encode())
        return key

    def entry(self, model_key: str, graph_key: str) -> pathlib.Path:
        """The file of one compiled graph."""
        return self.root / model_key / f"{graph_key}.bin"

    # -- entries ----------------------------------------------------------------

    def read(self, path: pathlib.Path) -> bytes | None:
        """An entry's artifacts, or ``None`` when it is missing; a corrupt or
        foreign entry is logged and moved aside (``.corrupt``), never used."""
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read compile-store entry %s (%s); compiling", path, exc)
            return None
        try:
            if not blob.startswith(_MAGIC):
                raise ValueError("not a ddpad compile-store entry")
            header_end = blob.index(b"\n", len(_MAGIC))
            header = json.loads(blob[len(_MAGIC):header_end])
            payload = blob[header_end + 1:]
            if len(payload) != header["size"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
                raise ValueError("payload does not match its checksum (truncated or altered)")
            if header.get("torch") != torch.__version__:
                raise ValueError(f"written by torch {header.get('torch')}, this is {torch.__version__}")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("compile-store entry %s is unusable (%s); moved aside, compiling", path, exc)
            with contextlib.suppress(OSError):
                os.replace(path, path.with_suffix(".corrupt"))
            return None
        return payload

    def write(self, path: pathlib.Path, payload: bytes) -> None:
        """Write an entry atomically (concurrent writers never leave a mix)."""
        header = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                  "torch": torch.__version__, "written": time.time()}
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, _MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)

    def load(self, path: pathlib.Path) -> bool:
        """Hand an entry's artifacts to torch's caches; True when it was there."""
        payload = self.read(path)
        if payload is None:
            return False
        try:
            torch.compiler.load_cache_artifacts(payload)
        except Exception as exc:  # noqa: BLE001 - a bad entry must never stop a run
            log.warning("torch could not load compile-store entry %s (%s); compiling", path, exc)
            return False
        return True

    @contextlib.contextmanager
    def lock(self, path: pathlib.Path) -> Iterator[bool]:
        """Hold the entry's lock file while compiling it. Yields True when
        this process should compile, False when it waited for another
        process that has written the entry meanwhile (load it). Waits at most
        ``wait_timeout`` seconds, then compiles anyway (logged): never hangs."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        locked = waited = False
        try:
            deadline = time.monotonic() + self.wait_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except BlockingIOError:
                    pass
                if time.monotonic() >= deadline:
                    log.warning("waited %.0f s for another process compiling %s; compiling here",
                                self.wait_timeout, path.name)
                    break
                waited = True
                time.sleep(0.05)
            yield not (waited and path.exists())
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _atomic_write(path: str | os.PathLike[str], data: bytes, prefix: str | None = None) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it
    (``prefix``), fsync, rename; readers and concurrent writers never see a
    partial file, and a failed write leaves the old one."""
    path = pathlib.Path(os.path.abspath(os.fspath(path)))
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

