"""Acceptance builds: SmolLM2-135M-Instruct + the default drafter, --quant none|fp8|nvfp4 at --tp-size 1 and 3,
on CPU. Each bundle: shards reassemble to the unsharded checkpoint, and greedy DFlash == greedy AR of the
SAME quantized target. About 40 s per build: marked slow."""

import json

import pytest
import torch
from build_helpers import build_bundle

from dflash_trt.build.sharding import ShardSpec, merge_state_dicts, tensors_equal
from dflash_trt.build.trtllm import read_trtllm_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4"])
def test_smollm2_build(quant, tp, tmp_path, smollm2_path):
    from dflash_trt.api import load_bundle
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.runtime.sampling import SamplingParams

    out = tmp_path / f"smollm2-{quant}-tp{tp}"
    report = build_bundle(smollm2_path, default_drafter_path(), out, quant=quant, tp_size=tp, calib_size=8)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tp_size"] == tp and manifest["quantization"]["target"] == quant
    assert manifest["target_layer_ids"] == [1, 8, 14, 20, 27] and manifest["max_draft_len"] == 15

    config, ranks = read_trtllm_ranks(out / "trtllm_checkpoint")
    assert config["mapping"]["tp_size"] == tp and len(ranks) == tp
    assert config["architecture"] == "LlamaForCausalLM" and config["rotary_base"] == 100000  # SmolLM2's rope_theta
    merged = merge_state_dicts(ranks, ShardSpec.from_trtllm_config(config, tp))
    qkv = merged["transformer.layers.0.attention.qkv.weight"]
    assert qkv.shape[0] == (9 + 3 + 3) * 64 and merged["lm_head.weight"].shape == (49152, 576)
    assert ranks[0]["transformer.layers.0.attention.qkv.weight"].shape[0] == (9 + 6) * 64 // tp
    if tp == 3:  # the ranks are disjoint pieces: splitting the merged tensors again gives them back bit for bit
        from dflash_trt.build.sharding import split_state_dict

        again = split_state_dict(merged, ShardSpec.from_trtllm_config(config, tp))
        assert all(tensors_equal(again[r][k], ranks[r][k]) for r in range(tp) for k in ranks[r])
    expected_dtype = {"none": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[quant]
    assert merged["transformer.layers.5.mlp.fc.weight"].dtype == expected_dtype

    pipe = load_bundle(out)
    prompts = [pipe.encode_chat("What is the capital of France?"), pipe.encode("def is_prime(n):")]
    params = SamplingParams(max_tokens=32)
    spec, ar = pipe.generate(prompts, params, "dflash"), pipe.generate(prompts, params, "ar")
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert "Paris" in spec[0].text
    assert report.sizes["trtllm/target"] > 0
