"""Test setup: tests/ on sys.path for the helper modules."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def user_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory):
    """The user cache folder (caps files, the compile store that ``ddpad run``
    uses by default) in a temporary folder: tests never write the user's, and
    parallel test workers never share one."""
    with pytest.MonkeyPatch.context() as patch:  # restored at the session's end
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("user-cache")))
        yield


def _untrace() -> None:
    """pytest (9) attaches its log capture to every logger that does not
    propagate, torch's trace logger included: every compile then builds its
    structured-trace payloads (graph dumps) for pytest to capture, and
    compiling threads meet at pytest's handler locks (a CI run hung in two
    compiling threads both waiting on one). Torch's own handler stays."""
    import logging

    trace = logging.getLogger("torch.__trace")
    for handler in list(trace.handlers):
        if type(handler).__module__.startswith("_pytest"):
            trace.removeHandler(handler)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item):
    _untrace()  # (inside pytest's own wrapper, which attached its handlers)
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item):
    _untrace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    _untrace()
    return (yield)


@pytest.fixture(autouse=True)
def fresh_dynamo_cache():
    """Each test counts its own compiles: start from an empty Dynamo cache
    (compiled entries of one test's shapes would otherwise serve the next)."""
    import torch
    from torch._dynamo.convert_frame import compile_lock

    # A thread an earlier test left compiling holds Dynamo's compile lock, and
    # reset() would wait on it for ever: fail this test in bounded time instead.
    if not compile_lock.acquire(timeout=120):
        pytest.fail("a thread of an earlier test still holds Dynamo's compile lock after 120 s (a hung compile): "
                    "see that test's failure for the threads' stacks")
    try:
        torch._dynamo.reset()
    finally:
        compile_lock.release()
    yield
