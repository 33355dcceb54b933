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
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import TargetConfig
from dflash_trt.models.layers import SwiGLU


class SparseMoeBlock(nn.Module):
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
        self.tp_group = None  # set by shard_experts: partial outputs summed over these ranks
        self.tp_sharded = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, expert ids [N, k] int64), by descending probability."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = self.route(flat)
        out = torch.zeros_like(flat)
        # group the (token, slot) pairs by expert: stable, so each expert sees its tokens in order
        chosen = experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        token_of, weight_of = order // self.top_k, weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            tokens = token_of[start:start + n]
            y = self.experts[e](flat[tokens]) * weight_of[start:start + n, None]
            out.index_add_(0, tokens, y.to(out.dtype))
            start += n
        if self.tp_sharded:
            from dflash_trt.runtime.tensor_parallel import sum_over_ranks

            out = sum_over_ranks(out, self.tp_group)
        return out.view(shape)

    def shard_experts(self, rank: int, tp_size: int, group=None) -> None:
        """Keep rank `rank`'s slice [rank * I / tp, (rank + 1) * I / tp) of every expert's intermediate
        features (gate/up_proj rows, down_proj columns), in place; the block then sums its partial outputs
        over the ranks of `group` (None: the default group). The router stays whole.

        Raises:
            ConfigError: tp_size does not divide moe_intermediate_size (`check_tp` names it first on load).
        """
        from dflash_trt.errors import ConfigError

        width = self.experts[0].gate_proj.out_features if len(self.experts) else 0
        if width % tp_size:
            raise ConfigError(f"tp_size {tp_size} does not divide the target's expert MLP width "
                              f"(moe_intermediate_size {width}); use a tp_size that divides it")
        part = width // tp_size
        rows = slice(rank * part, (rank + 1) * part)
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
