"""The product on Qwen2 (Qwen2.5) and Mistral targets with sliding-window layers: init-drafter, check, generate
(DFlash == autoregressive), train-drafter, and the OpenAI server over real HTTP."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_trt.cli import cli
from tests.build.build_helpers import QWEN3_TINY, write_tiny_target

#: a window of 8 positions: every prompt below (a chat template) is longer
WINDOWS = {"qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
           "mistral": dict(sliding_window=8)}


@pytest.fixture(scope="module", params=list(WINDOWS))
def pair(request, tmp_path_factory, smollm2_path):
    """(target folder, drafter folder from `dflash-trt init-drafter`)."""
    root = tmp_path_factory.mktemp(request.param)
    target = write_tiny_target(root / "target", smollm2_path, model_type=request.param, **QWEN3_TINY,
                               **WINDOWS[request.param])
    res = CliRunner().invoke(cli, ["init-drafter", "--target", str(target), "--out", str(root / "drafter"),
                                   "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "1,2"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return target, root / "drafter"


def test_check_and_generate(pair):
    target, drafter = pair
    res = CliRunner().invoke(cli, ["check", "--target", str(target), "--drafter", str(drafter)])
    assert res.exit_code == 0, res.output
    outs = {}
    for mode in ("dflash", "ar"):
        res = CliRunner().invoke(cli, ["generate", "--target", str(target), "--drafter", str(drafter), "--chat",
                                       "Name three colours.", "--max-tokens", "24", "--min-tokens", "24", "--json",
                                       "--mode", mode, "--dtype", "float32"])
        assert res.exit_code == 0, res.output + repr(res.exception)
        outs[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    assert outs["dflash"]["token_ids"] == outs["ar"]["token_ids"] and len(outs["ar"]["token_ids"]) == 24


def test_train_drafter(pair, tmp_path):
    target, _ = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ("def add(a, b):", "The capital of France is", "Once upon a time", "import os\n")))
    out = tmp_path / "trained"
    res = CliRunner().invoke(cli, ["train-drafter", "--target", str(target), "--out", str(out), "--prompts",
                                   str(prompts), "--num-layers", "1", "--block-size", "4", "--epochs", "1",
                                   "--target-layer-ids", "1,2", "--max-new-tokens", "12", "--anchors", "2"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    info = json.loads((out / "training.json").read_text())
    assert info["data"]["samples"] == 4 and info["steps"] >= 1


def test_openai_server(pair):
    from openai import OpenAI

    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams
    from tests.serve.test_openai_server import MODEL, chat_ids, live_server

    pipe = load_pipeline(str(pair[0]), str(pair[1]), "float32", draft_confidence=0.0, tree_topk=1, prompt_lookup=0,
                         max_concurrency=None)
    messages = [{"role": "user", "content": "Name three colours."}]
    [ar] = pipe.generate([chat_ids(pipe, messages)], SamplingParams(max_tokens=16, ignore_eos=True), mode="ar")
    with live_server(pipe) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == pipe.tokenizer.decode(ar.token_ids, skip_special_tokens=True)
    assert got.usage.completion_tokens == 16
