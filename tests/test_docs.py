"""Every ```python block of docs/pages runs in a test, or is marked
``<!-- not run: REASON -->`` on the line above its fence (``tests/_markdown.py``).

A page's run blocks are one script, in order, run in a temporary folder
with ``backend="inductor"`` as ``backend="aot_eager"``, in the nox session
that has the model package of the adapter they name (a page naming none:
the core session's).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from _markdown import Block, python_blocks, script

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "pages"
NOXFILE = ROOT / "tests" / "noxfile.py"

# adapter name -> (the nox session with its model package, that package's import name)
ADAPTERS = {
    "mace": ("mace", "mace"),
    "aimnet2": ("aimnet2", "aimnet"),
    "uma": ("uma", "fairchem.core"),
    "sevennet": ("sevennet", "sevenn"),
    "orb": ("orb", "orb_models"),
    "mattersim": ("mattersim", "mattersim"),
    "nequip": ("nequip", "nequip"),
    "allegro": ("allegro", "allegro"),
}

BLOCKS = {page: python_blocks(page.read_text(encoding="utf-8")) for page in sorted(PAGES.rglob("*.md"))}
RUN = {page: [b for b in blocks if b.not_run is None] for page, blocks in BLOCKS.items()
       if any(b.not_run is None for b in blocks)}


def adapters_named(blocks: list[Block]) -> set[str]:
    """The adapters whose names a page's run blocks quote, or whose model
    packages they import (comments aside)."""
    code = "\n".join(re.sub(r"#.*", "", b.code) for b in blocks)
    imported = {m.split(".")[0] for m in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", code, re.MULTILINE)}
    return {name for name, (_, package) in ADAPTERS.items()
            if re.search(rf"""["']{name}["']""", code) or package.split(".")[0] in imported}


def session_of(page: pathlib.Path) -> str:
    named = adapters_named(RUN[page])
    assert len(named) <= 1, f"{page.name}: run blocks name {sorted(named)}; no session has all of them"
    return ADAPTERS[named.pop()][0] if named else "core"


def session_modules(session: str) -> str:
    """The noxfile's text naming the test modules ``session`` runs."""
    text = NOXFILE.read_text(encoding="utf-8")
    pattern = r"^CORE_TESTS = \[.*?^\]" if session == "core" else rf"^def {session}\(session.*?(?=^@|\Z)"
    found = re.search(pattern, text, re.MULTILINE | re.DOTALL)
    assert found, f"no session {session!r} in {NOXFILE.name}"
    return found.group(0)


def test_blocks_are_found() -> None:
    assert sum(len(blocks) for blocks in RUN.values()) >= 8 and PAGES / "index.md" in RUN
    fences = [f"{page.name}:{n}" for page in BLOCKS for n, line in
              enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
              if line.strip().startswith("```py") and line.strip() != "```python"]
    assert not fences, f"Python fences this test does not read (write ```python): {fences}"


def test_every_block_not_run_says_why() -> None:
    unexplained = [f"{page.relative_to(PAGES)}:{b.line}" for page, blocks in BLOCKS.items()
                   for b in blocks if b.not_run == ""]
    assert not unexplained, f"not-run markers without a reason: {unexplained}"


def test_every_run_block_runs_in_a_session() -> None:
    missing = {f"{page.relative_to(PAGES)}": session_of(page) for page in RUN
               if "tests/test_docs.py" not in session_modules(session_of(page))}
    assert not missing, f"pages whose blocks no session runs (page: the session to add tests/test_docs.py to): {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(RUN), ids=lambda page: str(page.relative_to(PAGES)))
def test_page_python_blocks_run(page: pathlib.Path, tmp_path: pathlib.Path) -> None:
    for name in sorted(adapters_named(RUN[page])):
        pytest.importorskip(ADAPTERS[name][1])  # runs in that adapter's session
    (tmp_path / "page.py").write_text(script(RUN[page]), encoding="utf-8")
    res = subprocess.run([sys.executable, "page.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=840, check=False)
    assert res.returncode == 0, f"{page.relative_to(PAGES)}:\n{res.stderr[-3000:]}"
