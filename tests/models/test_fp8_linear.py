"""Fp8Linear computes W8A8 exactly as defined: (x quantized with input_scale, dequantized) @ (FP8 weight
x weight_scale)^T, for 2-D and 3-D inputs, with and without bias; and the fp8_matmul switch resolves
as documented. Runs `torch._scaled_mm` on the CPU (the op the GPU path calls)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import ConfigError
from dflash_trt.models.fp8 import E4M3_MAX, Fp8Linear, quantize_fp8, resolve_fp8_matmul


def fp8_linear(in_features=64, out_features=48, bias=False, dtype=torch.float32, seed=0):
    """An Fp8Linear holding a random weight quantized per tensor, and its input scale for |x| <= 3."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.1
    layer = Fp8Linear(in_features, out_features, bias, dtype)
    layer.weight_scale = w.abs().max() / E4M3_MAX
    layer.weight = (w / layer.weight_scale).to(torch.float8_e4m3fn)
    layer.input_scale = torch.tensor(3.0) / E4M3_MAX
    if bias:
        layer.bias = torch.randn(out_features, generator=gen).to(dtype)
    return layer


def reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """Float64 (quantize-dequantize x) @ (dequantized W)^T + bias."""
    xq = quantize_fp8(x, layer.input_scale).double() * layer.input_scale.double()
    w = layer.weight.double() * layer.weight_scale.double()
    out = xq @ w.t()
    return out if layer.bias is None else out + layer.bias.double()


@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_the_quantize_dequantize_reference(shape, bias):
    layer = fp8_linear(bias=bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert out.shape == (*shape[:-1], 48) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(layer, x), rtol=1e-5, atol=1e-5)
    # activations really are quantized: the unquantized-x product differs by far more than the tolerance
    exact = x.double() @ (layer.weight.double() * layer.weight_scale.double()).t()
    assert (out.double() - (exact if layer.bias is None else exact + layer.bias.double())).abs().max() > 1e-3


def test_fp8_linear_in_bfloat16_and_clamps_outliers():
    layer = fp8_linear(dtype=torch.bfloat16, bias=True)
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[0, 0, 0] = 50.0  # beyond input_scale * 448 = 3: clamped to 3, as TensorRT-LLM does
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(layer, x), rtol=1e-2, atol=1e-2)
    assert quantize_fp8(torch.tensor([50.0, -50.0]), layer.input_scale).float().tolist() == [448.0, -448.0]


def test_resolve_fp8_matmul():
    assert resolve_fp8_matmul("auto", "FP8", "cpu", "t") is False  # CPU: dequantize path
    assert resolve_fp8_matmul("off", "FP8", "cpu", "t") is False
    assert resolve_fp8_matmul("on", "FP8", "cpu", "t") is True
    assert resolve_fp8_matmul("auto", None, "cpu", "t") is False
    with pytest.raises(ConfigError, match=r"needs an FP8 checkpoint, but the target at /x is unquantized; "
                                          r"use --fp8-matmul auto or off"):
        resolve_fp8_matmul("on", None, "cpu", "the target at /x")
    with pytest.raises(ConfigError, match=r"is NVFP4-quantized \(dequantized on load\)"):
        resolve_fp8_matmul("on", "NVFP4", "cpu", "t")
    with pytest.raises(ConfigError, match="fp8_matmul must be one of auto, on, off, got 'yes'"):
        resolve_fp8_matmul("yes", "FP8", "cpu", "t")
    with pytest.raises(ConfigError, match="no FP8 matmul on device meta"):
        resolve_fp8_matmul("on", "FP8", "meta", "t")
