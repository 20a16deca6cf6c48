"""The ddpad command: list adapters, run compiled padded MD, benchmark.

Every mistake in the input (unknown adapter, missing or unreadable file,
system the model does not know, unavailable device, bad option) prints one
line starting with ``ddpad: error:`` and exits with status 2, never a
traceback. Known third-party noise (TorchScript and ``torch.load`` warnings,
import-time banners) is silenced unless ``-v`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence

from ddpad._noise import ignore_noise

from . import _bench, _cache, _lammps, _list, _precompile, _run
from ._common import CliError, _format_warning, _Interrupted, _verbose_option

# torch and the model packages are imported inside the commands, not here:
# parsing the arguments and printing help takes no torch import (seconds).

__all__ = ["build_parser", "main"]

DESCRIPTION = (
    "Keep torch.compile'd interatomic potentials on one compiled graph through MD. "
    "Commands: 'list' shows the adapters and whether their model package is installed; "
    "'run' runs compiled, padded Langevin MD; 'bench' times eager, unpadded torch.compile "
    "and ddpad on one trajectory whose atom count changes; 'cache' lists and prunes the compile store; "
    "'lammps build-plugin' builds pair_style ddpad (LAMMPS without Python). "
    "'ddpad COMMAND -h' for options."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``ddpad`` parser: each command's options come from its module."""
    parser = argparse.ArgumentParser(prog="ddpad", description=DESCRIPTION)
    _verbose_option(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{list,run,precompile,bench,cache,lammps}")
    for command in (_list, _run, _precompile, _bench, _cache, _lammps):
        command.add_parser(sub)
    return parser


class _OwnLogFormat(logging.Formatter):
    """ddpad's log records on one line: ``ddpad: warning: ...`` from WARNING
    up, ``ddpad: ...`` below (the ``ddpad: `` a message starts with not doubled)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        text = text[len("ddpad: "):] if text.startswith("ddpad: ") else text
        return f"ddpad: warning: {text}" if record.levelno >= logging.WARNING else f"ddpad: {text}"


@contextlib.contextmanager
def _cli_scope(verbose: bool) -> Iterator[None]:
    """The command's warning filters, warning format and log handler, all
    restored when it ends (``main`` called from Python leaves no trace)."""
    format_before = warnings.formatwarning
    root, own = logging.getLogger(), logging.getLogger("ddpad")
    before = (root.level, own.level, own.propagate)
    handlers: list[tuple[logging.Logger, logging.Handler]] = []
    own_handler = logging.StreamHandler()  # ddpad's log records as its warnings read: "ddpad: warning: ..."
    own_handler.setFormatter(_OwnLogFormat())
    handlers.append((own, own_handler))
    own.propagate = False
    # INFO records reach the logger's handlers (the run's compile announcements listen to them);
    # the printed ones are WARNING and up unless -v
    own.setLevel(logging.INFO)
    own_handler.setLevel(logging.INFO if verbose else logging.WARNING)
    with warnings.catch_warnings():
        warnings.formatwarning = _format_warning
        if verbose:
            other = logging.StreamHandler()
            other.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            handlers.append((root, other))
            root.setLevel(logging.INFO)
        else:  # the known third-party warnings, not ddpad's own (shown with -v)
            ignore_noise()
        for logger, handler in handlers:
            logger.addHandler(handler)
        try:
            yield
        finally:
            warnings.formatwarning = format_before
            for logger, handler in handlers:
                logger.removeHandler(handler)
            root.setLevel(before[0])
            own.setLevel(before[1])
            own.propagate = before[2]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ddpad`` command; returns its exit status (0, 2 for a user
    error, 130 when interrupted)."""
    args = build_parser().parse_args(argv)
    with _cli_scope(args.verbose):
        try:
            return int(args.func(args))
        except CliError as exc:
            print(f"ddpad: error: {exc}", file=sys.stderr)
            return 2
        except _Interrupted as exc:
            print(f"ddpad: {exc}", file=sys.stderr)
            return 130
        except KeyboardInterrupt:
            print("ddpad: interrupted", file=sys.stderr)
            return 130
