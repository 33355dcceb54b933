"""The DFlash drafter (DFlash paper, arXiv 2602.06036, sec. 3; z-lab/dflash `DFlashDraftModel`).

A stack of Qwen3-style pre-norm decoder layers that denoises a whole block in one pass:
- Target features of the context tokens (the outputs of `target_layer_ids`, concatenated) are fused
  once: H = hidden_norm(fc(features)).
- KV injection: every layer i projects H with its OWN k_proj/v_proj into extra K/V rows
  (K = RoPE(k_norm(k_proj_i(H))) at the context tokens' positions, V = v_proj_i(H)). These are
  cached per committed token; H never goes through input_layernorm, o_proj or the MLP.
- The block [last verified token, MASK x (B-1)] is embedded with the TARGET's embedding; its
  queries attend to all cached context K/V and to the whole block bidirectionally ("full_attention"
  layers) or causally in a window ("sliding_attention" layers). Outputs go through the final `norm`
  and then the TARGET's lm_head (done by the proposer).
Parameter names are those of the z-lab / ModelOpt checkpoint (no `model.` prefix).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import DrafterConfig
from dflash_trt.errors import ConfigError
from dflash_trt.models.layers import (AttentionProjections, BlockLayout, RMSNorm, RotaryEmbedding, SwiGLU, apply_rope,
                                     attention, block_attention)
from dflash_trt.runtime.kv_cache import KVCache


class DrafterAttention(AttentionProjections):
    """Attention of drafter layer `layer_idx` (q_norm and k_norm always, as in Qwen3): the block's queries
    attend to the context K/V injected from target features and to the block's own K/V (DFlash paper sec. 3.2; z-lab/dflash dflash/model.py)."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.attention_bias, True, cfg.rms_norm_eps)
        self.layer_idx = layer_idx

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, t, hidden] -> (K, V) [n, kv_heads, t, head_dim]; K is k_norm'd and RoPE'd."""
        n, t, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(n, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def keys_values(self, x, cos, sin, ctx_k, ctx_v) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V a block attends to: context ctx_k/ctx_v [n, kv_heads, c, d] then the block's own,
        projected from x [n, t, hidden] (already input_layernorm'd) -> each [n, kv_heads, c + t, d]."""
        k_blk, v_blk = self.project_kv(x, cos, sin)
        return torch.cat([ctx_k, k_blk], dim=2), torch.cat([ctx_v, v_blk], dim=2)

    def queries(self, x, cos, sin) -> torch.Tensor:
        """x [n, t, hidden] (input_layernorm'd; cos/sin of those t positions) -> q [n, heads, t, d],
        q_norm'd and RoPE'd."""
        n, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, t, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def attend(self, x, cos, sin, k, v, mask):
        """Queries of x [n, t, hidden] (input_layernorm'd; cos/sin of those t positions) over k/v
        [n, kv_heads, c', d] with mask bool [n, 1, t, c'] or None -> o_proj output [n, t, hidden]."""
        return self.o_proj(attention(self.queries(x, cos, sin), k, v, mask, self.scale))

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [n, t, hidden] (already input_layernorm'd), ctx_k/ctx_v [n, kv_heads, c, d], mask bool
        [n, 1, t, c + t], None, or a `BlockLayout` (training: x holds A blocks of B rows, each seeing
        its own keys and the context slots the layout allows; `block_attention`). Returns [n, t, hidden]."""
        if isinstance(mask, BlockLayout):
            k_blk, v_blk = self.project_kv(x, cos, sin)
            return self.o_proj(block_attention(self.queries(x, cos, sin), ctx_k, ctx_v, k_blk, v_blk, mask, self.scale))
        k, v = self.keys_values(x, cos, sin, ctx_k, ctx_v)
        return self.attend(x, cos, sin, k, v, mask)


class DrafterLayer(nn.Module):
    """One pre-norm drafter layer (z-lab keys `layers.N.`): x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DrafterAttention(cfg, layer_idx)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """x [n, t, hidden] -> the layer's output [n, t, hidden]; the other arguments as
        `DrafterAttention.forward` (x here is NOT normed: the layer applies input_layernorm)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def rows(self, x, h, cos, sin, k, v, mask, lo: int, hi: int):
        """forward's output at block rows lo..hi-1 only, from the layer input x [n, t, hidden], its
        input_layernorm h and the whole block's keys/values k, v (`keys_values`): the other rows'
        queries, o_proj and MLP are skipped (every row still supplies its K/V)."""
        sl = slice(lo, hi)
        m = None if mask is None else mask[:, :, sl]
        y = x[:, sl] + self.self_attn.attend(h[:, sl], cos[:, sl], sin[:, sl], k, v, m)
        return y + self.mlp(self.post_attention_layernorm(y))


class DFlashDrafter(nn.Module):
    """The drafter network. Keys: fc, hidden_norm, layers.N.*, norm (z-lab format)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        if cfg.draft_vocab_size is not None:
            # reduced draft vocabulary: target id = draft id + d2t[draft id] (a checkpoint tensor)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None
        # the fused KV-injection path (`use_fused_injection`); plain attributes, not in the state_dict
        self._kv_all: nn.Module | None = None
        self._k_norm_all: torch.Tensor | None = None

    def use_fused_injection(self) -> None:
        """Inject context K/V with the fused op `torch.ops.dflash_trt.kv_inject`: one product over every
        layer's k_proj and v_proj weights concatenated, then k_norm, RoPE and the cache write of all layers
        in one call. On the CPU (float32; csrc/kv_inject.cpp) the product is the packed CPU kernel (each
        output as k_proj / v_proj give it: same bits); call it while k_proj / v_proj are still `nn.Linear`s
        (before `use_packed_linears`). On a CUDA GPU (float32, float16 or bfloat16; csrc/kv_inject.cu,
        `dflash_trt.ops.cuda`) the product is one cuBLAS matmul in the model dtype. Inference only.

        Raises:
            ConfigError: the op library cannot run on this device (`dflash_trt.ops.require_cpu_kernels`,
                `dflash_trt.ops.cuda.require_cuda_kernels`), or the device is neither a CPU nor CUDA.
        """
        attn = [layer.self_attn for layer in self.layers]
        weight = torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attn]).detach()
        bias = (None if attn[0].k_proj.bias is None
                else torch.cat([torch.cat([a.k_proj.bias, a.v_proj.bias]) for a in attn]).detach())
        k_norm = torch.stack([a.k_norm.weight.detach() for a in attn]).contiguous()
        device = weight.device
        if device.type == "cpu":
            from dflash_trt.ops.packed_linear import PackedLinear

            self._kv_all = PackedLinear(weight.float(), None if bias is None else bias.float())
            self._k_norm_all = k_norm.float()
        elif device.type == "cuda":
            from dflash_trt.ops.cuda import require_cuda_kernels

            require_cuda_kernels(device)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=device,
                               dtype=weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
            self._kv_all = linear.requires_grad_(False)
            self._k_norm_all = k_norm
        else:
            raise ConfigError(f"the fused KV injection runs on a CPU or a CUDA GPU, not on {device}")

    def __setattr__(self, name, value):
        if name == "_kv_all":  # a module kept out of the module tree (state_dict, .to(), use_packed_linears)
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def draft_token_ids(self) -> torch.Tensor | None:
        """int64 [draft_vocab_size] target ids of draft ids 0..k-1, or None (full vocabulary)."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty context cache (projected K/V of committed tokens) for `batch` rows."""
        cfg = self.config
        p = self.hidden_norm.weight  # model dtype and device (fc may be a packed CPU kernel: no .weight)
        return KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim, p.dtype, p.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [n, c, len(ids) * target_hidden] -> H [n, c, hidden] = hidden_norm(fc(.))."""
        return self.hidden_norm(self.fc(features.to(self.hidden_norm.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """KV injection without a cache: per layer (K, V) [n, kv_heads, c, head_dim] of context
        tokens with `features` [n, c, fc_in] at `positions` [n, c]. Reference for the fused op."""
        h = self.fuse(features)
        cos, sin = self.rotary(positions)
        return [layer.self_attn.project_kv(h, cos, sin) for layer in self.layers]

    def inject_context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       rows: torch.Tensor | None = None) -> None:
        """Write the context K/V of new committed tokens into every layer of `cache`.

        features [n, c, fc_in], positions [n, c] int64 (padding entries may point at any slot
        >= the row's committed length: they are masked until overwritten); rows [n] int64 cache rows
        (None: all). With `use_fused_injection` on and a cache of its device and dtype, one fused op call
        writes every layer; otherwise `context_kv` (the reference) and a cache write per layer.
        """
        norm = self._k_norm_all
        if (self._kv_all is not None and cache.buffer.dtype == norm.dtype
                and cache.buffer.device == norm.device):
            h = self.fuse(features)
            cos, sin = self.rotary(positions)
            rows = torch.arange(cache.batch, device=positions.device) if rows is None else rows
            torch.ops.dflash_trt.kv_inject(self._kv_all(h).contiguous(), self._k_norm_all,
                                           self.layers[0].self_attn.k_norm.eps, cos.contiguous(), sin.contiguous(),
                                           cache.buffer, rows.contiguous(), positions.contiguous())
            return
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            cache.write(i, rows, positions, k, v)

    def block_mask(self, layer_type: str, ctx_lens: torch.Tensor, max_ctx: int, block_positions: torch.Tensor) -> torch.Tensor | None:
        """Bool mask [n, 1, B, max_ctx + B]: context slot j is visible iff j < ctx_lens[r]; block
        keys are all visible (full_attention) or causal within `sliding_window` (sliding_attention)."""
        dev = block_positions.device
        n, b = block_positions.shape
        ctx_pos = torch.arange(max_ctx, device=dev).expand(n, max_ctx)
        key_pos = torch.cat([ctx_pos, block_positions], dim=1)  # [n, c + B]
        valid = torch.cat([ctx_pos < ctx_lens[:, None], torch.ones(n, b, dtype=torch.bool, device=dev)], dim=1)
        mask = valid[:, None, :].expand(n, b, max_ctx + b)
        if layer_type == "sliding_attention":
            q = block_positions[:, :, None]
            k = key_pos[:, None, :]
            mask = mask & (k <= q)
            if self.config.sliding_window is not None:
                mask = mask & (q - k < self.config.sliding_window)
        return mask[:, None]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, cache: KVCache,
                ctx_lens: torch.Tensor, max_ctx: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Denoise one block per row.

        Args:
            block_embeds: [n, B, hidden] target embeddings of [last token, MASK x (B-1)].
            block_positions: [n, B] int64 absolute positions (start .. start + B - 1).
            cache: context cache holding K/V of slots [0, ctx_lens[r]) of each row.
            ctx_lens: [n] int64 committed context lengths; max_ctx: host int >= ctx_lens.max().
        Returns:
            [n, B, hidden] final-normed hidden states (feed positions 1..B-1 to the target lm_head).
        """
        return self.block_outputs(self.encode_block(block_embeds, block_positions, cache, ctx_lens, max_ctx, rows),
                                  0, block_embeds.shape[1])

    def encode_block(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, cache: KVCache,
                     ctx_lens: torch.Tensor, max_ctx: int, rows: torch.Tensor | None = None) -> tuple:
        """`forward` up to the last layer's queries: every layer but the last, and the last layer's
        normed input and keys/values over the whole block. `block_outputs` then gives the final
        hidden states of any block rows (same arguments as `forward`; the state is opaque)."""
        cos, sin = self.rotary(block_positions)
        masks: dict[str, torch.Tensor] = {}
        x = block_embeds.to(self.hidden_norm.weight.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            kind = self.config.layer_types[i]
            if kind not in masks:
                masks[kind] = self.block_mask(kind, ctx_lens, max_ctx, block_positions)
            ctx_k, ctx_v = cache.read(i, rows, max_ctx)
            if i < last:
                x = layer(x, cos, sin, ctx_k, ctx_v, masks[kind])
            else:
                h = layer.input_layernorm(x)
                k, v = layer.self_attn.keys_values(h, cos, sin, ctx_k, ctx_v)
                return x, h, cos, sin, k, v, masks[kind]
        raise ValueError("a drafter needs at least one layer")

    def block_outputs(self, state: tuple, lo: int, hi: int) -> torch.Tensor:
        """Final-normed hidden states [n, hi - lo, hidden] of block rows lo..hi-1 from `encode_block`'s
        state: rows depend only on the whole block's keys/values, so rows computed in several calls
        equal one `forward` (up to attention's float rounding for fewer query rows)."""
        return self.norm(self.layers[-1].rows(*state, lo, hi))
