"""Test setup: tests/ on sys.path for the helper modules."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
