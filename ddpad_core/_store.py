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
while the others wait for it (bounded) and load. The lock file names its
holder (pid, host, start) and the holder touches it every ``heartbeat``
seconds: a waiter whose holder is dead, or silent for ``stale_after``
seconds (stopped, hung on a shared file system), compiles itself. A lock
file is removed when its holder is done, whether or not it wrote the
entry. An entry that cannot be used (corrupt, built for something else,
refused) is moved aside with its reason (:meth:`CompileStore.set_aside`). A
store that cannot be written (read-only, full) is one warning: the run
compiles without it and still reads what is there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import platform
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._fs import atomic_write, cache_dir
from ._store_contents import parse_size, prune
from ._version import __version__
from ._weights import plain

if TYPE_CHECKING:
    from ._adapter import Adapter

__all__ = ["CompileStore", "StoreBinding", "aot_binding", "bind_store", "default_store_dir", "model_fingerprint",
           "store_environment"]

log = logging.getLogger("ddpad")

_MAGIC = b"ddpad-compile/1\n"


def default_store_dir() -> pathlib.Path:
    """``compile`` in ddpad's user cache folder (``~/.cache/ddpad/compile``;
    see :func:`._fs.cache_dir`)."""
    return cache_dir() / "compile"


def process_setting() -> str:
    """This host and the process settings an entry's use may depend on
    (loading a package, a check's numerics): host, threads, CPU capability."""
    return (f"host {socket.gethostname()}, {torch.get_num_threads()} thread(s), "
            f"CPU {torch.backends.cpu.get_cpu_capability()}")


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """The architecture of ``model`` without its weight values: every
    submodule's class and plain (scalar, string, short tuple) attributes -
    the hyper-parameters Dynamo may bake into the graph - and every
    parameter's and buffer's name, shape, dtype, device type and
    ``requires_grad``."""
    modules = []
    for name, module in model.named_modules():
        attrs = {k: v for k, v in sorted(vars(module).items()) if not k.startswith("_") and plain(v)}
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


def package_versions(import_names: Sequence[str]) -> dict[str, str]:
    """``{distribution: version}`` of the installed distributions that provide
    each import name (``mace`` -> ``mace-torch``, ``allegro`` ->
    ``nequip-allegro``): what ``pip install`` changes, read through
    ``importlib.metadata.packages_distributions``. An import name no installed
    distribution provides is left out."""
    provided = importlib.metadata.packages_distributions()
    versions: dict[str, str] = {}
    for name in import_names:
        for dist in provided.get(name.split(".")[0], ()):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions[dist] = importlib.metadata.version(dist)
    return dict(sorted(versions.items()))


