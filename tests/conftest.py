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


@pytest.fixture(autouse=True)
def fresh_dynamo_cache():
    """Each test counts its own compiles: start from an empty Dynamo cache
    (compiled entries of one test's shapes would otherwise serve the next)."""
    import torch

    torch._dynamo.reset()
    yield
