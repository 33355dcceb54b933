"""The data cache: responses are the target's greedy output, features equal a teacher-forced forward."""

import json

import torch

from conftest import DATA_LAYERS, EOS
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.sampling import SamplingParams


def test_responses_are_greedy_target_output(tiny_target, tiny_prompts, tiny_samples):
    by_index = {s["index"]: s for s in tiny_samples}
    assert sorted(by_index) == list(range(len(tiny_prompts)))
    engine = Engine(tiny_target, None, (EOS,))
    ref = engine.generate(tiny_prompts[:3], SamplingParams(max_tokens=40), mode="ar")
    for i, r in enumerate(ref):
        assert by_index[i]["tokens"].tolist() == tiny_prompts[i] + r.token_ids
        assert by_index[i]["prompt_len"] == len(tiny_prompts[i])


def test_recorded_features_match_teacher_forced_forward(tiny_target, tiny_samples):
    s = tiny_samples[0]
    tokens = s["tokens"][:-1].long()[None]
    t = tokens.shape[1]
    cache = tiny_target.new_cache(1, t)
    out = tiny_target(tokens, torch.arange(t)[None], cache, t, None, DATA_LAYERS)
    assert s["features"].shape == (t, len(DATA_LAYERS) * 64)
    assert s["features"].dtype == torch.bfloat16
    torch.testing.assert_close(s["features"].float(), out.features[0].to(torch.bfloat16).float(), atol=0.05, rtol=0.02)


def test_manifest_totals_and_rerun_reuses_shards(tiny_data_dir, tiny_samples):
    manifest = json.loads((tiny_data_dir / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["totals"]["samples"] == len(tiny_samples) == 24
    resp = sum(len(s["tokens"]) - s["prompt_len"] for s in tiny_samples)
    assert manifest["totals"]["response_tokens"] == resp
