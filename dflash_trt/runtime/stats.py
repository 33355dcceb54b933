"""Per-request decoding statistics, returned by the decode loop (never printed by it).

Definitions (TensorRT-LLM / DFlash paper names):
- drafted_tokens: draft tokens handed to the verifier (max_draft_len, default block_size - 1, per
  verify step; fewer with a dynamic draft length, `DFlashProposer.draft_confidence`).
- accepted_tokens: draft tokens the target kept AND that were emitted (nothing past a stop).
- verify_steps: target forward passes after prefill that decoded this request.
- acceptance_length (tau): tokens emitted per verify step = (accepted + bonus/recovered) / steps;
  1.0 for autoregressive decoding (one token per target forward pass), and 1.0 for a request that
  had no verify step at all (max_tokens 1, or a stop as the first token: its one token came from the
  prefill pass, as in autoregressive decoding), never the 0.0 of an empty division.
- acceptance_rate: accepted_tokens / drafted_tokens, within [0, 1]. Nothing drafted (mode "ar", or no
  verify step) leaves it undefined: the property gives 0.0 (a float for formatting), `to_dict` (the
  --json of generate) gives None / null, as bench's results.json does for "ar".
- accepted_per_position[j]: verify steps in which draft position j + 1 was accepted and emitted.
- drafted_per_position[j]: draft tokens at position j + 1 handed to the verifier (one per verify step whose draft
  reached that position; fewer than verify_steps for the later positions with a dynamic draft length). A position is
  the j + 1-th token of a chain draft, and a depth in a draft tree: a tree's nodes at depth j + 1 all count (so
  there may be several per step), its accepted path's node at that depth in accepted_per_position (at most one).
- cached_tokens: prompt tokens whose K/V came from the prefix cache (`dflash_trt.runtime.prefix_cache`), not
  prefilled; 0 without one (OpenAI's usage.prompt_tokens_details.cached_tokens).
- time_to_first_token_s / total_time_s: seconds from the start of the `generate` call to this
  request's first token / its last. Requests of one batch share a prefill, so they share the first,
  and requests that finish at the same step share the second (the batch's clock, not copied numbers).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """One request's counts (tokens) and times (seconds of wall clock); each field is defined in this
    module's docstring. The engine fills it in `GenerationResult.metrics`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """tau: tokens per verify step (1.0 for autoregressive decoding, and for a request with no verify
        step: its only token came from the prefill pass)."""
        decoded = self.completion_tokens - 1  # the first token comes from prefill
        return decoded / self.verify_steps if self.verify_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted tokens; 0.0 when nothing was drafted (`to_dict` gives None then)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        """completion_tokens / total_time_s (output tokens per second, prefill included); 0.0 before any time."""
        return self.completion_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        """The fields plus acceptance_length, acceptance_rate (None when nothing was drafted, as in bench's
        results.json) and tokens_per_s: what `generate --json` prints as "metrics"."""
        d = asdict(self)
        d.update(acceptance_length=self.acceptance_length,
                 acceptance_rate=self.acceptance_rate if self.drafted_tokens else None,
                 tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class GenerationResult:
    """One request's output: token_ids (completion only), finish_reason, metrics.

    finish_reason: "stop" (a stop token, included) or "length": max_tokens reached, or the target's
    context filled up first (prompt + completion = its max_position_embeddings; then fewer than
    max_tokens tokens). One value for both, as OpenAI, vLLM and trtllm-serve report it. Or the string
    the caller's `on_tokens` callback returned to end the request (`Engine.generate`).
    logprobs: None, or (SamplingParams.logprobs set) one `dflash_trt.runtime.logprobs.TokenLogprob` per
    token id, in order. prompt_logprobs: None, or (SamplingParams.prompt_logprobs set) one per prompt
    token, the first None (nothing predicts it). text: the completion's text: set by `Pipeline.generate`
    (`dflash_trt.api`), and by the engine for a request with stop strings (`SamplingParams.stop`: cut before the
    one that ended it, whose last token ends token_ids); None from `Engine.generate` otherwise. stop_reason (vLLM's
    and TensorRT-LLM's): the stop string (`SamplingParams.stop`) or the token of `SamplingParams.stop_token_ids`
    that ended the output; None when it ended otherwise, at the target's EOS ids included (given in stop_token_ids too,
    unless ignore_eos). context_logits / generation_logits: None, or (SamplingParams.return_context_logits /
    return_generation_logits set) the target's raw float32 logits on the CPU, [prompt tokens, V] at every prompt
    position / [len(token_ids), V] at the position each output token was chosen from (TensorRT-LLM's names).
    """

    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    text: str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    stop_reason: int | str | None = None
    context_logits: object | None = None  # torch.Tensor [prompt tokens, V] float32
    generation_logits: object | None = None  # torch.Tensor [len(token_ids), V] float32
