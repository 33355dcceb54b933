"""The target model: a compact Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / gpt-oss decoder with a position-addressed
KV cache.

Module and parameter names mirror Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...) so a
HF safetensors checkpoint loads by name (see `dflash_trt.models.loading`).

Target features for the drafter: id l is the OUTPUT of decoder layer l, i.e. HF
`output_hidden_states[l + 1]` (hidden_states[0] is the embedding output). For the LAST layer HF
returns the output after the final RMSNorm, and z-lab's reference (`extract_context_feature`) feeds
exactly that tensor to the drafter; so does this model: id num_layers - 1 gives the normed output.

Sliding-window layers (Mistral; Qwen2 / Qwen3 with `use_sliding_window`; gpt-oss's alternate layers;
`TargetConfig.layer_window`) keep
every key in the cache and mask those W or more positions behind the query (transformers'
`sliding_window_overlay`: key position > query position - W), in prefill, decode and verify alike; a rollback
only moves the cache length, as for full layers. The mask compares positions, not slots: a draft tree's node
sits at slot start + i but at position start + its depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_trt.config import TargetConfig
from dflash_trt.models.layers import (
    CAUSAL,
    AttentionProjections,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    attention,
    head_matmul,
    sink_attention,
)
from dflash_trt.models.moe import GptOssMoeBlock, SparseMoeBlock
from dflash_trt.runtime.kv_cache import KVCache


class TargetAttention(AttentionProjections):
    """Grouped-query self-attention of target layer `layer_idx` over its KV cache (HF `self_attn.` keys:
    q/k/v/o_proj, q_norm/k_norm for Qwen3, `sinks` [heads] for gpt-oss: `dflash_trt.models.layers.sink_attention`).
    `window`: the layer's sliding window (None: full)."""

    def __init__(self, cfg: TargetConfig, layer_idx: int):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         cfg.attention_bias or cfg.qkv_bias, cfg.qk_norm, cfg.rms_norm_eps, o_bias=cfg.attention_bias)
        self.layer_idx = layer_idx
        self.window = cfg.layer_window(layer_idx)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads)) if cfg.attention_sinks else None

    def forward(self, x, rope, slots, mask, cache: KVCache, rows, kv_len):
        """x [n, t, hidden] (input_layernorm'd) of t new tokens; rope (cos, sin) [n, t, head_dim] of their
        positions; their K/V are written at `slots` [n, t] int64 of cache `rows` [n] (None = all), then
        the queries attend to slots [0, kv_len) under mask bool [n, 1, t, kv_len] (True = attend) or
        `CAUSAL` (t == kv_len: positions 0..t-1). Returns o_proj's output [n, t, hidden]."""
        n, t, _ = x.shape
        q = self.q_proj(x).view(n, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        cache.write(self.layer_idx, rows, slots, k, v.transpose(1, 2))
        k_all, v_all = cache.read(self.layer_idx, rows, kv_len)
        if self.sinks is not None:  # gpt-oss
            return self.o_proj(sink_attention(q, k_all, v_all, mask, self.scale, self.sinks))
        return self.o_proj(attention(q, k_all, v_all, mask, self.scale))


class TargetDecoderLayer(nn.Module):
    """One pre-norm decoder layer (HF `model.layers.N.`): x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: TargetConfig, layer_idx: int):
        super().__init__()
        self.self_attn = TargetAttention(cfg, layer_idx)
        if cfg.model_type == "gpt_oss":  # every layer sparse: routed experts with biases, clamped SwiGLU
            self.mlp = GptOssMoeBlock(cfg)
        else:
            self.mlp = (SparseMoeBlock(cfg) if cfg.is_sparse_layer(layer_idx)  # Qwen3-MoE's sparse layers
                        else SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, slots, mask, cache, rows, kv_len):
        """x [n, t, hidden] -> the layer's output [n, t, hidden]; the other arguments as `TargetAttention.forward`."""
        x = x + self.self_attn(self.input_layernorm(x), rope, slots, mask, cache, rows, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetBackbone(nn.Module):
    """HF `model.` prefix: embed_tokens, layers, norm."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TargetDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class TargetOutput:
    """logits: [n, k, vocab] float32 for the requested positions, or None when not asked for;
    features: [n, t, len(ids) * hidden] (model dtype) or None when no feature layers were requested;
    hidden: [n, t, hidden] final-normed hidden states of every position (the lm_head's input)."""

    logits: torch.Tensor | None
    features: torch.Tensor | None
    hidden: torch.Tensor | None = None


class TargetModel(nn.Module):
    """A Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / gpt-oss causal LM (`LlamaForCausalLM`, `MistralForCausalLM`,
    `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `GptOssForCausalLM` layouts)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = TargetBackbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.packed_head: nn.Module | None = None  # set by use_packed_linears

    def use_packed_linears(self, formats: tuple[str, ...] | None = None) -> None:
        """Run every decoder-layer linear and the lm_head through the packed CPU float32 kernel
        (`dflash_trt.ops.packed_linear`; inference only), each weight in the smallest of `formats`
        (default: all, `FORMATS`) that holds it exactly. The lm_head is packed as a copy: the
        embedding (tied) or `lm_head.weight` stays for `head_weight` users (the drafter's head)."""
        from dflash_trt.ops.packed_linear import FORMATS, PackedLinear, use_packed_linears

        use_packed_linears(self.model, formats or FORMATS)
        self.packed_head = PackedLinear(self.head_weight, formats=formats or FORMATS)

    @property
    def embed_weight(self) -> torch.Tensor:
        """Input embedding matrix [vocab, hidden] (shared with the drafter)."""
        return self.model.embed_tokens.weight

    @property
    def head_weight(self) -> torch.Tensor:
        """Output projection [vocab, hidden] (the embedding when tied; shared with the drafter)."""
        return self.embed_weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] -> float32 logits [..., vocab]."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # 2-D mm: a 3-D matmul takes a slow bmm path on CPU
        if self.packed_head is not None:
            return self.packed_head(flat).view(*hidden.shape[:-1], -1)
        return head_matmul(flat, self.head_weight).float().view(*hidden.shape[:-1], -1)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for `batch` rows of up to `capacity` positions, in the model's dtype."""
        cfg = self.config
        p = self.embed_weight
        kv_heads = self.model.layers[0].self_attn.num_kv_heads if len(self.model.layers) else cfg.num_key_value_heads
        # (this rank's KV heads under tensor parallelism, `dflash_trt.runtime.tensor_parallel`)
        return KVCache(cfg.num_hidden_layers, batch, kv_heads, capacity, cfg.head_dim, p.dtype, p.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int,
                rows: torch.Tensor | None = None, feature_layer_ids: tuple[int, ...] = (),
                logits_index: torch.Tensor | None = None, with_logits: bool = True,
                slots: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> TargetOutput:
        """Run tokens through the target, writing their K/V into `cache`.

        Args:
            input_ids: [n, t] int64.
            positions: [n, t] int64 absolute positions; token (r, i) attends to cache slots
                0..positions[r, i] of its row (causal by position, so right-padding is harmless).
            cache: the target KVCache; slots `positions` of `rows` are overwritten.
            kv_len: host int >= positions.max() + 1: how many slots attention reads.
            rows: [n] int64 cache rows of the n inputs, or None for all rows (n == cache.batch).
            feature_layer_ids: target layer ids whose outputs to return as drafter features.
            logits_index: [n, k] int64 indices into t of the positions that need logits, or None
                for all t positions.
            with_logits: False skips the lm_head (logits None): the caller computes logits from
                `hidden` where it needs them (lazy greedy verification).
            slots: [n, t] int64 cache slots to write, or None: `positions` (a sequence). A draft
                tree (`dflash_trt.runtime.draft_tree`) writes its nodes to consecutive slots while
                siblings share a position.
            attn_mask: bool [n, 1, t, kv_len] (True = attend), or None: causal by position. A draft
                tree passes its ancestor mask (`tree_attention_mask`). Sliding-window layers also mask
                the keys W or more positions behind each query (`window_mask`).
        Returns:
            TargetOutput with logits [n, k or t, vocab] float32 and hidden [n, t, hidden].
        """
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary(positions)
        if attn_mask is None:
            key_pos = torch.arange(kv_len, device=positions.device)
            if kv_len == positions.shape[1] and slots is None and bool((positions == key_pos).all()):
                attn_mask = CAUSAL  # a prefill from position 0: the same mask, a faster kernel
            else:
                attn_mask = key_pos[None, None, None, :] <= positions[:, None, :, None]
        slots = positions if slots is None else slots
        window = self.config.sliding_window
        # (a query at position p < W sees every key: no mask to build)
        windowed = (window_mask(attn_mask, positions, slots, kv_len, window)
                    if window is not None and int(positions.max()) >= window else None)
        wanted = {lid: None for lid in feature_layer_ids}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            mask = attn_mask if windowed is None or layer.self_attn.window is None else windowed
            x = layer(x, rope, slots, mask, cache, rows, kv_len)
            if i in wanted and i != last:
                wanted[i] = x
        x = self.model.norm(x)
        if last in wanted:
            wanted[last] = x
        features = torch.cat([wanted[lid] for lid in feature_layer_ids], dim=-1) if feature_layer_ids else None
        if not with_logits:
            return TargetOutput(None, features, x)
        hidden = x
        if logits_index is not None:
            x = torch.gather(x, 1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
        return TargetOutput(self.compute_logits(x), features, hidden)


def window_mask(mask: torch.Tensor | str, positions: torch.Tensor, slots: torch.Tensor, kv_len: int,
                window: int) -> torch.Tensor:
    """`mask` (bool [n, 1, t, kv_len], True = attend, or `CAUSAL`) narrowed to a sliding window of `window`
    positions: query position p keeps only the keys at positions > p - window (transformers'
    `sliding_window_overlay`), so p - window + 1 .. p with the causal mask.

    A key's position is its slot's for the committed context (slot s holds position s) and, for the slots
    written by this forward (`slots` [n, t] int64), the position of the token written there (`positions`
    [n, t] int64): a draft tree's node at slot start + i holds position start + its depth. Returns bool
    [n, 1, t, kv_len].
    """
    n = positions.shape[0]
    key_pos = torch.arange(kv_len, device=positions.device)
    if isinstance(mask, str):  # CAUSAL: a prefill from position 0, slot == position
        mask = key_pos[None, None, None, :] <= positions[:, None, :, None]
    key_pos = key_pos.expand(n, kv_len).scatter(1, slots, positions)
    return mask & (key_pos[:, None, None, :] > positions[:, None, :, None] - window)
