"""``python -m ddpad ARGS`` as a user runs it, for the tests of every
session (the adapters' sessions install no toy plugin, which
``test_cli.py`` needs for its own tests)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys


def ddpad(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ddpad ARGS`` as a user runs it (warnings not hidden),
    with the user cache folder inside ``cwd`` if given (else the test
    session's, see conftest.py)."""
    env = dict(os.environ)
    if cwd is not None:
        env["XDG_CACHE_HOME"] = str(cwd / "cache")
    return subprocess.run([sys.executable, "-m", "ddpad", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600, check=False)


def check_precompiled_run(adapter: str, tmp_path: pathlib.Path, first_call_limit: float = 5.0) -> dict[str, object]:
    """``ddpad precompile ADAPTER --aot --ladder 0`` (the fitted caps'
    package, built in a worker), then a fresh ``ddpad run ADAPTER --aot``:
    it loads the package, checks its first call against the eager step and
    compiles nothing, its first call under ``first_call_limit`` seconds; no
    lock file is left in the store. Returns the run's JSON report."""
    import json

    pre = ddpad("precompile", adapter, "--aot", "--ladder", "0", cwd=tmp_path)
    assert pre.returncode == 0, pre.stdout + pre.stderr
    assert "1 package(s) in" in pre.stdout, pre.stdout + pre.stderr
    res = ddpad("run", adapter, "--aot", "--steps", "3", "--json", "run.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    assert (run["aot_loaded"], run["aot_compiled"], run["aot_checked"], run["aot_refused"], run["aot_background"]) \
        == (1, 0, 1, 0, 0), run
    assert (run["graphs"], run["checks"], run["disagreements"]) == (0, 1, 0), run
    assert run["first_call_seconds"] < first_call_limit, run
    assert "checked against the eager step: 1 compiled graph(s) on their first call, 0 disagreed" in res.stdout
    assert not list((tmp_path / "cache").rglob("*.lock"))
    return run
