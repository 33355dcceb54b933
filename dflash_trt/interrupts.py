"""SIGTERM handled as Ctrl-C: the commands' cleanup and one-line messages for both stops, and output held whole.

`kill`, `timeout`, `docker stop` and Slurm (at a job's time limit or on preemption) stop a process with SIGTERM,
whose default action ends Python at once: no cleanup (a build's temporary folder left behind), no message (a
training run's log says nothing of where to resume). Inside `terminate_as_interrupt`, SIGTERM raises `Terminated`,
a KeyboardInterrupt, so every `except KeyboardInterrupt` path runs as for Ctrl-C; `stopped_by` then gives the words
and the exit status a shell reports for the signal (128 + its number: 130 for SIGINT, 143 for SIGTERM), and
`exit_stopped` writes that line and exits. Inside `signals_held` either signal waits until the block ends, so a
result being written (an answer's line) is written whole before the stop.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Callable, NoReturn


class Terminated(KeyboardInterrupt):
    """Raised by the SIGTERM handler of `terminate_as_interrupt`: cleanup runs as for Ctrl-C."""


@contextlib.contextmanager
def terminate_as_interrupt():
    """While in the block, SIGTERM raises `Terminated` in the main thread; further SIGTERMs are ignored while the
    cleanup runs. The previous handler comes back on exit. Does nothing outside the main thread (Python runs signal
    handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup runs to its end
        raise Terminated

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stopped_by(exc: BaseException) -> tuple[str, int]:
    """("terminated (SIGTERM)", 143) when `exc` is, carries (a `terminated` attribute set true) or was caused by a
    `Terminated`; ("interrupted (Ctrl-C)", 130) otherwise (a KeyboardInterrupt from SIGINT)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Terminated) or getattr(exc, "terminated", False) is True:
            return "terminated (SIGTERM)", 143
        exc = exc.__cause__ or exc.__context__
    return "interrupted (Ctrl-C)", 130


def exit_stopped(exc: BaseException, message: Callable[[str], str]) -> NoReturn:
    """Ctrl-C / SIGTERM (`exc`): `message(how)` as one stderr line, `how` = "interrupted (Ctrl-C)" or "terminated
    (SIGTERM)" (`stopped_by`), then exit with the status a shell reports for the signal (130 / 143)."""
    how, code = stopped_by(exc)
    print(message(how), file=sys.stderr, flush=True)
    sys.exit(code)


@contextlib.contextmanager
def signals_held():
    """While in the block, SIGINT and SIGTERM only are noted: the block runs to its end (a write is not cut
    in the middle), then each signal that came is raised again, with the handlers from before the block (Ctrl-C's
    KeyboardInterrupt, `terminate_as_interrupt`'s `Terminated`, or the default action). Does nothing outside the
    main thread (Python runs signal handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def note(signum, _frame):
        if signum not in came:
            came.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in came:  # as if it came now: the handler it would have met runs
            signal.raise_signal(s)
