"""SIGTERM handled as Ctrl-C: the commands' cleanup and one-line messages for both stops.

`kill`, `timeout`, `docker stop` and Slurm (at a job's time limit or on preemption) stop a process with SIGTERM,
whose default action ends Python at once: no cleanup (a build's temporary folder left behind), no message (a
training run's log says nothing of where to resume). Inside `terminate_as_interrupt`, SIGTERM raises `Terminated`,
a KeyboardInterrupt, so every `except KeyboardInterrupt` path runs as for Ctrl-C; `stopped_by` then gives the words
and the exit status a shell reports for the signal (128 + its number: 130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import signal
import threading


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
