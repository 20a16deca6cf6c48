"""The ```python blocks of a Markdown page, and which are marked not run.

A block is marked by an HTML comment on the line directly above its fence,
``<!-- not run: REASON -->``; every other block is run by a test
(``tests/test_readme.py`` for README.md, ``tests/test_docs.py`` for
docs/pages).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

# the marker, reason or none (a marker without one is reported, not ignored)
_MARKER = re.compile(r"<!--\s*not\s+run\b:?(.*?)-->")


@dataclass(frozen=True)
class Block:
    line: int  # the fence's line, from 1
    code: str
    not_run: str | None  # the marker's reason ("" for a marker without one); None: the block is run


def python_blocks(text: str) -> list[Block]:
    """Every ```python fenced block of a Markdown text, in order (one in a
    list item dedented)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
            marker = _MARKER.fullmatch(lines[i - 1].strip()) if i else None
            blocks.append(Block(i + 1, textwrap.dedent("\n".join(lines[i + 1:end]) + "\n"),
                                marker.group(1).strip() if marker else None))
            i = end
        i += 1
    return blocks


def script(blocks: list[Block]) -> str:
    """The run blocks as one script, in order, with ``backend="inductor"``
    as ``backend="aot_eager"``: the same graphs through Dynamo and AOT
    autograd in seconds instead of an inductor compile's minutes on a CPU."""
    code = "\n".join(b.code for b in blocks if b.not_run is None)
    return code.replace('backend="inductor"', 'backend="aot_eager"')
