"""The sparse mixture-of-experts MLP of Qwen3-MoE targets (model_type "qwen3_moe").

Each token's hidden state is scored by a linear router (`mlp.gate`, no bias) over E experts; the softmax of
those scores (float32) picks the token's top-k experts, whose probabilities are its routing weights
(renormalized to sum to 1 when `norm_topk_prob`). The block's output is the weighted sum of the chosen
experts' SwiGLU MLPs (`mlp.experts.{e}.{gate,up,down}_proj`, width `moe_intermediate_size`), added in
ascending expert order. This is transformers' `Qwen3MoeSparseMoeBlock` (modeling_qwen3_moe.py), with the
per-expert tensor names its `save_pretrained` writes and the Qwen3-MoE checkpoints on the Hugging Face Hub hold.

Only the experts some token was routed to run, each on its tokens alone, so a one-token decode step costs
k expert MLPs, not E. A token's output does not depend on the other tokens of its pass (each expert's rows
are its own; the per-token sum runs in expert order), so a verify pass gives each token what a one-token
step gives it, as for a dense layer.

Tensor parallelism (`dflash_trt.runtime.tensor_parallel`) splits every expert along its intermediate
features (`shard_experts`), as TensorRT-LLM's MoE tensor parallelism does: the router is replicated, so
every rank routes each token alike, runs its slice of each chosen expert, and the partial outputs are
summed over the ranks once per block.

gpt-oss targets (model_type "gpt_oss", `GptOssMoeBlock`) route and run their experts differently, in the same
dispatch (`MoeBlock`): the router has a bias (`mlp.router.weight/bias`), each token's k largest router logits
are softmaxed among themselves (no softmax over all E first), and the experts are stored fused as transformers'
GptOssExperts and openai/gpt-oss-20b hold them (`mlp.experts.gate_up_proj` [E, hidden, 2I] with gate and up
columns interleaved, `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, hidden], `down_proj_bias` [E, hidden]),
with a clamped SwiGLU: gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(1.702 * gate).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import TargetConfig
from dflash_trt.models.layers import SwiGLU


class MoeBlock(nn.Module):
    """A mixture-of-experts MLP: `route` picks each token's experts and weights, `run_expert` runs one expert on
    its tokens; `forward` runs only the experts some token was routed to, adds each token's weighted expert
    outputs in ascending expert order, and under tensor parallelism sums the ranks' partial outputs.

    forward: x [..., hidden] -> [..., hidden] in x's dtype.
    """

    num_experts: int

    def __init__(self):
        super().__init__()
        self.tp_group = None  # set by shard_experts: partial outputs summed over these ranks
        self.tp_sharded = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, expert ids [N, k] int64)."""
        raise NotImplementedError

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` on its tokens x [n, hidden] -> [n, hidden]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        out = torch.zeros_like(flat)
        # group the (token, slot) pairs by expert: stable, so each expert sees its tokens in order
        chosen = experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        token_of, weight_of = order // experts.shape[-1], weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            tokens = token_of[start:start + n]
            y = self.run_expert(e, flat[tokens]) * weight_of[start:start + n, None]
            out.index_add_(0, tokens, y.to(out.dtype))
            start += n
        if self.tp_sharded:
            from dflash_trt.runtime.tensor_parallel import sum_over_ranks

            out = sum_over_ranks(out, self.tp_group)
        return out.view(shape)

    def _tp_slice(self, width: int, rank: int, tp_size: int) -> slice:
        """Rank `rank`'s slice of an expert's `width` intermediate features.

        Raises:
            ConfigError: tp_size does not divide `width` (`check_tp` names it first on load).
        """
        from dflash_trt.errors import ConfigError

        if width % tp_size:
            raise ConfigError(f"tp_size {tp_size} does not divide the target's expert MLP width "
                              f"({width} intermediate features); use a tp_size that divides it")
        part = width // tp_size
        return slice(rank * part, (rank + 1) * part)


class SparseMoeBlock(MoeBlock):
    """Qwen3-MoE's sparse MLP block (HF keys `mlp.gate.weight` [E, hidden], `mlp.experts.{e}.gate_proj.weight`
    [moe_intermediate, hidden], `up_proj` the same, `down_proj` [hidden, moe_intermediate]).

    forward: x [..., hidden] -> [..., hidden] in x's dtype (routing softmax in float32, as transformers).
    """

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, expert ids [N, k] int64), by descending probability."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts[e](x)

    def shard_experts(self, rank: int, tp_size: int, group=None) -> None:
        """Keep rank `rank`'s slice [rank * I / tp, (rank + 1) * I / tp) of every expert's intermediate
        features (gate/up_proj rows, down_proj columns), in place; the block then sums its partial outputs
        over the ranks of `group` (None: the default group). The router stays whole.

        Raises:
            ConfigError: tp_size does not divide moe_intermediate_size (`check_tp` names it first on load).
        """
        width = self.experts[0].gate_proj.out_features if len(self.experts) else 0
        rows = self._tp_slice(width, rank, tp_size)
        part = rows.stop - rows.start
        with torch.no_grad():
            for expert in self.experts:
                for name in ("gate_proj", "up_proj"):
                    old = getattr(expert, name)
                    new = nn.Linear(old.in_features, part, bias=False, dtype=old.weight.dtype, device=old.weight.device)
                    new.weight.copy_(old.weight[rows])
                    setattr(expert, name, new)
                old = expert.down_proj
                new = nn.Linear(part, old.out_features, bias=False, dtype=old.weight.dtype, device=old.weight.device)
                new.weight.copy_(old.weight[:, rows])
                expert.down_proj = new
        self.tp_group, self.tp_sharded = group, True


#: the sigmoid's slope in gpt-oss's SwiGLU (transformers' GptOssExperts.alpha; openai/gpt-oss's reference)
GPT_OSS_SWIGLU_ALPHA = 1.702


class GptOssExperts(nn.Module):
    """gpt-oss's E experts, fused as stored (HF keys under `mlp.experts.`): gate_up_proj [E, hidden, 2I] (gate
    features at even columns, up at odd), gate_up_proj_bias [E, 2I], down_proj [E, I, hidden], down_proj_bias
    [E, hidden]. `limit`: the SwiGLU clamp (config.json `swiglu_limit`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.limit = limit

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` on x [n, hidden] -> [n, hidden]."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_SWIGLU_ALPHA))
        return h @ self.down_proj[e] + self.down_proj_bias[e]


