"""The README's Python blocks run as written (one script, in order), all
but those marked ``<!-- not run: REASON -->`` on the line above the fence
(``tests/_markdown.py``; the docs pages' blocks: ``tests/test_docs.py``).

The one change: ``backend="inductor"`` becomes ``backend="aot_eager"``, so
the test compiles in seconds rather than minutes on a CPU.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from _markdown import python_blocks, script

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_blocks_are_found() -> None:
    blocks = [b for b in python_blocks(README.read_text(encoding="utf-8")) if b.not_run is None]
    assert len(blocks) >= 2 and "adapter.tools.random_model()" in blocks[0].code


def test_every_block_not_run_says_why() -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert not [b.line for b in blocks if b.not_run == ""], "README.md: a not-run marker without a reason"


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("mace")
    pytest.importorskip("ase")
    (tmp_path / "readme.py").write_text(script(python_blocks(README.read_text(encoding="utf-8"))), encoding="utf-8")
    res = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=1200, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "caps.json").exists()
    lines = res.stdout.splitlines()
    assert len(lines) >= 2 and lines[-1].endswith(" 1")  # the calculator's model: one compiled graph


def test_the_docs_home_page_starts_with_the_readmes_first_command() -> None:
    """The docs' home page had no install line or first command."""
    import re

    first = re.search(r"```bash\n(?:#.*\n)*(python3\.11 -m pip install[^\n]+)", README.read_text()).group(1)
    home = (README.parent / "docs" / "pages" / "index.md").read_text()
    assert first in home, first
