"""Tensor parallelism of the target over several processes (torch.distributed: gloo on CPUs, NCCL on GPUs).

Megatron-style, the same split `dflash-trt build` writes for TensorRT-LLM (`dflash_trt.build.sharding`):
in every decoder layer q/k/v_proj and gate/up_proj are column-parallel (rank r holds heads
[r * heads / tp, (r + 1) * heads / tp) and the same slice of the KV heads and of the MLP's intermediate
features), o_proj and down_proj row-parallel: each rank multiplies its slice of the inputs and the
partial outputs are summed over the ranks. A mixture-of-experts layer (Qwen3-MoE, gpt-oss) splits every
expert the same way and sums once per layer (`shard_experts` of `dflash_trt.models.moe.SparseMoeBlock` /
`GptOssMoeBlock`); its router is replicated. gpt-oss's attention sinks are split with their heads. The embedding, norms, lm_head and the drafter are
replicated: every rank runs the same decode loop on the same tokens (SPMD) and reaches the same
decisions, so rank 0 alone reports the output.

The sum over ranks is deterministic: every rank gathers all partial outputs and adds them in rank
order (`RowParallelLinear`), where an all-reduce's order of additions may depend on the tensor's size.
So a verify pass over t tokens gives each token the bits a one-token step gives it, as on one process,
and greedy DFlash output stays exactly greedy autoregressive output at any tp_size. Against tp_size 1
the logits differ by float rounding only (a different order of additions).

Usage: initialize the default process group (e.g. under `torchrun --nproc-per-node N`), then
`load_pipeline(..., tp_size=N)` on every rank.
"""

from __future__ import annotations

import atexit
import os

import torch
from torch import nn

from dflash_trt.errors import ConfigError


class RowParallelLinear(nn.Module):
    """A row-parallel linear: this rank's input slice [..., in / tp] times its weight slice, then the
    partial outputs of every rank summed in rank order (all_gather + a fixed-order sum), then the bias once.

    Args:
        linear: this rank's slice (an nn.Linear without bias; it may later be packed, `use_packed_linears`).
        bias: the full bias [out] or None.
        group: the process group (None: the default one).
    """

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None, group=None):
        super().__init__()
        self.linear = linear
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = sum_over_ranks(self.linear(x), self.group)
        return out if self.bias is None else out + self.bias


