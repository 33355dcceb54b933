"""CLI checks shared by the test files of each target family (a tiny target + untrained drafter pair):
`generate` gives the autoregressive tokens in DFlash mode, and `serve` answers with the target's greedy tokens over
real HTTP (the `openai` client). Importable by a unique name from any test folder."""

from __future__ import annotations

import json

from tests.conftest import run_main


def check_generate_dflash_equals_ar(monkeypatch, capsys, pair) -> None:
    """`dflash-trt generate --json` of 16 tokens: DFlash (with prompt lookup, no confidence cut) == --mode ar, and
    at least one block was verified."""
    target, drafter = pair
    common = ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "def fibonacci(n):",
              "--max-tokens", "16", "--min-tokens", "16", "--json", "--threads", "1"]
    code, out, err = run_main(monkeypatch, capsys, *common, "--prompt-lookup", "3", "--draft-confidence", "0")
    assert code == 0, err
    spec = json.loads(out)
    code, out, err = run_main(monkeypatch, capsys, *common, "--mode", "ar")
    assert code == 0, err
    assert spec["token_ids"] == json.loads(out)["token_ids"] and len(spec["token_ids"]) == 16
    assert spec["metrics"]["verify_steps"] > 0


def check_serve_answers_greedy(pair) -> None:
    """A /v1/completions answer of 12 tokens at temperature 0 is the target's own greedy continuation."""
    from openai import OpenAI

    from dflash_trt.api import load_pipeline
    from tests.serve.test_openai_server import MODEL, ar_tokens, live_server

    pipe = load_pipeline(*map(str, pair), "float32")
    with live_server(pipe) as (base, _app):
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=MODEL, prompt="The history of", max_tokens=12, temperature=0,
                                      extra_body={"min_tokens": 12})
    want, _ = ar_tokens(pipe, pipe.encode("The history of"), 12)
    assert r.choices[0].text == pipe.decode(want) and r.usage.completion_tokens == len(want) == 12
