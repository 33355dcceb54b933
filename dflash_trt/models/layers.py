"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU MLP, attention.

Parameter names follow Hugging Face (`weight`, `gate_proj`, ...) so checkpoints load by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama/Qwen3): x * rsqrt(mean(x^2) + eps) * weight, computed in float32.

    Input [..., dim] any float dtype; output the input dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin attention factor for RoPE.

    Supports plain RoPE (`scaling` None), "linear" (position interpolation), "llama3" (Llama 3.1
    frequency-band scaling) and "yarn" (arXiv 2309.00071), with the parameters of HF config.json.
    """
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = scaling.get("factor") or max_position_embeddings / original
        factor = float(factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        interpolated = inv_freq / factor
        return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attn)
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate-half) RoPE with a precomputed cos/sin table.

    `forward(positions)` with positions int64 [...] returns (cos, sin), each [..., head_dim] float32.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        self.inv_freq = inv_freq  # plain attribute: stays float32 when the module is cast
        self._table_len = 0
        self._cos = self._sin = None

    def _grow(self, length: int, device: torch.device) -> None:
        length = max(length, 2 * self._table_len, 256)
        # normal tensors even when first called under inference_mode, so training can reuse the table
        with torch.inference_mode(False):
            t = torch.arange(length, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))
            emb = torch.cat([freqs, freqs], dim=-1)
            self._cos = emb.cos() * self.attention_factor
            self._sin = emb.sin() * self.attention_factor
        self._table_len = length

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [...] -> (cos, sin), each float32 [..., head_dim] (the attention factor folded in);
        the table grows, and moves to the positions' device, on demand."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if need > self._table_len or self._cos.device != positions.device:
            self._grow(need, positions.device)
        return self._cos[positions], self._sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, t, head_dim] by cos/sin [b, t, head_dim]; computed in x.dtype."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


#: `attention`'s mask for tq == tk queries at positions 0..tq-1 over the keys of those positions (a prefill
#: from the start): SDPA's `is_causal`, whose CPU kernel skips the masked half instead of reading a bool mask
#: (61 vs 108 ms per layer at 1,536 tokens, 1 thread of the 2-core dev CPU; the same values)
CAUSAL = "causal"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | str | None,
              scale: float) -> torch.Tensor:
    """Grouped-query attention. q [b, hq, tq, d], k/v [b, hkv, tk, d], mask bool [b, 1, tq, tk]
    (True = attend), CAUSAL (query i attends to keys 0..i; tq == tk) or None (attend everywhere).
    Returns [b, tq, hq * d].

    `enable_gqa` lets SDPA share each K/V head among its hq / hkv query heads without copying K/V
    (`repeat_interleave` copied the whole cache slice of every layer at every step): same values,
    2.8x faster for a 1-token decode and 1.7x for a 16-token verify on the 2-core dev CPU.
    """
    causal = isinstance(mask, str)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | str | None,
                   scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with a learned sink per query head (gpt-oss, transformers' GptOssAttention):
    head h's softmax over its scores q.k * scale has one more logit, sinks[h], in its denominator, whose
    probability is dropped; a query can so put less than all its weight on the keys.

    Shapes and `mask` as `attention` (q [b, hq, tq, d], k/v [b, hkv, tk, d]; sinks [hq], any float dtype).
    The scores are formed explicitly (SDPA has no sink term): [b, hq, tq, tk] in q's dtype, the softmax in
    float32. Returns [b, tq, hq * d] in v's dtype.
    """
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    g = hq // hkv  # query head h reads K/V head h // g: its scores are row block h % g of KV head h // g
    scores = (q.reshape(b, hkv, g * tq, d) @ k.transpose(-1, -2)).view(b, hq, tq, tk).float() * scale
    if isinstance(mask, str):  # CAUSAL
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()[None, None]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, tq, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :tk].to(v.dtype)
    out = probs.reshape(b, hkv, g * tq, tk) @ v  # [b, hkv, g * tq, d]
    return out.view(b, hq, tq, d).transpose(1, 2).reshape(b, tq, hq * d)


@dataclass(frozen=True)
class BlockLayout:
    """Query rows grouped in blocks for `block_attention` (drafter training: many blocks in one pass).

    context: bool [n, A, C], which context slots each of the A blocks of a row sees;
    block_size: B, the rows (and own keys) of each block (a row holds A * B queries).
    """

    context: torch.Tensor
    block_size: int


