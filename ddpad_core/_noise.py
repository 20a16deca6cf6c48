"""Known third-party noise that ddpad itself triggers (importing a model
package, building or preparing a model), silenced inside ddpad's own scopes
only: warnings through ``warnings.catch_warnings`` (restored on exit), and
the known lines model packages print on import. Anything else passes."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import warnings
from collections.abc import Iterator

__all__ = ["NOISE", "PRINTED", "quiet"]

#: (message start, category) of warnings model packages raise for reasons
#: their users cannot act on
NOISE: tuple[tuple[str, type[Warning]], ...] = (
    ("The TorchScript type system doesn't support instance-level annotations", UserWarning),  # e3nn
    ("Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected", UserWarning),  # e3nn under mace
    ("To copy construct from a tensor", UserWarning),  # mace's model constructor
    ("You are using `torch.load` with `weights_only=False`", FutureWarning),
    ("Could not find or load the NVIDIA CUDA driver", UserWarning),  # warp on a CPU machine
    ("Failed to initialize NumPy", UserWarning),  # torch in a core install (no numpy)
    ("`torch.jit.script_method` is deprecated", DeprecationWarning),
)
#: lines model packages print on import (a match drops the line)
PRINTED = re.compile(
    r"^(cuequivariance or cuequivariance_torch is not available"  # mace
    r"|Warp \S+ initialized|   (CUDA|CPU|Kernel cache|Devices)\b|     \"(cpu|cuda:\d+)\""  # warp's banner
    r"|Warp CUDA error)"
)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Inside the block: the known warnings are ignored and the known printed
    lines dropped (other output is written out when the block ends)."""
    out = io.StringIO()
    with warnings.catch_warnings():
        for message, category in NOISE:
            warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        try:
            with contextlib.redirect_stdout(out):
                yield
        finally:
            kept = [line for line in out.getvalue().splitlines(keepends=True) if not PRINTED.match(line)]
            sys.stdout.write("".join(kept))
