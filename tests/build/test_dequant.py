"""The CPU runtime's dequantized weights are the values ModelOpt's quantizers produce (its fake-quant of
each weight), for FP8 and NVFP4 unified checkpoints."""

import pytest
import torch

from dflash_trt.build.quantize import calibration_token_ids, hf_forward_loop, quantize_model
from dflash_trt.models.dequant import dequantize_tensors, quant_algo, read_dequantized, unpack_nvfp4


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_dequantized_weights_equal_modelopt_fake_quant(quant, tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = tiny_pair
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompts = calibration_token_ids(AutoTokenizer.from_pretrained(str(target)), 4)
    model = quantize_model(model, quant, "auto", hf_forward_loop(prompts))
    # the export first gives fused layers (q/k/v, gate/up) one shared input/weight scale, as TensorRT-LLM
    # fuses them; the reference is ModelOpt's fake-quant AFTER that step
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    requantize_resmooth_fused_llm_layers(model)
    with torch.no_grad():
        expected = {f"{name}.weight": m.weight_quantizer(m.weight).float().clone()
                    for name, m in model.named_modules() if getattr(m, "weight_quantizer", None) is not None
                    and m.weight_quantizer.is_enabled}
    assert len(expected) == 4 * 7  # q, k, v, o, gate, up, down in each of 4 layers; lm_head stays unquantized
    from modelopt.torch.export import export_hf_checkpoint

    with torch.inference_mode():  # float32 export: the packed values are exactly the fake-quant ones
        export_hf_checkpoint(model, dtype=torch.float32, export_dir=str(tmp_path / "hf"))
    assert quant_algo(tmp_path / "hf") == quant.upper()
    got = read_dequantized(tmp_path / "hf")
    for name, want in expected.items():
        # NVFP4: bit-exact; FP8: value * scale vs ModelOpt's x * (448 / amax) ... differ by float rounding only
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7 if quant == "fp8" else 0, msg=name)
    assert got["model.embed_tokens.weight"].dtype == torch.float32


def test_unpack_nvfp4_by_hand():
    # one row of 16 values: codes 0..15 -> [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6]; low nibble first
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[1::2] << 4 | codes[0::2]).view(1, 8)
    scale = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    out = unpack_nvfp4(packed, scale, torch.tensor(0.5))
    assert out.tolist() == [[0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]]


def test_quantized_weight_without_scale_is_a_clear_error():
    from dflash_trt.errors import CheckpointError

    with pytest.raises(CheckpointError, match="x.weight has no x.weight_scale"):
        dequantize_tensors({"x.weight": torch.zeros(2, 2).to(torch.float8_e4m3fn)}, "FP8")
    with pytest.raises(CheckpointError, match="quant_algo 'W4A8_AWQ' is not supported"):
        dequantize_tensors({}, "W4A8_AWQ")
