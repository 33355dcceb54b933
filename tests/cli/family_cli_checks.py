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


def check_train_drafter_from_a_moe_target(pair, tmp_path) -> None:
    """`dflash-trt train-drafter` (--init target, the default) of a 1-layer drafter for 2 steps on 3 prompts, for a
    mixture-of-experts target: it runs, training.json records 2 steps, 3 samples and init mode "target", and the
    MLP down_proj that init leaves at zero (the experts have no dense copy) is trained away from zero."""
    from click.testing import CliRunner

    from dflash_trt.cli import cli
    from dflash_trt.models.checkpoints import load_drafter

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):", "The sky is", "One two")))
    out = tmp_path / "trained"
    res = CliRunner().invoke(cli, ["train-drafter", "--target", str(pair[0]), "--out", str(out), "--prompts",
                                   str(prompts), "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "1,2",
                                   "--max-new-tokens", "8", "--mask-token-id", "16", "--anchors", "2",
                                   "--max-steps", "2", "--draft-vocab-size", "64"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 2 and info["data"]["samples"] == 3 and info["init"]["mode"] == "target"
    assert load_drafter(out).layers[0].mlp.down_proj.weight.any()  # trained from zero
