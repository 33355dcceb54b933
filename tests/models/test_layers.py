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
