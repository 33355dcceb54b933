"""The drafter's cached, batched block forward vs a direct transcription of the reference
implementation's block forward (z-lab/dflash dflash/model.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import init_drafter, load_drafter, new_drafter_config


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):  # x [t, h, d], NeoX rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference_block(drafter, features, block_embeds, start):
    """One row, no cache: context = all `start` feature rows, block at positions start..start+B-1."""
    c = drafter.config
    sd = drafter.state_dict()
    h_ctx = rms(features @ sd["fc.weight"].t(), sd["hidden_norm.weight"], c.rms_norm_eps)
    x = block_embeds
    b = x.shape[0]
    ctx_pos, blk_pos = torch.arange(start), torch.arange(start, start + b)
    for i in range(c.num_hidden_layers):
        p = lambda n: sd[f"layers.{i}.{n}"]  # noqa: E731
        hx = rms(x, p("input_layernorm.weight"), c.rms_norm_eps)
        q = rms((hx @ p("self_attn.q_proj.weight").t()).view(b, -1, c.head_dim), p("self_attn.q_norm.weight"), c.rms_norm_eps)
        k_in = torch.cat([h_ctx, hx])  # K = k_norm(concat[k_proj(H_ctx), k_proj(x_block)])
        k = rms((k_in @ p("self_attn.k_proj.weight").t()).view(start + b, -1, c.head_dim), p("self_attn.k_norm.weight"), c.rms_norm_eps)
        v = (k_in @ p("self_attn.v_proj.weight").t()).view(start + b, -1, c.head_dim)
        q, k = rope(q, blk_pos, c.rope_theta), rope(k, torch.cat([ctx_pos, blk_pos]), c.rope_theta)
        g = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / c.head_dim**0.5, -1)  # no causal mask
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(b, -1)
        x = x + o @ p("self_attn.o_proj.weight").t()
        hx = rms(x, p("post_attention_layernorm.weight"), c.rms_norm_eps)
        x = x + (F.silu(hx @ p("mlp.gate_proj.weight").t()) * (hx @ p("mlp.up_proj.weight").t())) @ p("mlp.down_proj.weight").t()
    return rms(x, sd["norm.weight"], c.rms_norm_eps)


def test_cached_batched_drafter_matches_reference(tmp_path):
    tcfg = TargetConfig(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                        rope_theta=10000.0)
    dcfg = new_drafter_config(tcfg, num_layers=2, block_size=5, mask_token_id=49, target_layer_ids=[1, 3, 5])
    drafter = load_drafter(init_drafter(dcfg, tmp_path / "d", seed=3))
    with torch.no_grad():  # make norms non-trivial
        for n, prm in drafter.named_parameters():
            if "norm" in n:
                prm.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(0)
    starts = [7, 12]
    feats = torch.randn(2, 12, 96, generator=g)
    blocks = torch.randn(2, 5, 32, generator=g)
    cache = drafter.new_cache(2, 32)
    # inject context in two ragged chunks per row, as the engine does (padding slots stay masked)
    drafter.inject_context(feats[:, :4], torch.arange(4).expand(2, 4), cache)
    drafter.inject_context(feats[:, 4:], torch.arange(4, 12).expand(2, 8), cache)
    ctx = torch.tensor(starts)
    pos = ctx[:, None] + torch.arange(5)
    with torch.no_grad():
        out = drafter(blocks, pos, cache, ctx, max(starts))
        for r, s in enumerate(starts):
            ref = reference_block(drafter, feats[r, :s], blocks[r], s)
            torch.testing.assert_close(out[r], ref, rtol=1e-4, atol=1e-5)
        # the proposer's lazy path: the last layer's rows in separate calls over one encoded block
        state = drafter.encode_block(blocks, pos, cache, ctx, max(starts))
        parts = [drafter.block_outputs(state, lo, hi) for lo, hi in ((1, 3), (3, 5), (0, 1))]
    assert [p.shape for p in parts] == [(2, 2, 32), (2, 2, 32), (2, 1, 32)]
    torch.testing.assert_close(torch.cat([parts[2], parts[0], parts[1]], 1), out, rtol=1e-5, atol=1e-6)
