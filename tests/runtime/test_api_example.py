"""The usage example in `dflash_trt.api`'s module docstring runs as written (the README points to it)."""

from __future__ import annotations

import contextlib
import io
import textwrap

import dflash_trt.api


def docstring_example() -> str:
    """The indented code block of the module docstring, dedented."""
    lines = dflash_trt.api.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    end = next((i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith("    ")), len(lines))
    return textwrap.dedent("\n".join(lines[start:end]))


def test_api_docstring_example_runs_and_answers():
    code = docstring_example()
    assert "load_pipeline()" in code and "SamplingParams" in code
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "dflash_trt/api.py docstring", "exec"), scope)  # noqa: S102 - our own docstring
    res = scope["res"]
    assert "Paris" in res.text
    assert 0 < len(res.token_ids) <= 32
    assert res.metrics.acceptance_length >= 1.0
    printed = out.getvalue()
    assert res.text in printed
    # the same request decoded autoregressively gives the same tokens (greedy, lossless)
    [ar] = scope["pipe"].generate([scope["prompt"]], scope["SamplingParams"](max_tokens=32), mode="ar")
    assert ar.token_ids == res.token_ids
