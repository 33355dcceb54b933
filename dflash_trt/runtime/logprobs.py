"""Log-probabilities of the emitted tokens (OpenAI's `logprobs`, TensorRT-LLM's `return_log_probs`).

What is reported: for every emitted token, log p(token | prefix) under the TARGET's raw distribution,
log_softmax of its float32 logits, before temperature, top-k and top-p (vLLM's default
`logprobs_mode: raw_logprobs`; OpenAI's logprobs do not change with temperature either), and the
`num_top` most likely tokens of that distribution. They are the target's own numbers, whichever
tokens the drafter proposed: an accepted draft's log-probability is read from the verify pass's
logits at the position before it, exactly where an autoregressive step would compute it, so DFlash
and autoregressive decoding report the same values (up to the float rounding of a 16-row and a 1-row
product, the same difference as their logits'). Greedy decoding emits the argmax, so each token's
logprob is its distribution's largest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: most alternatives per token (vLLM's default max_logprobs and OpenAI's chat `top_logprobs` limit)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, its log-probability (natural log, <= 0) under the target's raw
    distribution, and the `num_top` most likely (id, log-probability) pairs of that distribution, most
    likely first. The token itself may be among them or not (sampling)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """The log-probabilities of `tokens` under the distributions `logits`.

    Args:
        logits: [m, V] target logits (any float dtype; computed in float32): row i is the distribution
            token i was drawn from (the logits at the position before it).
        tokens: m token ids in [0, V).
        num_top: alternatives per token, 0 .. MAX_LOGPROBS (0: the token's own logprob only).
    Returns:
        m TokenLogprobs, in order.
    """
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if num_top:
        values, ids = logp.topk(min(num_top, logp.shape[-1]), dim=-1)  # sorted, largest first
        top_ids, top_values = ids.tolist(), values.tolist()
    else:
        top_ids = top_values = [[] for _ in tokens]
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, top_ids, top_values)]


class StepLogits:
    """The target logits one decode step's verification computed, kept by (batch row, block node) for
    the rows that asked for logprobs, so their logprobs reuse them instead of a second lm_head product.

    The verifier computes logits only where its decisions read them (`lazy_greedy_accept`, the chunks of
    `ChunkedProbs`), and those always include the nodes of every emitted token (positions 0 .. accepted
    of a chain, the root and accepted path of a tree), which are the logprobs' nodes.
    """

    def __init__(self, rows: set[int]):
        """rows: the batch rows whose logits to keep."""
        self.rows = rows
        self._at: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}

    def add(self, keys: list[tuple[int, int]], logits: torch.Tensor) -> None:
        """Keep `logits` [len(keys), V] (row i: the logits of node keys[i][1] of batch row keys[i][0]) for
        the kept rows' keys (a reference to the tensor, no copy)."""
        for i, key in enumerate(keys):
            if key[0] in self.rows:
                self._at[key] = (logits, i)

    def add_where(self, rows: list[int], where: torch.Tensor, logits: torch.Tensor) -> None:
        """`add` for a boolean selection: where [len(rows), nodes] marks, in row-major order, the nodes
        whose logits `logits` [where.sum(), V] holds; row g of `where` is batch row rows[g]."""
        if self.rows.intersection(rows):
            self.add([(rows[g], node) for g, node in where.nonzero().tolist()], logits)

    def get(self, row: int, nodes: list[int]) -> torch.Tensor | None:
        """[len(nodes), V] logits of `nodes` of batch row `row`, or None if any of them was not computed."""
        try:
            found = [self._at[(row, node)] for node in nodes]
        except KeyError:
            return None
        return torch.stack([logits[i] for logits, i in found])
