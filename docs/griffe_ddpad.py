"""Griffe extension for the API reference: reads ``ddpad`` from this checkout.

``ddpad`` is the folder ``ddpad_core/`` and ``ddpad.adapters`` the folder
``adapters/`` (setuptools ``package-dir``). Griffe finds neither through an
editable install (it looks for a folder named ``ddpad``, and may take the
``ddpad`` console script's name for a namespace package), so once it has
loaded something as ``ddpad`` this loads both folders, statically, in its place.
"""

from __future__ import annotations

import pathlib
from typing import Any

import griffe

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "ddpad_core" / "__init__.py"
ADAPTERS = ROOT / "adapters" / "__init__.py"


class CheckoutPackage(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "ddpad" or pkg.filepath == CORE:
            return
        # Griffe has no public call that loads a package from a path under a given name;
        # with no parent, the module replaces ``ddpad`` in the loader's collection
        ddpad = loader._load_module("ddpad", CORE)
        ddpad.set_member("adapters", loader._load_module("adapters", ADAPTERS, parent=ddpad))
        loader.expand_exports(ddpad)
        loader.expand_exports(ddpad["adapters"])
        # what the other extensions (dataclasses' ``__init__``) did to the package it replaces
        loader.extensions.call("on_package", pkg=ddpad, loader=loader)
