"""Test setup: tests/ on sys.path for the helper modules."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo_cache():
    """Each test counts its own compiles: start from an empty Dynamo cache
    (compiled entries of one test's shapes would otherwise serve the next)."""
    import torch

    torch._dynamo.reset()
    yield