def block_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, blk_k: torch.Tensor,
                    blk_v: torch.Tensor, layout: BlockLayout, scale: float) -> torch.Tensor:
    """Grouped-query attention of A blocks of B queries each: every block sees the context slots its
    `layout.context` row allows and its own B keys (bidirectionally), never another block's.

    The same values as `attention` over cat(context, block keys) with the block-diagonal mask, but
    each query is scored against C + B keys instead of C + A * B: with A = 64, B = 16, C ~ 350
    (the trainer's default) forward + backward of one layer's attention took 130 ms instead of
    440 ms in bfloat16 (550 vs 620 ms in float32), 1 thread of the 2-core dev CPU (session 16).

    Args:
        q: [n, hq, A*B, d]; ctx_k, ctx_v: [n, hkv, C, d]; blk_k, blk_v: [n, hkv, A*B, d] (hq a
            multiple of hkv; query head h uses K/V head h // (hq / hkv)).
    Returns:
        [n, A*B, hq * d] in q's dtype (softmax in float32).
    """
    n, hq, t, d = q.shape
    hkv, c = ctx_k.shape[1], ctx_k.shape[2]
    g, b = hq // hkv, layout.block_size
    a = t // b
    qg = q.reshape(n, hkv, g, a, b, d)
    s_ctx = (q.reshape(n, hkv, g * t, d) @ ctx_k.transpose(-1, -2)).view(n, hkv, g, a, b, c)
    s_ctx = s_ctx.masked_fill(~layout.context[:, None, None, :, None, :], float("-inf"))
    s_blk = qg @ blk_k.reshape(n, hkv, 1, a, b, d).transpose(-1, -2)  # [n, hkv, g, A, B, B]
    p = (torch.cat([s_ctx, s_blk], dim=-1).float() * scale).softmax(-1).to(ctx_v.dtype)
    out = (p[..., :c].reshape(n, hkv, g * t, c) @ ctx_v).view(n, hkv, g, a, b, d)
    out = out + p[..., c:] @ blk_v.reshape(n, hkv, 1, a, b, d)
    return out.view(n, hq, t, d).transpose(1, 2).reshape(n, t, hq * d)


def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, in] @ weight[out, in]^T -> [m, out] (contiguous) for a large row-major output head.

    The same product as F.linear(x, weight); only the operand order depends on m. MKL (torch
    2.13 CPU, 1 thread, AVX-512) runs x @ W^T at memory speed for m <= 3 and m >= 16 but 2-3x
    slower for 4 <= m <= 15 (a 49152 x 576 head: 62 ms for 15 rows, 24 ms for 16), while
    (W @ x^T)^T runs at memory speed for 4 <= m <= 48 (22-33 ms; measured on the 2-core dev
    machine). Lazy verification and the drafter's 15-row draft head land exactly in that gap.
    Other devices take the plain product.
    """
    if x.device.type == "cpu" and 4 <= x.shape[0] <= 48:
        return torch.mm(weight, x.t()).t().contiguous()
    return torch.mm(x, weight.t())


def use_transposed_weight_layout(module: nn.Module) -> nn.Module:
    """Store every nn.Linear weight [out, in] as a transposed view of a contiguous [in, out] tensor.

    Same values, same shapes and names (state_dict is unchanged but for strides); F.linear then
    multiplies by a contiguous [in, out] matrix, which the CPU BLAS runs 1.3-2.4x faster for the
    16-row verify/draft passes in float32 (measured on the 2-core dev machine). A tied lm_head
    (the embedding) is left as is: the embedding gathers rows.
    """
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            w = sub.weight
            sub.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
    return module


class AttentionProjections(nn.Module):
    """q/k/v/o projections (HF names) and optional per-head q_norm/k_norm of a GQA attention layer.

    q_proj: hidden -> heads * head_dim; k_proj, v_proj: hidden -> kv_heads * head_dim;
    o_proj: heads * head_dim -> hidden. `bias`: biases on q/k/v, and on o_proj unless `o_bias` says otherwise
    (Qwen2: q/k/v biased, o_proj not).
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm: bool, eps: float,
                 o_bias: bool | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias if o_bias is None else o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.scale = head_dim**-0.5
