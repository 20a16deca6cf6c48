"""What a user sees of ddpad's own work and of the packages it drives.

Known third-party noise that ddpad itself triggers (importing a model
package, building or preparing a model, compiling it) is silenced inside
ddpad's own scopes only: warnings through ``warnings.catch_warnings``
(restored on exit), and the known lines model packages print on import.
Anything else passes.

A call that compiles says so on the ``ddpad`` logger (INFO); where the
application configured no logging, ddpad shows it on stderr once the call
has taken a few seconds (:class:`CompileNotice`), through a handler it adds
to its own logger only (never the root logger)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType

__all__ = ["NOISE", "NOTICE_AFTER", "PRINTED", "SILENCE", "CompileEvent", "CompileNotice", "ignore_noise", "quiet",
           "quiet_warnings"]

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
    # torch's own pytree, when export or a compile copies or unpickles a tree spec
    ("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning),
)
#: lines model packages print on import (a match drops the line)
PRINTED = re.compile(
    r"^(cuequivariance or cuequivariance_torch is not available"  # mace
    r"|Warp \S+ initialized|   (CUDA|CPU|Kernel cache|Devices)\b|     \"(cpu|cuda:\d+)\""  # warp's banner
    r"|Warp CUDA error)"
)
#: seconds a call compiles before an application that configured no logging hears of it
NOTICE_AFTER = 5.0
#: how to silence the compile notices (said with the first one shown)
SILENCE = 'logging.getLogger("ddpad").setLevel(logging.WARNING)'


def ignore_noise() -> None:
    """Ignore the known warnings (:data:`NOISE`) in the current warning
    filters: call it inside a ``warnings.catch_warnings()`` scope (the CLI:
    for its whole command)."""
    for message, category in NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Inside the block: the known warnings are ignored (filters restored on exit)."""
    with warnings.catch_warnings():
        ignore_noise()
        yield


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Inside the block: the known warnings are ignored and the known printed
    lines dropped (other output is written out when the block ends)."""
    out = io.StringIO()
    with quiet_warnings():
        try:
            with contextlib.redirect_stdout(out):
                yield
        finally:
            kept = [line for line in out.getvalue().splitlines(keepends=True) if not PRINTED.match(line)]
            sys.stdout.write("".join(kept))


class _Stderr(logging.Handler):
    """stderr for ddpad's records while the application configured no
    logging (what :data:`logging.lastResort` would do, notices included);
    once it configures some, its handlers show them instead."""

    def __init__(self) -> None:
        super().__init__()
        self.hinted = False  # the first notice says how to silence them

    def emit(self, record: logging.LogRecord) -> None:
        if _handled(logging.getLogger(record.name)):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")  # (sys.stderr as it is now: a test's capture)
        except Exception:  # noqa: BLE001 - as logging's own handlers do
            self.handleError(record)


_STDERR = _Stderr()


def _configured(logger: logging.Logger) -> bool:
    """Whether the application set up logging for ``logger``'s records: a
    level of its own (``SILENCE``), or a handler."""
    return logger.level != logging.NOTSET or _handled(logger)


def _handled(logger: logging.Logger) -> bool:
    """Whether a handler on ``logger`` or a logger above it (ddpad's stderr
    handler aside) gets its records."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(handler is not _STDERR for handler in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


@dataclass(frozen=True)
class CompileEvent:
    """What a call that may compile announces, on the INFO records of the
    ``ddpad`` logger (as their attribute ``ddpad_compile``) when it starts
    (``phase="start"``) and when it has run (``"done"``): a logging handler
    is the hook (``ddpad run`` prints its lines from them).

    ``kind``: ``"first"`` (the first call), ``"fitted"``, ``"grew"`` or
    ``"shrank"`` (the caps changed, ``change`` says how), ``"seam"`` (the
    first call of a model that pads at its own seam: caps not known
    before), ``"ladder"`` (the warm ladder's rungs); ``caps``: the caps the
    call runs at (None where not known before it runs); ``message``: the
    record's text."""

    phase: str
    kind: str
    message: str
    caps: Mapping[str, int] | None = None
    change: str | None = None
    built: str = "graph"  # what may be compiled: "graph" (torch.compile) or "package"


class CompileNotice:
    """What a call that may compile says: ``message`` as an INFO record of
    ``logger`` when it starts and, where the application configured no
    logging, on stderr once the call has run ``after`` seconds (with how to
    silence it, the first time; ``after``: :data:`NOTICE_AFTER`); :meth:`done`
    says how it ended, on stderr too where the start was. Inside it the known
    warnings are ignored."""

    def __init__(self, logger: logging.Logger, message: str, after: float | None = None,
                 event: CompileEvent | None = None) -> None:
        self.logger = logger
        self.message = message
        self.event = event
        self.shown = False
        self._timer = threading.Timer(NOTICE_AFTER if after is None else after, self._show_start)
        self._timer.daemon = True
        self._warnings = warnings.catch_warnings()

    def __enter__(self) -> CompileNotice:
        self.logger.info("%s", self.message, extra=self._extra("start", self.message))
        if not _configured(self.logger):
            self._timer.start()
        self._warnings.__enter__()
        ignore_noise()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._warnings.__exit__(kind, exc, tb)
        finally:
            self._timer.cancel()
            if self._timer.is_alive():
                self._timer.join()  # a notice being written ends before the call returns

    def _extra(self, phase: str, message: str) -> dict[str, CompileEvent] | None:
        """The record's ``ddpad_compile`` attribute (the event, in this phase)."""
        if self.event is None:
            return None
        return {"ddpad_compile": CompileEvent(phase, self.event.kind, message, self.event.caps, self.event.change,
                                              self.event.built)}

    def _show_start(self) -> None:
        hint = "" if _STDERR.hinted else f" ({SILENCE} silences these notices)"
        self.shown = self._show(f"{self.message}…{hint}")
        _STDERR.hinted = _STDERR.hinted or self.shown

    def done(self, message: str) -> None:
        """How the call ended: an INFO record, and on stderr where its start was."""
        self.logger.info("%s", message, extra=self._extra("done", message))
        if self.shown:
            self._show(message)

    def _show(self, message: str) -> bool:
        """``message`` through ddpad's stderr handler (added to ``logger`` if
        missing), past the logger's level; False when the application has
        configured logging meanwhile."""
        logger = self.logger
        if _configured(logger):
            return False
        if _STDERR not in logger.handlers:
            logger.addHandler(_STDERR)
        logger.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, "ddpad: %s", (message,), None))
        return True
