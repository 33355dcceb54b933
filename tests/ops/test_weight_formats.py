"""The packed kernel's exact weight formats (dflash_trt/ops/csrc/pack_gguf.cpp, packed_linear.cpp): a weight
that is exactly GGUF Q4_1 / Q8_0 blocks or bfloat16 values is stored so, and every format gives the float32
format's output bit for bit; a weight one bit off any format stays float32."""

import pytest
import torch

from dflash_trt.ops import cpu_kernels_unavailable
from dflash_trt.ops.packed_linear import PackedLinear, pack_exact

pytestmark = pytest.mark.skipif(cpu_kernels_unavailable() is not None, reason=str(cpu_kernels_unavailable()))


def q4_1_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [n, k] weights quantized to Q4_1 and dequantized as llama.cpp does (quantize_row_q4_1_ref:
    d = (max - min) / 15, q = (int)((x - min) / d + 0.5) <= 15, d and m stored as float16); returns
    (dequantized float32 weights, q)."""
    g = torch.Generator().manual_seed(seed)
    blocks = (torch.randn(n, k // 32, 32, generator=g) * 0.05)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = ((blocks - lo) * torch.where(d > 0, 1 / d, 0.0) + 0.5).floor().clamp(max=15)
    return (d.half().float() * q + lo.half().float()).view(n, k), q.view(n, k).to(torch.uint8)


def q8_0_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Random [n, k] weights through llama.cpp's Q8_0 (d = max|x| / 127, q = round(x / d), d float16)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(n, k // 32, 32, generator=g) * 0.05
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / d)
    return (d.half().float() * q).view(n, k)


def f32_and_exact(w: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[PackedLinear, PackedLinear]:
    return PackedLinear(w, bias, formats=("float32",)), PackedLinear(w, bias)


@pytest.mark.parametrize("n,k", [(576, 576), (1536, 576), (576, 1536), (50, 64), (7, 32)])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "bfloat16"])
def test_exact_formats_give_the_float32_output_bit_for_bit(n, k, kind):
    g = torch.Generator().manual_seed(n + k)
    if kind == "q4_1":
        w = q4_1_weights(n, k, seed=n)[0]
    elif kind == "q8_0":
        w = q8_0_weights(n, k, seed=n)
    else:
        w = torch.randn(n, k, generator=g).bfloat16().float()
    bias = torch.randn(n, generator=g)
    f32, exact = f32_and_exact(w, bias)
    assert (f32.format, exact.format) == ("float32", kind)
    bytes_per_weight = (exact.packed.numel() * exact.packed.element_size()
                        + (0 if exact.scales is None else exact.scales.numel() * 2)) / (-(-n // 32) * 32 * k)
    assert bytes_per_weight == {"q4_1": 0.625, "q8_0": 1.0625, "bfloat16": 2.0}[kind]
    x = torch.randn(40, k, generator=g)
    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 40):  # fused passes of <= 8 rows up to 16, then expanded
        assert torch.equal(exact(x[:rows]), f32(x[:rows])), f"{rows} rows"


def test_q4_1_layout_and_scales():
    w, q = q4_1_weights(40, 64, seed=3)
    fmt, packed, scales = pack_exact(w)
    assert fmt == "q4_1" and packed.shape == (2, 64, 16) and packed.dtype == torch.uint8
    assert scales.shape == (2, 2, 2, 32) and scales.dtype == torch.float16
    assert packed[0, 5, 3].item() & 0xF == q[3, 5].item() and packed[0, 5, 3].item() >> 4 == q[19, 5].item()
    assert packed[1, 63, 7].item() & 0xF == q[39, 63].item() and packed[1, 63, 7].item() >> 4 == 0  # row 55 > N
    d, m = scales[1, 1, 0, 7].float(), scales[1, 1, 1, 7].float()  # row 39, inputs 32-63
    assert torch.equal(d * q[39, 32:].float() + m, w[39, 32:])
    assert torch.count_nonzero(scales[1, :, :, 8:]) == 0


def test_one_bit_off_or_a_ragged_width_stays_float32():
    w = q4_1_weights(64, 64, seed=4)[0]
    off = w.clone()
    off.view(torch.int32)[10, 20] += 1  # the next float32 after one value: no longer Q4_1, Q8_0 or bf16
    f32, exact = f32_and_exact(off)
    assert exact.format == "float32"
    x = torch.randn(3, 64)
    assert torch.equal(exact(x), f32(x))
    assert pack_exact(q4_1_weights(64, 64, seed=5)[0][:, :48])[0] == "float32"  # 48 inputs: no 32-blocks
    assert pack_exact(w, formats=("q8_0", "float32"))[0] == "float32"  # Q4_1 weights are not Q8_0
    assert pack_exact(torch.zeros(32, 64))[0] == "q4_1"  # all-zero blocks: d = m = 0


def test_a_quantized_weight_without_its_scales_is_refused():
    layer = PackedLinear(q4_1_weights(64, 64, seed=6)[0])
    x = torch.randn(5, 64)
    assert layer.format == "q4_1"
    with pytest.raises(RuntimeError, match="a quantized weight needs contiguous float16 scales"):
        torch.ops.dflash_trt.packed_linear(x, layer.packed, None, None, 64)


def test_smollm2_runs_q4_1_layers_a_q8_0_head_and_a_bfloat16_drafter(smollm2_pipeline):
    """The default model is converted from a GGUF Q4_1 file (token embedding Q8_0), the drafter ships in bf16:
    every weight is held exactly at 0.6-2 bytes instead of 4."""
    target = smollm2_pipeline.engine.target
    layers = {m.format for m in target.model.modules() if isinstance(m, PackedLinear)}
    assert layers == {"q4_1"} and target.packed_head.format == "q8_0"
    proposer = smollm2_pipeline.engine.proposer
    assert {m.format for m in proposer.drafter.modules() if isinstance(m, PackedLinear)} == {"bfloat16"}
    assert proposer.packed_draft_head.format == "q8_0"
