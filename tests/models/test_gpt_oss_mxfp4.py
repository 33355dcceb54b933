"""MXFP4 gpt-oss checkpoints (openai/gpt-oss-20b's layout: experts as `*_blocks` / `*_scales`, config.json
quantization_config quant_method "mxfp4"): our dequantization vs transformers' own, a tiny checkpoint written in
that layout vs transformers loading it and vs the unquantized model, and `dflash-trt check`'s header shapes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.errors import CheckpointError
from dflash_trt.models.checkpoints import load_target
from dflash_trt.models.dequant import quant_algo, unpack_mxfp4
from tests.models.gpt_oss_helpers import make_gpt_oss_model, pack_mxfp4, write_mxfp4_copy
from tests.models.test_qwen3_moe import hf_step_logits, our_step_logits


def test_unpack_equals_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 64, 40, generator=g) * torch.logspace(-3, 2, 40)  # groups of very different scales
    blocks, scales = pack_mxfp4(w)
    blocks[0, 0, 0] = torch.arange(0, 256, 16, dtype=torch.uint8)  # every code in both nibbles
    ours = unpack_mxfp4(blocks, scales)
    assert (blocks.shape, scales.shape, ours.shape) == ((3, 40, 2, 16), (3, 40, 2), (3, 64, 40))
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(unpack_mxfp4(blocks, scales, torch.bfloat16),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))
    # within the format's error: half the widest gap between E2M1 neighbours (4 -> 6) times the group's scale
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127).repeat_interleave(32, -1).transpose(1, 2)
    err = (ours - w).abs()
    err[0, :32, 0] = 0  # the group overwritten above
    assert bool((err <= step).all())


def test_bad_blocks_are_named():
    blocks, scales = pack_mxfp4(torch.randn(2, 32, 8))
    with pytest.raises(CheckpointError, match=r"MXFP4 blocks of shape \[2, 8, 1, 16\] and scales of shape \[2, 8\] "
                                              r"do not fit"):
        unpack_mxfp4(blocks, scales[..., 0])
    with pytest.raises(CheckpointError, match=r"must be uint8 .*got torch.float32 and torch.uint8"):
        unpack_mxfp4(blocks.float(), scales)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(hf model, unquantized folder, MXFP4 folder)."""
    root = tmp_path_factory.mktemp("mxfp4")
    hf, plain = make_gpt_oss_model(root / "plain", seed=4)
    return hf, plain, write_mxfp4_copy(plain, root / "mxfp4")


def test_an_mxfp4_checkpoint_gives_transformers_logits(folders):
    """Ours on the MXFP4 folder == transformers' GptOssForCausalLM loading the same folder (it dequantizes the
    experts to bfloat16 on a CPU: exact for these values), prefill and cached decode steps; the experts hold the
    dequantized values of the unquantized checkpoint's, within the format's error."""
    from transformers import GptOssForCausalLM

    _, plain, mxfp4 = folders
    assert quant_algo(mxfp4) == "MXFP4" and quant_algo(plain) is None
    hf = GptOssForCausalLM.from_pretrained(mxfp4, dtype=torch.float32, attn_implementation="eager",
                                           experts_implementation="eager").float().eval()
    ours = load_target(mxfp4)
    ids = torch.randint(3, 96, (1, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = hf_step_logits(hf, ids, [5, 77, 31]), our_step_logits(ours, ids, [5, 77, 31])
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, rtol=0, atol=2e-5)
    full = load_file(plain / "model.safetensors")["model.layers.1.mlp.experts.down_proj"]
    got = ours.model.layers[1].mlp.experts.down_proj
    assert 0 < float((got - full).abs().max()) <= float(full.abs().max()) / 4  # rounded, not garbage


def test_an_mxfp4_checkpoint_loads_in_bfloat16(folders):
    _, _, mxfp4 = folders
    model = load_target(mxfp4, dtype=torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(experts.gate_up_proj.float(), load_target(mxfp4).model.layers[0].mlp.experts.gate_up_proj)


def test_a_missing_half_and_check_header_shapes(folders, tmp_path):
    from dflash_trt.compat import _weight_shape_problems, _expected_shapes
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.target import TargetModel

    _, _, mxfp4 = folders
    expected = _expected_shapes(TargetModel, TargetConfig.from_pretrained(mxfp4))
    assert _weight_shape_problems(mxfp4, expected, "target") == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((mxfp4 / "config.json").read_text())
    tensors = load_file(mxfp4 / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"MXFP4 tensor model.layers.2.mlp.experts.down_proj_blocks has no "
                                              r"model.layers.2.mlp.experts.down_proj_scales"):
        load_target(broken)
    problems = _weight_shape_problems(broken, expected, "target")
    assert any("unexpected key(s) model.layers.2.mlp.experts.down_proj_blocks" in p for p in problems)
    assert any("model.layers.2.mlp.experts.down_proj [8, 32, 64] is missing" in p for p in problems)
