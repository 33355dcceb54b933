"""`dflash-trt generate`'s answers as they finish: each is written, whole and flushed, as soon as it and every
answer before it (in the prompts' order) are finished, so that stdout lines up with the prompts file however the
requests of a batch end; and the one stderr line that says, when Ctrl-C or SIGTERM stops the command, how many
answers were written and where the prompts left start."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable

from dflash_trt.interrupts import signals_held
from dflash_trt.text import count


class AnswersInOrder:
    """Writes finished answers in prompt order: `finished(i, answer)` keeps answer `i` (0-based) until answers
    0..i-1 are written, then writes it and every kept one that follows it, each by `write(i, answer)` (which
    flushes what it writes). A write is never cut by Ctrl-C / SIGTERM (`signals_held`): the signal stops the
    command after it. `written`: how many answers were written (the first `written` prompts')."""

    def __init__(self, write: Callable[[int, object], None]):
        self._write = write
        self._kept: dict[int, object] = {}
        self.written = 0

    def finished(self, index: int, answer) -> None:
        """Answer `index` is finished: write it, and the ones kept after it, if every one before it is written."""
        self._kept[index] = answer
        while self.written in self._kept:
            with signals_held():
                self._write(self.written, self._kept.pop(self.written))
                self.written += 1


def stopped_line(how: str, written: int, total: int, partial: bool = False, prompts_file: str | None = None,
                 lines: list[int] | None = None) -> str:
    """The stderr line for generate stopped (`how`: "interrupted (Ctrl-C)" / "terminated (SIGTERM)") after
    `written` of `total` answers were written; `partial`: stdout holds the unfinished streamed answer of a single
    prompt. For a prompts file (`prompts_file`, `lines`: each prompt's 1-based line in it), the line of the first
    prompt not answered and the `tail -n +K` that continues from it; for --prompt / --chat, what stdout holds."""
    if prompts_file is None:  # --prompt / --chat: one answer
        if written:
            return f"generate {how} after the answer was written to stdout"
        return f"generate {how} " + ("mid-answer; stdout holds the answer so far" if partial else
                                     "before the answer was finished; nothing was written to stdout")
    done = f"generate {how}: {written} of {count(total, 'prompt')} answered"
    if written == total:
        return f"{done} and written to stdout"
    if not written:
        held = "stdout holds the unfinished answer so far" if partial else "nothing was written to stdout"
        return f"{done}, {held}; rerun the same command"
    line = lines[written]
    rest = f"{done} and written to stdout; the rest start at line {line} of {prompts_file}"
    if not Path(prompts_file).is_file():  # a pipe (<(...), /dev/stdin) cannot be read again
        return rest
    return f"{rest}: continue with --prompts-file <(tail -n +{line} {shlex.quote(prompts_file)})"
