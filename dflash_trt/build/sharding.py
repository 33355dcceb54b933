"""Tensor-parallel split rules for TensorRT-LLM's per-rank Llama / Mistral / Qwen2 / Qwen3 checkpoint, and inverse.

TensorRT-LLM's checkpoint (`config.json` + `rank{r}.safetensors`, the input of `trtllm-build`) names
Llama and Qwen3 weights `transformer.vocab_embedding`, `transformer.layers.N.attention.{qkv,dense}`,
`transformer.layers.N.mlp.{fc,gate,proj}` (fc = HF gate_proj, gate = HF up_proj, proj = down_proj),
`transformer.layers.N.{input_layernorm,post_layernorm}`, `transformer.ln_f`, `lm_head`; Qwen3 adds
`transformer.layers.N.attention.{q,k}_layernorm` (HF q_norm / k_norm). Megatron-style
rules (column-parallel: split output rows; row-parallel: split input columns, the partial sums are
all-reduced):
- column-parallel (dim 0): mlp.fc, mlp.gate (and their biases);
- fused qkv (dim 0, per part): rank r gets [q heads of r; kv heads of r; same for v]; when there are
  fewer KV heads than ranks, each KV head is replicated on tp / kv_heads ranks;
- row-parallel (dim 1): attention.dense, mlp.proj (biases replicated);
- vocab-parallel (dim 0): vocab_embedding, lm_head;
- replicated: norms, including Qwen3's q_layernorm / k_layernorm ([head_dim], one weight shared by every
  head, so every rank holds it whole, as TensorRT-LLM's own Qwen converter writes it); per-tensor scales
  (`*_scaling_factor` with one element, `weights_scaling_factor_2`, `kv_cache_scaling_factor`).
Quantized tensors split the same way: NVFP4 weights are packed along dim 1 (2 values per byte) and
their block scales have one column per 16 inputs, so a row-parallel split must cut at multiples of
16 inputs (checked).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dflash_trt.errors import ConfigError

COLUMN = "column"
ROW = "row"
QKV = "qkv"
VOCAB = "vocab"
REPLICATED = "replicated"

_RULES = (
    (re.compile(r"^transformer\.vocab_embedding\.weight$"), VOCAB),
    (re.compile(r"^lm_head\.weight$"), VOCAB),
    (re.compile(r"\.attention\.qkv\.(weight|bias|weights_scaling_factor)$"), QKV),
    (re.compile(r"\.attention\.dense\.(weight|weights_scaling_factor)$"), ROW),
    (re.compile(r"\.mlp\.proj\.(weight|weights_scaling_factor)$"), ROW),
    (re.compile(r"\.mlp\.(fc|gate)\.(weight|bias|weights_scaling_factor)$"), COLUMN),
)


@dataclass(frozen=True)
class ShardSpec:
    """What the split needs to know about the model. Head counts are the unsharded totals."""

    tp_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def from_trtllm_config(cls, config: dict, tp_size: int) -> ShardSpec:
        """From a TensorRT-LLM checkpoint config.json (`num_attention_heads`, `num_key_value_heads`, `head_size`)."""
        heads = int(config["num_attention_heads"])
        return cls(tp_size, heads, int(config.get("num_key_value_heads") or heads),
                   int(config.get("head_size") or config["hidden_size"] // heads))


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors (same dtype and shape). Works for float8 (torch.equal does not on CPU)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def rule_for(name: str, tensor: torch.Tensor) -> str:
    """The split rule of one TensorRT-LLM tensor (COLUMN, ROW, QKV, VOCAB or REPLICATED).

    Per-tensor scales (one element) are replicated whatever module they belong to.
    """
    if tensor.numel() <= 1:
        return REPLICATED
    for pattern, rule in _RULES:
        if pattern.search(name):
            return rule
    return REPLICATED


def check_divisible(spec: ShardSpec, vocab_size: int, intermediate_size: int, hidden_size: int,
                    nvfp4: bool = False) -> None:
    """Raise ConfigError naming the dimension that `spec.tp_size` does not divide evenly, and the
    --tp-size values that do fit this model (up to its attention head count)."""
    del hidden_size  # row-parallel splits cut the input dims below, never the hidden size
    tp = spec.tp_size
    if tp < 1:
        raise ConfigError(f"cannot shard for tensor parallelism: --tp-size must be >= 1, got {tp}")
    problems = _shard_problems(spec, tp, vocab_size, intermediate_size, nvfp4)
    if problems:
        fits = [t for t in range(1, spec.num_attention_heads + 1)
                if not _shard_problems(spec, t, vocab_size, intermediate_size, nvfp4)]
        raise ConfigError("cannot shard for tensor parallelism: " + "; ".join(problems)
                          + f". Pick a --tp-size that divides all of these; for this model: {', '.join(map(str, fits))}")


def _shard_problems(spec: ShardSpec, tp: int, vocab_size: int, intermediate_size: int, nvfp4: bool) -> list[str]:
    """What tensor parallelism over `tp` >= 1 ranks cannot split evenly ([] when it fits)."""
    problems = []
    if spec.num_attention_heads % tp:
        problems.append(f"{spec.num_attention_heads} attention heads are not divisible by tp {tp}")
    kv = spec.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        problems.append(f"{kv} KV heads cannot be split or replicated evenly over tp {tp}")
    if intermediate_size % tp:
        problems.append(f"intermediate size {intermediate_size} is not divisible by tp {tp}")
    if vocab_size % tp:
        problems.append(f"vocab size {vocab_size} is not divisible by tp {tp}")
    if nvfp4:
        widths = (("intermediate", intermediate_size), ("attention width", spec.num_attention_heads * spec.head_dim))
        bad = [f"{what} {n} / {tp} = {n / tp:g}" for what, n in widths if n % tp or (n // tp) % 16]
        if bad:
            problems.append("NVFP4 row-parallel shards must hold whole 16-element blocks: "
                            f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of 16")
    return problems


def _qkv_parts(t: torch.Tensor, spec: ShardSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused qkv tensor [(q + 2 kv) * d, ...] into q, k, v along dim 0."""
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    if t.shape[0] != q + 2 * kv:
        raise ConfigError(f"fused qkv has {t.shape[0]} rows, expected {q + 2 * kv}")
    return t[:q], t[q : q + kv], t[q + kv :]