def sum_over_ranks(part: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of every rank's `part` (the same shape on each), added in rank order: all_gather, then a
    fixed-order sum, so the result has the same bits on every rank and for every tensor size (see the module
    docstring). Used by `RowParallelLinear` and the mixture-of-experts block (`dflash_trt.models.moe`)."""
    import torch.distributed as dist

    part = part.contiguous()
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part, group=group)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def _rows(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """A new nn.Linear holding output rows [start, stop) of `linear` (column-parallel slice)."""
    out = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None,
                    dtype=linear.weight.dtype, device=linear.weight.device)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:stop])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[start:stop])
    return out


def _columns(linear: nn.Linear, start: int, stop: int, group) -> RowParallelLinear:
    """Input columns [start, stop) of `linear` as a RowParallelLinear (row-parallel slice)."""
    part = nn.Linear(stop - start, linear.out_features, bias=False, dtype=linear.weight.dtype,
                     device=linear.weight.device)
    with torch.no_grad():
        part.weight.copy_(linear.weight[:, start:stop])
    return RowParallelLinear(part, linear.bias, group)


def check_tp(tp_size: int, heads: int, kv_heads: int, intermediate: int, name: str = "tp_size",
             expert_intermediate: int = 0) -> None:
    """Raises ConfigError when the target's heads, KV heads, MLP width or, for a mixture-of-experts target,
    its experts' MLP width (`expert_intermediate`, Qwen3-MoE's moe_intermediate_size; 0: none) do not split into
    tp_size equal parts; the message calls the value `name` (the CLI's `--tp-size`)."""
    widths = (("attention heads", heads), ("KV heads", kv_heads), ("MLP intermediate features", intermediate),
              ("expert MLP intermediate features", expert_intermediate))
    bad = [f"{what} ({n})" for what, n in widths if n and n % tp_size]
    if bad:
        ok = [d for d in range(1, heads + 1) if all(n % d == 0 for _, n in widths)]
        raise ConfigError(f"{name} {tp_size} does not divide the target's {', '.join(bad)}; use a {name} that "
                          f"divides them: {', '.join(map(str, ok))}")


def check_target_tp(cfg, tp_size: int, name: str = "tp_size") -> None:
    """`check_tp` for a target's config (`dflash_trt.config.TargetConfig`): its heads, KV heads, the dense MLP
    width where some layer is dense (`TargetConfig.dense_intermediate_size`) and, for a mixture-of-experts
    target, its experts' width.

    Raises:
        ConfigError: as `check_tp`.
    """
    check_tp(tp_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dense_intermediate_size, name,
             expert_intermediate=cfg.moe_intermediate_size if cfg.is_moe else 0)


def tp_fp8_matmul(fp8_matmul: str, tp_size: int) -> str:
    """The `fp8_matmul` mode (`dflash_trt.models.fp8`) to load a target split over tp_size > 1 ranks with:
    `shard_target` splits nn.Linear layers only, not FP8 (W8A8) ones, so "auto" becomes "off" (an FP8
    checkpoint dequantized on load, as on a CPU); any other mode is returned as given for the loader to check.

    Raises:
        ConfigError: "on" (names the fixes).
    """
    if fp8_matmul == "auto":
        return "off"
    if fp8_matmul == "on":
        raise ConfigError(f"--fp8-matmul on with --tp-size {tp_size}: FP8 (W8A8) layers are not split over ranks; use "
                          "--fp8-matmul auto or off (fp8_matmul='auto' / 'off' in Python: the weights dequantized on "
                          "load), or serve the FP8 bundle with TensorRT-LLM (its trtllm/launch.sh)")
    return fp8_matmul


def shard_target(model, rank: int, tp_size: int, group=None) -> None:
    """Keep rank `rank`'s part of every decoder layer of `model` (a `TargetModel` with nn.Linear layers,
    before `use_packed_linears`), in place; see the module docstring for the split.

    Raises:
        ConfigError: tp_size does not divide the heads, KV heads or intermediate features (`check_tp`).
    """
    from dflash_trt.models.moe import MoeBlock

    cfg = model.config
    check_target_tp(cfg, tp_size)
    hq, hkv = cfg.num_attention_heads // tp_size, cfg.num_key_value_heads // tp_size
    d, inter = cfg.head_dim, cfg.intermediate_size // tp_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, MoeBlock):  # every expert split along its intermediate features
            mlp.shard_experts(rank, tp_size, group)
        attn.q_proj = _rows(attn.q_proj, rank * hq * d, (rank + 1) * hq * d)
        attn.k_proj = _rows(attn.k_proj, rank * hkv * d, (rank + 1) * hkv * d)
        attn.v_proj = _rows(attn.v_proj, rank * hkv * d, (rank + 1) * hkv * d)
        attn.o_proj = _columns(attn.o_proj, rank * hq * d, (rank + 1) * hq * d, group)
        attn.num_heads, attn.num_kv_heads = hq, hkv
        if attn.sinks is not None:  # gpt-oss: one sink per query head, with its head
            attn.sinks = nn.Parameter(attn.sinks.detach()[rank * hq:(rank + 1) * hq].clone(), requires_grad=False)
        if isinstance(mlp, MoeBlock):
            continue
        mlp.gate_proj = _rows(mlp.gate_proj, rank * inter, (rank + 1) * inter)
        mlp.up_proj = _rows(mlp.up_proj, rank * inter, (rank + 1) * inter)
        mlp.down_proj = _columns(mlp.down_proj, rank * inter, (rank + 1) * inter, group)
    model.tp_rank, model.tp_size = rank, tp_size


def process_group_rank(tp_size: int) -> int:
    """This process's rank in the default process group, checked against `tp_size`.

    Raises:
        ConfigError: no process group is initialized, or its world size is not tp_size (names how to launch).
    """
    import torch.distributed as dist

    launch = (f"launch one process per rank, e.g. `torchrun --nproc-per-node {tp_size} $(which dflash-trt) "
              f"generate --tp-size {tp_size} ...`")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(f"tp_size {tp_size} needs torch.distributed initialized in {tp_size} processes: {launch}")
    if dist.get_world_size() != tp_size:
        raise ConfigError(f"tp_size {tp_size}, but the process group has {dist.get_world_size()} processes: {launch}")
    return dist.get_rank()


def same_rng_on_every_rank(group=None) -> None:
    """Seed torch's global RNG on every rank with one seed drawn on rank 0: sampling requests without a seed
    draw theirs from it, and every rank must draw the same (SPMD: the same calls in the same order)."""
    import torch.distributed as dist

    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    dist.broadcast(seed, src=0, group=group)
    torch.manual_seed(int(seed.item()))


def init_from_env(device: str) -> bool:
    """Initialize the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) when it is set and no group exists: gloo on a CPU, NCCL on a GPU. Returns whether a group
    is initialized afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    atexit.register(dist.destroy_process_group)
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return True
