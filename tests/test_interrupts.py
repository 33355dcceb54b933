"""SIGTERM handled as Ctrl-C (`dflash_trt.interrupts`): the handler only inside its block, the words and exit
status per signal, signals held until a block ends, and real `dflash-trt generate` processes stopped by SIGTERM and
by SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dflash_trt.errors import TrainingInterrupted
from dflash_trt.interrupts import Terminated, signals_held, stopped_by, terminate_as_interrupt


def test_terminate_as_interrupt_raises_in_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 1)  # let the handler run
    assert signal.getsignal(signal.SIGTERM) is before


def test_stopped_by_names_the_signal_and_its_exit_status():
    assert stopped_by(KeyboardInterrupt()) == ("interrupted (Ctrl-C)", 130)
    assert stopped_by(Terminated()) == ("terminated (SIGTERM)", 143)
    wrapped = RuntimeError("abort")
    wrapped.__cause__ = Terminated()  # as click's Abort carries it
    assert stopped_by(wrapped) == ("terminated (SIGTERM)", 143)
    assert stopped_by(TrainingInterrupted(3, 8, "ckpt", None, terminated=True)) == ("terminated (SIGTERM)", 143)
    assert stopped_by(TrainingInterrupted(3, 8, "ckpt", None)) == ("interrupted (Ctrl-C)", 130)
    loop = RuntimeError("a")
    loop.__context__ = RuntimeError("b")
    loop.__context__.__context__ = loop  # a cycle ends the walk
    assert stopped_by(loop) == ("interrupted (Ctrl-C)", 130)


@pytest.mark.parametrize("stop, exc", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_a_signal_in_signals_held_stops_the_code_after_the_block(stop, exc):
    """SIGINT (SIGTERM inside `terminate_as_interrupt`) while the block runs: the block runs to its end, then the
    signal raises as it would have (once, however often it came), by the handlers from before the block."""
    ran = []
    # Python's Ctrl-C handler, as in a terminal: a shell starts background jobs (CI's, `make test &`) with SIGINT
    # ignored, and the re-raised signal would then be ignored too, as it was before the block
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _signal_after_the_block(stop, exc, ran)
    finally:
        signal.signal(signal.SIGINT, old_int)
    assert ran == ["whole block"]


def _signal_after_the_block(stop, exc, ran: list) -> None:
    with terminate_as_interrupt():
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        with pytest.raises(exc):
            with signals_held():
                os.kill(os.getpid(), stop)
                os.kill(os.getpid(), stop)
                signal.sigtimedwait([], 0.2)  # the handler runs (it only notes the signal)
                ran.append("whole block")
            ran.append("after the block")
        after = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        # terminate_as_interrupt's own handler ignores the SIGTERMs after the first, while the cleanup runs
        assert after == (before if stop == signal.SIGINT else (before[0], signal.SIG_IGN))


@pytest.mark.parametrize("sig, code, line", [
    (signal.SIGTERM, 143, "generate terminated (SIGTERM) mid-answer; stdout holds the answer so far"),
    (signal.SIGINT, 130, "generate interrupted (Ctrl-C) mid-answer; stdout holds the answer so far")])
def test_a_generate_process_stopped_mid_answer_says_how_in_one_line(sig, code, line):
    """A real `dflash-trt generate` process, signalled once its answer streams: the answer so far on stdout, then
    one stderr line and the shell's exit status (128 + the signal), no traceback (SIGTERM ended it silently)."""
    proc = subprocess.Popen([sys.executable, "-c", "from dflash_trt.cli import main; main()", "generate", "--prompt",
                             "Write a long story about a dragon. Chapter 1:", "--min-tokens", "2000", "--max-tokens",
                             "2000", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                            # SIGINT as in a terminal: a shell starts background jobs (CI's, `make test &`) with it
                            # ignored, and Python then keeps ignoring it (no KeyboardInterrupt)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(40)  # the answer has started streaming
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert len(first) == 40 and err.splitlines()[-1] == line and "Traceback" not in err, err