def _kv_rank_slice(part: torch.Tensor, rank: int, spec: ShardSpec) -> torch.Tensor:
    kv, tp, d = spec.num_key_value_heads, spec.tp_size, spec.head_dim
    if kv >= tp:
        return part.chunk(tp, dim=0)[rank]
    head = rank * kv // tp  # replicated: ranks r share head r * kv / tp
    return part[head * d : (head + 1) * d]


def split_tensor(name: str, t: torch.Tensor, spec: ShardSpec) -> list[torch.Tensor]:
    """The `spec.tp_size` per-rank pieces of one full tensor (contiguous copies)."""
    tp = spec.tp_size
    rule = rule_for(name, t)
    if rule == REPLICATED or tp == 1:
        return [t.clone() for _ in range(tp)]
    if rule in (COLUMN, VOCAB):
        return [p.contiguous() for p in t.chunk(tp, dim=0)]
    if rule == ROW:
        return [p.contiguous() for p in t.chunk(tp, dim=1)]
    q, k, v = _qkv_parts(t, spec)
    return [torch.cat([q.chunk(tp, dim=0)[r], _kv_rank_slice(k, r, spec), _kv_rank_slice(v, r, spec)]).contiguous()
            for r in range(tp)]


def merge_tensor(name: str, pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `split_tensor`: the full tensor from its per-rank pieces.

    Raises:
        ConfigError: replicated pieces (or replicated KV heads) differ between ranks.
    """
    tp = spec.tp_size
    rule = rule_for(name, pieces[0])
    if len(pieces) != tp:
        raise ConfigError(f"{name}: {len(pieces)} pieces for tp {tp}")
    if rule == REPLICATED or tp == 1:
        if any(not tensors_equal(p, pieces[0]) for p in pieces[1:]):
            raise ConfigError(f"{name}: replicated tensor differs between ranks")
        return pieces[0]
    if rule in (COLUMN, VOCAB):
        return torch.cat(pieces, dim=0)
    if rule == ROW:
        return torch.cat(pieces, dim=1)
    d, kv = spec.head_dim, spec.num_key_value_heads
    q_rows = spec.num_attention_heads * d // tp
    kv_rows = (pieces[0].shape[0] - q_rows) // 2
    qs = [p[:q_rows] for p in pieces]
    ks = [p[q_rows : q_rows + kv_rows] for p in pieces]
    vs = [p[q_rows + kv_rows :] for p in pieces]
    if kv < tp:  # replicated KV heads: keep the first rank of each group, check the others agree
        group = tp // kv
        for parts in (ks, vs):
            for r in range(tp):
                if not tensors_equal(parts[r], parts[(r // group) * group]):
                    raise ConfigError(f"{name}: replicated KV head differs between ranks")
        ks, vs = ks[::group], vs[::group]
    return torch.cat(qs + ks + vs, dim=0)


def split_state_dict(tensors: dict[str, torch.Tensor], spec: ShardSpec) -> list[dict[str, torch.Tensor]]:
    """Per-rank state dicts (list of length tp) from an unsharded (tp 1) TensorRT-LLM state dict."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.tp_size)]
    for name, t in tensors.items():
        for r, piece in enumerate(split_tensor(name, t, spec)):
            ranks[r][name] = piece
    return ranks


def merge_state_dicts(ranks: list[dict[str, torch.Tensor]], spec: ShardSpec) -> dict[str, torch.Tensor]:
    """The unsharded state dict from per-rank state dicts (inverse of `split_state_dict`).

    Raises:
        ConfigError: ranks hold different key sets.
    """
    keys = set(ranks[0])
    for r, sd in enumerate(ranks[1:], 1):
        if set(sd) != keys:
            raise ConfigError(f"rank {r} holds different tensors than rank 0: {sorted(set(sd) ^ keys)[:5]}")
    return {name: merge_tensor(name, [sd[name] for sd in ranks], spec) for name in ranks[0]}