def store_environment(adapter: Adapter | None, dynamo_config: Mapping[str, Any],
                      compile_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What besides the model changes its compiled code: the adapter, the
    versions of the distributions behind its ``requires``, the backend, mode,
    options, ``dynamic`` and Dynamo flags. With :meth:`CompileStore.model_key`
    (architecture, device, torch, ddpad, Python) every key factor."""
    backend = compile_kwargs.get("backend", "inductor")
    return {
        "adapter": adapter.name if adapter is not None else None,
        "packages": package_versions(adapter.requires) if adapter is not None else {},
        "backend": backend if isinstance(backend, str) else f"{type(backend).__module__}.{type(backend).__qualname__}",
        "compile": {k: v for k, v in compile_kwargs.items() if k != "backend"},
        "dynamo_config": dict(dynamo_config),
    }


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
    stale_after
        Seconds without a heartbeat from the process holding an entry's lock
        after which a waiter stops waiting and compiles itself (a holder that
        is gone is noticed at once on the same host).
    heartbeat
        Seconds between the lock holder's heartbeats (``stale_after`` should
        be several of them).
    max_size
        A bound on the store's size (bytes, or ``"5G"``): after each write,
        the least recently used entries and packages are removed until it
        holds (``ddpad cache prune --max-size`` does it by hand). None: no
        bound.
    """

    root: pathlib.Path
    wait_timeout: float = 1800.0
    stale_after: float = 60.0
    heartbeat: float = 5.0
    max_size: int | str | None = None

    def __post_init__(self) -> None:
        self.root = pathlib.Path(self.root).expanduser()
        if isinstance(self.max_size, str):
            self.max_size = parse_size(self.max_size)
        self.writable = True  # False after a write failed: one warning, then no more writes
        self.lockable = True  # False where the filesystem has no flock: one warning, then no locks

    def _no_locks(self, exc: OSError) -> None:
        """``flock`` failed (NFS mounted ``nolock``, Lustre without ``flock``):
        warn once; this store's compiles then go on without the lock."""
        if self.lockable:
            self.lockable = False
            log.warning("ddpad: the compile store %s cannot lock its entries (%s); compiling without the lock "
                        "(two processes may compile one graph at once; each entry is written whole)", self.root,
                        exc)

    def _unwritable(self, what: str, exc: OSError) -> None:
        """A write failed: warn once, and write nothing more to this store."""
        if self.writable:
            self.writable = False
            log.warning("ddpad: the compile store %s cannot be written (%s: %s); compiling without saving, "
                        "reading what is there", self.root, what, exc)

    # -- keys -------------------------------------------------------------------

    def model_key(self, model: torch.nn.Module, **environment: Any) -> str:
        """The key of everything that changes ``model``'s compiled code, and
        ``model.json`` beside its entries saying what it was made of."""
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
                atomic_write(folder / "model.json", json.dumps(doc, indent=1, sort_keys=True, default=repr).encode())
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
            self.set_aside(path, "corrupt", str(exc))
            return None
        with contextlib.suppress(OSError):  # its last use (pruning keeps the recently used)
            os.utime(path)
        return payload

    def write(self, path: pathlib.Path, payload: bytes) -> bool:
        """Write an entry atomically (concurrent writers never leave a mix);
        False when the store cannot be written (warned once)."""
        if not self.writable:
            return False
        header = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
                  "torch": torch.__version__, "written": time.time()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, _MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
        except OSError as exc:
            self._unwritable(f"writing {path.name}", exc)
            return False
        if self.max_size is not None:
            prune(self.root, max_size=int(self.max_size))
        return True

    def load(self, path: pathlib.Path) -> bool:
        """Hand an entry's artifacts to torch's caches; True when it was there
        and torch took it. An entry torch rejects is corrupt: moved aside."""
        payload = self.read(path)
        if payload is None:
            return False
        torch_cache_log = logging.getLogger("torch.compiler._cache")
        level = torch_cache_log.level
        torch_cache_log.setLevel(logging.ERROR)  # its un-pickle traceback: reported below in one line
        try:
            loaded = torch.compiler.load_cache_artifacts(payload)
        except Exception as exc:  # noqa: BLE001 - a bad entry must never stop a run
            loaded, reason = None, f"{type(exc).__name__}: {exc}"
        else:
            reason = "torch could not un-pickle its artifacts"
        finally:
            torch_cache_log.setLevel(level)
        if loaded is None:
            self.set_aside(path, "corrupt", reason)
            return False
        return True

    def set_aside(self, path: pathlib.Path, kind: str, reason: str, *, quiet: bool = False) -> None:
        """Move an entry that cannot be used to ``<entry>.<kind>``, with
        ``reason`` beside it (``<entry>.<kind>.txt``), so no process uses it
        again; one warning (``quiet``: the caller says it). ``kind``:
        ``corrupt`` (unreadable), ``foreign`` (built for something else),
        ``refused`` (it raised, or disagreed with the eager step:
        :meth:`refusal` reads why, and nothing rebuilds it)."""
        if not quiet:
            log.warning("ddpad: compile-store entry %s is unusable (%s); moved aside to %s, compiling", path, reason,
                        path.with_suffix(f".{kind}").name)
        with contextlib.suppress(OSError):
            os.replace(path, path.with_suffix(f".{kind}"))
            path.with_suffix(f".{kind}.txt").write_text(reason + "\n")

    def refusal(self, path: pathlib.Path) -> tuple[str, pathlib.Path] | None:
        """Why the entry ``path`` was refused, for everyone (:meth:`set_aside`)
        or here (:meth:`refuse_here`), and the file that says so; None where
        it was not."""
        for marker in (path.with_suffix(".refused.txt"), self._here(path)):
            try:
                return marker.read_text().strip() or "refused", marker
            except OSError:
                continue
        return None

    def refuse_here(self, path: pathlib.Path, reason: str) -> pathlib.Path:
        """Record that the entry ``path`` failed on this host and process
        setting (a load error, a disagreement at this thread count): refused
        here from now on, while the entry stays for other hosts and settings
        (its bytes are not wrong: :meth:`set_aside` is for those). Returns
        the record's file."""
        marker = self._here(path)
        with contextlib.suppress(OSError):
            marker.write_text(f"{reason} (on {process_setting()})\n")
        return marker

    @staticmethod
    def _here(path: pathlib.Path) -> pathlib.Path:
        return path.with_name(f"{path.stem}.refused-{_digest(process_setting())[:12]}.txt")

    @contextlib.contextmanager
    def lock(self, path: pathlib.Path) -> Iterator[bool]:
        """Hold the entry's lock file while compiling it. Yields True when
        this process should compile, False when it waited for another
        process that has written the entry meanwhile, or found it written
        once it held the lock (load it).

        Never hangs: the wait ends when the holder is gone (same host), has
        not beaten its heartbeat for ``stale_after`` seconds, or after
        ``wait_timeout`` seconds; then this process compiles (logged). A store
        that cannot be written, or on a filesystem without ``flock``,
        compiles without a lock (warned once)."""
        lock_path = path.with_suffix(".lock")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self._unwritable(f"creating {lock_path.name}", exc)
            yield True
            return
        if not self.lockable:
            os.close(fd)
            yield not path.exists()
            return
        locked = waited = False
        beating: threading.Event | None = None
        try:
            deadline = time.monotonic() + self.wait_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if _same_file(fd, lock_path):
                        locked = True
                        break
                    # its holder removed the file as we waited: others now lock
                    # the path's new file, so lock that one, or two compile
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
                    continue
                except BlockingIOError:
                    pass
                except OSError as exc:  # ENOLCK, EOPNOTSUPP: no locks on this filesystem
                    self._no_locks(exc)
                    break
                reason = self._holder_gone(fd) or (
                    f"waited {self.wait_timeout:.0f} s" if time.monotonic() >= deadline else None)
                if reason is not None:
                    log.warning("ddpad: %s for the process compiling %s; compiling here", reason, path.name)
                    break
                waited = True
                time.sleep(0.05)
            if locked:
                beating = self._hold(fd)
            # (looked for again: another process may have written it since the caller looked)
            yield not path.exists()
        finally:
            if beating is not None:
                beating.set()
            # no lock file outlives its holder, whether it wrote the entry or
            # failed: removed while still locked, so a waiter that then takes
            # the removed file's lock sees it is gone and locks the path anew
            if locked:
                if _same_file(fd, lock_path):
                    with contextlib.suppress(OSError):
                        lock_path.unlink()
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _hold(self, fd: int) -> threading.Event:
        """Record this process as the lock's holder and beat its heartbeat
        (the lock file's mtime) until the returned event is set."""
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat):
                with contextlib.suppress(OSError):
                    os.utime(fd)

        threading.Thread(target=beat, name="ddpad-lock-heartbeat", daemon=True).start()
        return done

    def _holder_gone(self, fd: int) -> str | None:
        """Why the process holding the lock on ``fd`` will not finish, or None."""
        try:
            beat = os.fstat(fd).st_mtime
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return None
        if not isinstance(holder, dict):
            return None
        pid, host = holder.get("pid"), holder.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            return f"the lock holder (pid {pid}) is gone"
        silent = time.time() - beat
        if holder and silent > self.stale_after:
            return f"the lock holder (pid {pid} on {host}) gave no heartbeat for {silent:.0f} s"
        return None


