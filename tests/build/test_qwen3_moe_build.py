"""`dflash-trt build` of a Qwen3-MoE target: ModelOpt FP8 / NVFP4 quantizes every expert, the PyTorch backend's HF
checkpoint (trtllm/target/) holds them per expert with their scales and loads back as the quantized target, and
the TensorRT engine flow's per-rank checkpoint is not written (refused by name, the other loaders named)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.errors import BuildError
from tests.build.build_helpers import assert_greedy_dflash_equals_ar
from tests.models.qwen3_moe_helpers import make_moe_model, write_moe_drafter


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("moe-build")
    _, target = make_moe_model(root / "target", tokenizer_from=smollm2_path, vocab_size=49152)
    return target, write_moe_drafter(root / "drafter", target)


@pytest.mark.parametrize("quant, tolerance", [("fp8", 1 / 16), ("nvfp4", 1 / 5)])
def test_a_quantized_moe_bundle_serves_with_the_pytorch_backend_files_only(tmp_path, moe_pair, quant, tolerance):
    from dflash_trt.api import load_bundle
    from dflash_trt.build.pipeline import BuildOptions, run_build
    from dflash_trt.models.checkpoints import _read_weights
    from dflash_trt.models.loading import read_tensors

    lines: list[str] = []
    out = tmp_path / f"moe-{quant}"
    run_build(BuildOptions(target=moe_pair[0], drafter=moe_pair[1], out=out, quant=quant, tp_size=2, calib_size=4),
              log=lines.append)
    assert any(line.startswith("warning: trtllm_checkpoint/ (TensorRT-LLM's per-rank checkpoint for the TensorRT "
                               "engine flow, 1.2.x - 1.3.0rc20) is not written for a mixture-of-experts target "
                               "(qwen3_moe, 8 experts)") for line in lines), lines
    assert any("skipped: a mixture-of-experts target, qwen3_moe" in line for line in lines), lines
    assert not (out / "trtllm_checkpoint").exists() and (out / "trtllm" / "serve.yaml").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["trtllm_checkpoint"] is None and manifest["quantization"]["target"] == quant
    readme = (out / "README.md").read_text()
    assert "this bundle has no trtllm_checkpoint/" in readme and "build_engine.sh" not in readme
    assert ("kept in bfloat16: embeddings, norms, and the modules trtllm/target/config.json's "
            "`quantization_config.ignore` lists (lm_head; a mixture-of-experts target's routers, `mlp.gate`)") in readme
    hf = out / "trtllm" / "target"
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["quantization_config"]["quant_algo"] == quant.upper()
    assert {"lm_head", "model.layers.0.mlp.gate"} <= set(cfg["quantization_config"]["ignore"])  # routers unquantized
    stored = read_tensors(hf)
    assert stored["model.layers.2.mlp.experts.7.down_proj.weight"].dtype == (torch.float8_e4m3fn if quant == "fp8"
                                                                             else torch.uint8)
    assert "model.layers.2.mlp.experts.7.down_proj.weight_scale" in stored
    source, loaded = read_tensors(moe_pair[0]), _read_weights(hf, torch.float32, "cpu")
    assert sorted(loaded) == sorted(source)
    for key in (k for k in source if ".experts." in k):  # each expert dequantizes to its source within the format
        assert float((loaded[key] - source[key]).abs().max() / source[key].abs().max()) < tolerance, key
    pipe = load_bundle(out, draft_confidence=0.0, tree_topk=1, prompt_lookup=0, max_concurrency=None)
    assert_greedy_dflash_equals_ar(pipe, max_tokens=12)


def test_the_engine_flow_checkpoint_is_refused_for_a_moe_target(moe_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_trt.build.trtllm import export_trtllm_checkpoint

    model = AutoModelForCausalLM.from_pretrained(str(moe_pair[0]), dtype=torch.float32)
    with pytest.raises(BuildError, match=r"is not written for a mixture-of-experts target \(qwen3_moe, 8 experts\): "
                                         r"its MoE layout is not supported by dflash-trt build. The bundle serves with "
                                         r"TensorRT-LLM's PyTorch backend \(trtllm/launch.sh"):
        export_trtllm_checkpoint(model, tmp_path / "ckpt", 1, tmp_path, 3, 512)
    assert not (tmp_path / "ckpt").exists()
