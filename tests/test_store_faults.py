"""Compile-store faults: a store that cannot be written, a lock holder that
stopped, an entry torch rejects, a backend with nothing to store, and what
is left behind. Each is a warning and a run that goes on, never a lost step
or a wait until ``wait_timeout``."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import ddpad
from ddpad import CompileStore

toy = pytest.importorskip("ddpad_toy_plugin")


def _model() -> torch.nn.Module:
    return toy.Morse(3.0).to(torch.float64)


def _data(model: torch.nn.Module, n: int = 27) -> dict[str, torch.Tensor]:
    from ase import Atoms

    g = torch.stack(torch.meshgrid(*[torch.arange(4.0)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    return toy.ADAPTER.engine.build_input(model, Atoms(f"Ar{n}", positions=(g * 1.3).numpy()))


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> pathlib.Path:
    """A store under which every new file or folder fails with EROFS (as a
    read-only mount does; chmod does not stop root, which CI runs as)."""
    root = tmp_path / "store"
    root.mkdir()
    real_open, real_mkdir, real_mkstemp = os.open, pathlib.Path.mkdir, __import__("tempfile").mkstemp

    def refuse(path: object) -> None:
        if str(os.fspath(path)).startswith(str(root)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def fake_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_CREAT:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def fake_mkdir(self: pathlib.Path, *args: object, **kwargs: object) -> None:
        if not self.exists():
            refuse(self)
        real_mkdir(self, *args, **kwargs)

    def fake_mkstemp(*args: object, dir: object = None, **kwargs: object) -> tuple[int, str]:  # noqa: A002
        refuse(dir)
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(pathlib.Path, "mkdir", fake_mkdir)
    monkeypatch.setattr("tempfile.mkstemp", fake_mkstemp)
    return root


def _passthrough_backend(store: CompileStore, stats: ddpad.Stats) -> object:
    """The counting backend through ``store`` around a compile that returns
    the graph itself (what matters here is the store's side)."""
    from ddpad._compile import _CountingBackend
    from ddpad._store import StoreBinding

    return _CountingBackend(lambda gm, inputs: gm.forward, stats, StoreBinding(store, "model"))


def _three_graphs_one_warning(store: CompileStore, caplog: pytest.LogCaptureFixture, said: str) -> None:
    """Three graphs through ``store`` all compile, with one warning that says ``said``."""
    stats = ddpad.Stats()
    backend = _passthrough_backend(store, stats)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        for _ in range(3):
            assert backend(gm, [torch.ones(1, 2)]) is not None  # type: ignore[operator]
    assert caplog.text.count(said) == 1
    assert stats.graphs_compiled == 3


def test_a_read_only_store_is_one_warning_and_the_compile_goes_on(
        read_only: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the entry's lock (mkdir, os.open(O_CREAT)) raised OSError
    through Dynamo (BackendCompilerFailed) and the step was lost."""
    _three_graphs_one_warning(CompileStore(read_only), caplog, "cannot be written")


def test_a_read_only_store_turns_background_compiles_off_once(
        read_only: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: ``Background._start`` created its folder unguarded (the step
    raised), and a full disk was reported as "cannot be pickled", once per key."""
    model = _model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", compile_cache=read_only, background_compile=0.5,
                         cap_policy="headroom")
    with caplog.at_level(logging.WARNING, logger="ddpad"), wrapped:
        out = wrapped(_data(model))
        wrapped(_data(model, 30))
    assert out["forces"].shape == (27, 3)
    assert caplog.text.count("background compiles are off") == 1
    assert "the store cannot be written" in caplog.text and "pickled" not in caplog.text
    assert wrapped.stats.background_started == 0


def test_a_stopped_lock_holder_is_waited_for_only_until_its_heartbeat_stops(
        tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """A holder that stops (SIGSTOP; a hung process on a shared file system)
    keeps its flock: before, a waiter waited ``wait_timeout`` (1800 s by
    default). Now the lock names its holder and beats a heartbeat; a waiter
    whose holder is silent for ``stale_after`` seconds compiles itself."""
    holder = textwrap.dedent("""
        import os, signal, sys; from ddpad import CompileStore
        store = CompileStore(sys.argv[1], heartbeat=0.2)
        with store.lock(store.entry("m", "g")):
            print("held", flush=True); os.kill(os.getpid(), signal.SIGSTOP)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        store = CompileStore(tmp_path, stale_after=2.0)  # wait_timeout stays 1800 s
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="ddpad"), store.lock(store.entry("m", "g")) as mine:
            assert mine
        waited = time.monotonic() - t0
        assert 1.5 < waited < 15, waited
        assert f"pid {proc.pid}" in caplog.text and "gave no heartbeat" in caplog.text
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_dead_lock_holder_on_this_host_is_not_waited_for(tmp_path: pathlib.Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A holder whose flock outlives it (a zombie, a lock on a file system
    that keeps it) is recognised from the pid the lock file records."""
    store = CompileStore(tmp_path, stale_after=600.0)
    entry = store.entry("m", "g")
    with store.lock(entry):
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        lock = entry.with_suffix(".lock")
        lock.write_text(f'{{"pid": {dead.pid}, "host": "{os.uname().nodename}", "started": 0}}')
        fd = os.open(lock, os.O_RDWR)
        try:
            assert store._holder_gone(fd) == f"the lock holder (pid {dead.pid}) is gone"
        finally:
            os.close(fd)


def test_an_entry_torch_rejects_is_corrupt_not_a_hit(tmp_path: pathlib.Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A valid header and SHA-256 around a payload that is not torch's
    artifacts: torch logs "Failed to un-pickle" and returns None; before,
    ``load`` returned True (a hit) and the entry was never moved aside."""
    store = CompileStore(tmp_path)
    entry = store.entry("m", "g")
    store.write(entry, b"not torch's cache artifacts")
    assert entry.exists()
    with caplog.at_level(logging.WARNING):
        assert store.load(entry) is False
    assert not entry.exists() and entry.with_suffix(".corrupt").exists()
    assert "unusable" in caplog.text and "Traceback" not in caplog.text


def test_aot_eager_says_once_that_the_store_keeps_nothing(tmp_path: pathlib.Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Before: two identical aot_eager runs each reported "1 graph(s)
    compiled ... (0 hits, 1 misses)" and the entry folder held nothing."""
    model = _model()
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="ddpad"):
            wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", compile_cache=tmp_path)
            wrapped(_data(model))
        assert (wrapped.stats.store_hits, wrapped.stats.store_misses) == (0, 0)
        assert wrapped.stats.graphs_compiled >= 1
    assert caplog.text.count("not used with backend 'aot_eager'") == 2  # once per run
    assert not any(tmp_path.iterdir())


def test_a_written_entry_leaves_no_lock_file(tmp_path: pathlib.Path) -> None:
    """Before: an empty ``*.lock`` per graph stayed in the entry folder."""
    store = CompileStore(tmp_path)
    entry = store.entry("m", "g")
    with store.lock(entry) as mine:
        assert mine and entry.with_suffix(".lock").exists()
        store.write(entry, b"payload")
    assert entry.exists() and not entry.with_suffix(".lock").exists()
    failed = store.entry("m", "h")
    with store.lock(failed):
        pass  # nothing written (a compile that failed): no lock is left behind either
    assert not failed.with_suffix(".lock").exists()


def test_a_holder_that_fails_hands_the_lock_to_one_process(tmp_path: pathlib.Path) -> None:
    """Two ranks, one graph: rank A compiles under the lock while B waits;
    A's compile restarts (Dynamo retries it), so A leaves the lock without an
    entry and comes back for it. Before: A removed the lock file as it left,
    B took the removed file's lock and A's retry made a new file and locked
    that, so both compiled (a two-rank LAMMPS run compiled MACE twice beside
    a shared store). Now B sees its file is gone and locks the path's new
    file: one process inside at a time."""
    store = CompileStore(tmp_path, wait_timeout=60)
    entry = store.entry("m", "g")
    inside: list[str] = []
    most = [0]
    guard = threading.Lock()

    def compile_as(name: str, ready: threading.Event | None = None) -> None:
        if ready is not None:
            ready.set()
        with store.lock(entry) as here:
            assert here  # nobody writes the entry here: whoever holds the lock compiles
            with guard:
                inside.append(name)
                most[0] = max(most[0], len(inside))
            time.sleep(0.4)
            with guard:
                inside.remove(name)

    with store.lock(entry):  # A's first try
        waiting = threading.Event()
        b = threading.Thread(target=compile_as, args=("B", waiting))
        b.start()
        waiting.wait()
        time.sleep(0.3)  # B waits on A's lock file
    retry = threading.Thread(target=compile_as, args=("A",))  # A's retry, once B holds what A left
    time.sleep(0.15)
    retry.start()
    b.join()
    retry.join()
    assert most[0] == 1, "two processes held the entry's lock at once"
    assert not entry.with_suffix(".lock").exists()


def test_background_logs_are_bounded(tmp_path: pathlib.Path) -> None:
    """Before: every worker's ``.log`` stayed in ``STORE/background`` forever."""
    from ddpad._background import _KEEP_LOGS, _prune

    folder = tmp_path / "background"
    folder.mkdir()
    for i in range(_KEEP_LOGS + 10):
        log = folder / f"{i}.log"
        log.write_text("x")
        os.utime(log, (1000 + i, 1000 + i))
    _prune(folder)
    kept = sorted(int(p.stem) for p in folder.glob("*.log"))
    assert kept == list(range(10, _KEEP_LOGS + 10))  # the newest


def test_a_finished_background_worker_leaves_no_log(tmp_path: pathlib.Path) -> None:
    model = _model()
    with ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", compile_cache=tmp_path,
                    background_compile=0.5, cap_policy="headroom") as wrapped:
        wrapped(_data(model, 20))
        wrapped(_data(model, 22))  # needs rising past the first call's: a worker starts
        background = wrapped.manager.background
        assert background is not None and background.running
        target, proc = next(iter(background.running.items()))
        log = background.logs[target]
        assert log.exists() and proc.wait(timeout=240) == 0
        wrapped(_data(model, 22))  # the next call reaps it
        assert not log.exists()


# -- ahead-of-time packages that cannot be used ---------------------------------

@pytest.fixture(scope="module")
def two_packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A store holding the toy's packages at two caps (its own, and twice
    them), built once for the module."""
    root = tmp_path_factory.mktemp("two-packages")
    model = _model()
    data = _data(model)
    entries = {}
    for name, caps in (("own", None), ("twice", "twice")):
        before = set(root.glob("*/aot-*.bin"))
        options = {"caps": {k: 2 * v for k, v in entries["own_caps"].items()}} if caps else {}
        wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=root, cap_policy="headroom",
                             aot_build="foreground", **options)
        wrapped(data)
        (entries[name],) = set(root.glob("*/aot-*.bin")) - before
        entries[f"{name}_caps"] = wrapped.caps
    return {"root": root, **entries}


def _copy_store(two_packages: dict[str, object], to: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    import shutil

    root = pathlib.Path(str(two_packages["root"]))
    shutil.copytree(root, to)
    own, twice = (to / pathlib.Path(str(two_packages[k])).relative_to(root) for k in ("own", "twice"))
    return to, own, twice


_FOREIGN_RUN = textwrap.dedent("""
    import json, sys, torch, ddpad, ddpad_toy_plugin as toy
    sys.path.insert(0, sys.argv[2])
    from test_store_faults import _data, _model
    model = _model()
    data = _data(model)
    wrapped = ddpad.wrap(model, toy.ADAPTER, compile_mode="aot", compile_cache=sys.argv[1], cap_policy="headroom",
                         aot_build="foreground")
    out = wrapped(data)
    ref = model({k: v.clone() for k, v in data.items()})
    s = wrapped.stats
    print(json.dumps({"worst": max(float((out[k] - ref[k].detach()).abs().max()) for k in ("energy", "forces")),
                      "compiled": s.aot_compiled, "loaded": s.aot_loaded, "refused": s.aot_refused}))
""")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_package_of_other_caps_under_an_entrys_name_is_moved_aside_unrun(two_packages: dict[str, object],
                                                                            tmp_path: pathlib.Path,
                                                                            threads: int) -> None:
    """Before: a checksummed package of other caps under an entry's name was
    run: ``RuntimeError: index out of bounds`` at one thread, the interpreter
    aborted (SIGABRT in the package's OpenMP region) at two; the entry stayed,
    so every later process died the same way."""
    store, own, twice = _copy_store(two_packages, tmp_path / "store")
    own.write_bytes(twice.read_bytes())  # a valid entry, checksum and all, of the other caps
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(pathlib.Path(__file__).parent)}
    res = subprocess.run([sys.executable, "-c", _FOREIGN_RUN, str(store), str(pathlib.Path(__file__).parent)],
                         capture_output=True, text=True, timeout=600, check=False, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads(res.stdout.strip().splitlines()[-1])
    assert run["worst"] < 1e-10 and (run["compiled"], run["loaded"], run["refused"]) == (1, 0, 0)
    assert own.with_suffix(".foreign").exists() and "built for" in own.with_suffix(".foreign.txt").read_text()
    assert own.exists()  # rebuilt for its own caps, under its own name
    assert "moved aside" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("fault", ["raises", "disagrees"])
def test_a_package_that_raises_or_disagrees_is_refused_here_only(
        two_packages: dict[str, object], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, fault: str) -> None:
    """A package that raised or disagreed on its first call is refused on
    this host and process setting (threads, CPU) only: a later run in the
    same setting neither loads, re-checks nor rebuilds it; one at another
    thread count loads, checks and uses it. Before, it was moved aside for
    every host and setting (a thread-count-dependent disagreement poisoned
    a shared store); before that, it stayed and every process re-checked it."""
    from ddpad import _aot
    from ddpad._store import process_setting

    store, own, _ = _copy_store(two_packages, tmp_path / "store")
    model = _model()
    data = _data(model)
    ref = model({k: v.clone() for k, v in data.items()})
    original = _aot._Package.__call__

    def faulty(self: object, leaves: list[torch.Tensor]) -> object:
        if fault == "raises":
            raise RuntimeError("index out of bounds")
        out = original(self, leaves)  # type: ignore[arg-type]
        return {**out, "energy": out["energy"] + 1e-3}

    options = {"compile_mode": "aot", "compile_cache": store, "cap_policy": "headroom", "aot_build": "foreground",
               "backend": "aot_eager"}
    with monkeypatch.context() as patch:
        patch.setattr(_aot._Package, "__call__", faulty)
        first = ddpad.wrap(model, toy.ADAPTER, **options)
        with caplog.at_level(logging.WARNING, logger="ddpad"):
            out = first(data)
    torch.testing.assert_close(out["energy"], ref["energy"].detach(), rtol=0, atol=1e-10)
    assert first.stats.aot_loaded == 1 and first.stats.aot_refused == 1
    (marker,) = own.parent.glob(f"{own.stem}.refused-*.txt")
    assert own.exists() and not own.with_suffix(".refused").exists()  # the entry stays for others
    assert ("raised" if fault == "raises" else "disagrees") in marker.read_text()
    assert process_setting() in marker.read_text()
    caplog.clear()
    second = ddpad.wrap(model, toy.ADAPTER, **options)  # this setting again: nothing loaded, re-checked or rebuilt
    with caplog.at_level(logging.WARNING, logger="ddpad"):
        out = second(data)
    torch.testing.assert_close(out["forces"], ref["forces"].detach(), rtol=0, atol=1e-10)
    s = second.stats
    assert (s.aot_loaded, s.aot_compiled, s.aot_refused) == (0, 0, 1) and "refused before" in caplog.text
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another setting: the entry is loaded, checked and used
    try:
        third = ddpad.wrap(model, toy.ADAPTER, **options)
        out = third(data)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out["energy"], ref["energy"].detach(), rtol=0, atol=1e-10)
    s = third.stats
    assert (s.aot_loaded, s.aot_compiled, s.aot_refused, s.aot_checked) == (1, 0, 0, 1)


def test_a_filesystem_without_flock_is_one_warning_and_compiles(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """NFS mounted ``nolock`` or Lustre without ``flock``: before, ``flock``'s
    ``OSError(ENOLCK)`` escaped into Dynamo's backend and the run died."""
    import fcntl

    import ddpad._store as store_module

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(store_module.fcntl, "flock", no_locks)
    assert fcntl.flock is no_locks  # (the module ddpad locks through)
    _three_graphs_one_warning(CompileStore(tmp_path), caplog, "cannot lock its entries")


def test_an_entry_written_before_the_lock_was_taken_is_loaded_not_built(tmp_path: pathlib.Path) -> None:
    """Another process may write the entry between the caller's look and the
    lock: once locked, the entry is looked for again (before: built twice)."""
    store = CompileStore(tmp_path)
    entry = store.entry("m", "g")
    store.write(entry, b"payload")  # (written by another process since the caller looked)
    with store.lock(entry) as build_here:
        assert not build_here
