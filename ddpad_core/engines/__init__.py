"""ddpad inside existing domain-decomposition engines.

Each engine module imports its engine lazily, so importing
``ddpad.engines.nvalchemi`` or ``ddpad.engines.lammps`` needs only torch;
the engine is imported on first use and a missing one raises an
``ImportError`` naming the package to install.
"""

from __future__ import annotations

__all__: list[str] = []
