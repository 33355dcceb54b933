from __future__ import annotations

import torch

from dflash_trt.models.layers import RotaryEmbedding, apply_rope


def test_rope_table_built_under_inference_mode_still_trains():
    rope = RotaryEmbedding(8, 10000.0, None, 64)
    with torch.inference_mode():
        rope(torch.arange(4)[None])  # first use inside inference_mode (as the engine does)
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    cos, sin = rope(torch.arange(4)[None])
    apply_rope(x, cos, sin).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_inference_weight_layouts_keep_values_and_state_dict():
    """use_transposed_weight_layout: `weight` becomes a transposed view of a contiguous [in, out]
    tensor; on the CPU a `Linear` also keeps the row-major copy for 2-3-row inputs. Every row count
    gives F.linear's values; the state_dict (names, shapes, values) is unchanged."""
    import torch.nn.functional as F

    from dflash_trt.models.layers import SwiGLU, use_transposed_weight_layout

    torch.manual_seed(0)
    mlp = SwiGLU(16, 40)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    x = torch.randn(6, 16)
    ref = {m: mlp(x[:m]) for m in range(1, 7)}
    assert all(layer.rows_weight is None for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    use_transposed_weight_layout(mlp.eval().requires_grad_(False))
    after = mlp.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        assert layer.weight.stride() == (1, layer.out_features)  # a view of a contiguous [in, out] tensor
        assert layer.rows_weight.is_contiguous() and torch.equal(layer.rows_weight, layer.weight)
    with torch.inference_mode():
        for m in range(1, 7):
            torch.testing.assert_close(mlp(x[:m]), ref[m], rtol=1e-5, atol=1e-6)
        # 2 and 3 rows multiply by the row-major copy: bit-identical to F.linear on a row-major weight
        for m in (2, 3):
            h = x[:m]
            row_major = F.linear(F.silu(F.linear(h, before["gate_proj.weight"])) * F.linear(h, before["up_proj.weight"]),
                                 before["down_proj.weight"])
            assert torch.equal(mlp(h), row_major)
