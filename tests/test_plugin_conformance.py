"""A plugin author's whole adapter test: one class over the conformance kit
(the toy Morse plugin in tests/plugin_pkg, installed in the core session)."""

from __future__ import annotations

import pytest

pytest.importorskip("ddpad_toy_plugin")
pytest.importorskip("ase")

from ddpad.testing import AdapterTests  # noqa: E402


class TestToyPlugin(AdapterTests):
    adapter = "toy"
    atol = 1e-12