class GptOssMoeBlock(MoeBlock):
    """gpt-oss's MLP (HF keys `mlp.router.weight` [E, hidden], `mlp.router.bias` [E], `mlp.experts.*`:
    `GptOssExperts`): routed as transformers' GptOssTopKRouter, the top-k of the router logits, softmaxed
    among themselves in the logits' dtype, as the token's weights (descending)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), experts

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.experts(e, x)

    def shard_experts(self, rank: int, tp_size: int, group=None) -> None:
        """Keep rank `rank`'s slice of every expert's I intermediate features, in place: gate_up_proj's columns
        [2 * start, 2 * stop) (interleaved gate/up pairs stay together) and their bias, down_proj's rows
        [start, stop); down_proj_bias on rank 0 only (zero elsewhere: the ranks' sum adds it once). The block
        then sums its partial outputs over `group`'s ranks (None: the default group); the router stays whole.

        Raises:
            ConfigError: tp_size does not divide the expert width (`check_tp` names it first on load).
        """
        ex = self.experts
        rows = self._tp_slice(ex.down_proj.shape[1], rank, tp_size)
        cols = slice(2 * rows.start, 2 * rows.stop)
        with torch.no_grad():
            ex.gate_up_proj = nn.Parameter(ex.gate_up_proj[:, :, cols].contiguous(), requires_grad=False)
            ex.gate_up_proj_bias = nn.Parameter(ex.gate_up_proj_bias[:, cols].contiguous(), requires_grad=False)
            ex.down_proj = nn.Parameter(ex.down_proj[:, rows].contiguous(), requires_grad=False)
            bias = ex.down_proj_bias if rank == 0 else torch.zeros_like(ex.down_proj_bias)
            ex.down_proj_bias = nn.Parameter(bias.clone(), requires_grad=False)
        self.tp_group, self.tp_sharded = group, True