def _same_file(fd: int, path: pathlib.Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not removed or replaced)."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs: not gone, not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:  # a zombie has exited
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:  # no /proc (macOS): kill(0) said it is there
        return True


@dataclasses.dataclass
class StoreBinding:
    """One model's place in a compile store: the store and the model's key
    in it. Each graph's entry holds the artifacts of that graph's compile
    only (:func:`own_artifacts`); what compiles lazily later (a backward, run
    by the adapter's call or by the caller) is written by :meth:`flush` to a
    file of its own beside them, ``late-<digest>.bin``, loaded with the
    model's key (:meth:`load_late`). No entry is written twice."""

    store: CompileStore
    model_key: str

    def entry(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> pathlib.Path:
        """The entry of one traced graph."""
        return self.store.entry(self.model_key, _graph_key(self.model_key, gm, example_inputs))

    def save(self, path: pathlib.Path) -> None:
        """Write the cache artifacts torch recorded in the current scope (a
        graph's own: :func:`own_artifacts`) as the entry ``path``."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:  # nothing cacheable (a backend without torch's caches)
            return
        self.store.write(path, saved[0])

    def flush(self) -> None:
        """After each call, at close and at exit: the artifacts torch recorded
        outside a graph's own compile since the last flush (a backward
        compiled lazily) go to one new ``late-<digest>.bin`` file, and torch's
        list of them is emptied."""
        from torch.compiler._cache import CacheArtifactManager

        if not CacheArtifactManager.need_serialize():
            return
        late = {kind: list(artifacts) for kind, artifacts in CacheArtifactManager._new_cache_artifacts.items()}
        CacheArtifactManager._new_cache_artifacts.clear()
        with own_artifacts():
            for kind, artifacts in late.items():
                CacheArtifactManager._new_cache_artifacts[kind].extend(artifacts)
            saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            name = f"late-{hashlib.sha256(saved[0]).hexdigest()[:24]}"
            self.store.write(self.store.entry(self.model_key, name), saved[0])

    def load_late(self) -> int:
        """Hand torch the model's ``late-*`` files (lazily compiled parts of
        its graphs); returns how many it took."""
        return sum(self.store.load(path) for path in sorted((self.store.root / self.model_key).glob("late-*.bin")))


@contextlib.contextmanager
def own_artifacts() -> Iterator[None]:
    """A fresh list of torch's cache artifacts within (torch's own scope,
    ``CacheArtifactManager.with_fresh_cache``): what compiles inside is saved
    apart from what the process compiled before, and leaves the process's
    list as it was."""
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        yield


def storable(backend: Any) -> bool:
    """Whether graphs of ``backend`` leave anything in torch's caches to
    store: Inductor's do (FX-graph and AOTAutograd cache entries); ``eager``,
    ``aot_eager`` and other backends compile nothing torch keeps."""
    return backend == "inductor"


def bind_store(model: torch.nn.Module, compile_cache: str | os.PathLike[str] | CompileStore,
               adapter: Adapter | None = None, dynamo_config: Mapping[str, Any] | None = None,
               **compile_kwargs: Any) -> StoreBinding | None:
    """``model``'s place in a compile store, keyed by every factor
    (:func:`store_environment`); None (said once, here) for a backend that
    has nothing to store."""
    backend = compile_kwargs.get("backend", "inductor")
    if not storable(backend):
        name = backend if isinstance(backend, str) else type(backend).__qualname__
        log.warning("ddpad: the compile store is not used with backend %r: it compiles nothing torch's caches "
                    "keep (only inductor's graphs are stored)", name)
        return None
    store = compile_cache if isinstance(compile_cache, CompileStore) else CompileStore(compile_cache)
    environment = store_environment(adapter, dynamo_config or {}, compile_kwargs)
    binding = StoreBinding(store, store.model_key(model, **environment))
    binding.load_late()
    return binding


def aot_binding(model: torch.nn.Module, compile_cache: str | os.PathLike[str] | CompileStore,
                adapter: Adapter | None = None, dynamo_config: Mapping[str, Any] | None = None,
                ) -> tuple[CompileStore, str]:
    """The store and model key of ``compile_mode="aot"``'s packages (every
    factor of :func:`store_environment`, the route instead of a backend; the
    weights' digest is added by the route: a package holds them)."""
    store = compile_cache if isinstance(compile_cache, CompileStore) else CompileStore(compile_cache)
    environment = store_environment(adapter, dynamo_config or {}, {"backend": "aot-inductor-package"})
    # a package holds machine code for one vector ISA (ATen's CPU capability names it, cheaply)
    environment["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return store, store.model_key(model, **environment)
