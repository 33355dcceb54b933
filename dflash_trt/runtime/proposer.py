"""The DFlash proposer: one drafter pass drafts a whole block (DFlash paper sec. 3.2).

It owns the drafter's context cache and knows nothing about verification. The verifier gets a
`DraftBatch` and knows nothing about how it was drafted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import head_matmul
from dflash_trt.models.target import TargetModel
from dflash_trt.runtime.draft_tree import add_path, build_tree, chain_parents
from dflash_trt.runtime.penalties import chain_prefixes
from dflash_trt.runtime.sampling import SamplingParams, greedy_tokens, probs_from_logits


@dataclass
class DraftBatch:
    """Drafts for n rows, handed from proposer to verifier.

    tokens: [n, k] int64, k = the proposer's max_draft_len (at most block_size - 1) drafts per row.
    probs:  list of n entries, each [m, V] float32 q of the row's first m drafts (sampled drafts; m = its
        length, or k without lengths) or None (argmax drafts).
    lengths: per row, how many of its k drafts to verify (dynamic draft length, 0..k), or None:
        all k for every row.
    parents: [n, k] int64 draft trees (`dflash_trt.runtime.draft_tree`: draft i is node i + 1, its
        parent node parents[:, i], 0 = the block's first token), or None: every row is a chain.
    """

    tokens: torch.Tensor
    probs: list[torch.Tensor | None]
    lengths: list[int] | None = None
    parents: torch.Tensor | None = None


def confident_prefix_lengths(confidence: torch.Tensor, threshold: float | list[float]) -> list[int]:
    """Dynamic draft length: per row, the longest prefix of drafts whose running product of
    confidences stays >= threshold.

    Args:
        confidence: [n, k] float, the drafter's probability of its draft at each position, in [0, 1].
        threshold: in [0, 1), one for all rows or one per row; 0 keeps all k.
    Returns:
        n ints in [0, k].
    """
    if isinstance(threshold, list):
        threshold = torch.tensor(threshold, dtype=torch.float64, device=confidence.device)[:, None]
    return (confidence.double().cumprod(1) >= threshold).sum(1).tolist()  # the product only falls


#: `draft_confidence="auto"` on a CPU: with the default SmolLM2 drafter, block 16, on HumanEval and
#: MT-Bench, chains at 0.1 / 0.2 / 0.3 measured the same within noise, 0.5 slower, 0 (15 drafts) far
#: slower (BENCHMARKS.md, session 10); top-4 trees at 0.1 / 0.2 alike, 0.05 and 0.3 slower (session 11).
CPU_DRAFT_CONFIDENCE = 0.2
#: The same for rows whose drafts are sampled from q (temperature > 0). A sampled draft x is accepted
#: with probability min(1, p(x) / q(x)), on average sum_x min(p, q), which stays high for a flat q
#: close to p although q's top probability is low: the top-token product understates it. At
#: temperature 1, 64 tokens, HumanEval / MT-Bench (BENCHMARKS.md, session 13): on their first 10
#: prompts (4 interleaved rounds) 0.07 ran 1.01x / 0.97x of `ar` and 0.2 0.95x / 0.92x (tau 1.52 /
#: 1.38 vs 1.34 / 1.23); on 20 other prompts each (3 rounds) 0.98x / 0.95x vs 0.96x / 0.97x (tau
#: 1.46 / 1.32 vs 1.36 / 1.29): higher tau, speed the same or better within noise. 0.05-0.1 alike
#: in a 2-round sweep; 0 (15 drafts) 0.5x.
CPU_SAMPLED_DRAFT_CONFIDENCE = 0.07
#: `tree_topk="auto"` on a CPU: top-4 draft trees at P 0.1-0.2 ran 1.22x / 1.01-1.02x of `ar` on
#: HumanEval / MT-Bench against 1.18-1.19x / 0.97x for the chain at P 0.3 (BENCHMARKS.md, session 11).
CPU_TREE_TOPK = 4

#: With a draft confidence > 0, the drafter's last layer (queries, o_proj, MLP) and the draft head run
#: for the first LAZY_DRAFT_POSITIONS draft positions, and for the rest only if some row is still
#: confident there (greedy and sampling rows alike); the other layers and every K/V see the whole block.
LAZY_DRAFT_POSITIONS = 4


def auto_draft_confidence(device: torch.device | str, sampled: bool = False) -> float:
    """The dynamic-draft-length threshold "auto" stands for on `device`, for argmax drafts or (`sampled`)
    drafts sampled from q: `CPU_DRAFT_CONFIDENCE` / `CPU_SAMPLED_DRAFT_CONFIDENCE` on a CPU, where
    every verified position costs compute, 0 (verify max_draft_len drafts every step) on a GPU, where
    a verify pass of 16 tokens at batch 1 costs about what one token does."""
    if torch.device(device).type != "cpu":
        return 0.0
    return CPU_SAMPLED_DRAFT_CONFIDENCE if sampled else CPU_DRAFT_CONFIDENCE


#: `prompt_lookup="auto"` on a CPU: up to this many prompt-lookup tokens per row and step (BENCHMARKS.md,
#: session 12: 8 and 15 measured alike, 1.46x / 1.03-1.04x of `ar`, against 1.21x / 1.01x without).
CPU_PROMPT_LOOKUP = 8


def auto_prompt_lookup(device: torch.device | str) -> int:
    """The prompt-lookup length "auto" stands for on `device`: `CPU_PROMPT_LOOKUP` on a CPU (measured
    faster there), 0 (off, the paper's DFlash) elsewhere until a GPU measurement says otherwise."""
    return CPU_PROMPT_LOOKUP if torch.device(device).type == "cpu" else 0


#: `max_concurrency="auto"` on a CPU: speculate only while one request is active. At batch 4 DFlash
#: ran 0.89x / 0.67x of `ar` on HumanEval / MT-Bench, at batch 2 1.07x / 0.83x (BENCHMARKS.md,
#: session 12): batched `ar` reads each weight once for all rows, and a CPU verify pass pays compute
#: for every row's drafts.
CPU_MAX_CONCURRENCY = 1


def auto_max_concurrency(device: torch.device | str) -> int | None:
    """The concurrency limit "auto" stands for on `device`: `CPU_MAX_CONCURRENCY` on a CPU, None (always
    speculate) elsewhere until a GPU measurement says otherwise."""
    return CPU_MAX_CONCURRENCY if torch.device(device).type == "cpu" else None


def auto_tree_topk(device: torch.device | str) -> int:
    """The draft-tree width "auto" stands for on `device`: `CPU_TREE_TOPK` on a CPU (measured faster
    than the chain there), 1 (the paper's chain) elsewhere until a GPU measurement says otherwise."""
    return CPU_TREE_TOPK if torch.device(device).type == "cpu" else 1


def check_draft_len(block_size: int, max_draft_len: int | None) -> int:
    """The max_draft_len a block of `block_size` verifies per step: `max_draft_len`, or block_size - 1
    when None. `load_pipeline` calls it with the drafter's config BEFORE any weights load.

    Raises:
        ConfigError: block_size < 2, or max_draft_len outside [1, block_size - 1] (a block holds the
            last verified token and block_size - 1 drafts).
    """
    if block_size < 2:
        raise ConfigError(f"block size must be >= 2, got {block_size}")
    k = block_size - 1 if max_draft_len is None else max_draft_len
    if not 1 <= k <= block_size - 1:
        fix = (f"use --max-draft-len {block_size - 1} or less, or raise --block-size" if k > block_size - 1
               else "use --max-draft-len 1 or more")
        raise ConfigError(f"max_draft_len must be in [1, block_size - 1 = {block_size - 1}], got {k}; a block holds "
                          f"the last verified token and block_size - 1 drafts ({fix})")
    return k


def check_prompt_lookup(prompt_lookup: int | str, max_draft_len: int) -> int | str:
    """`prompt_lookup` ("auto" or an int in [0, max_draft_len]) as given; see `check_draft_len`.

    Raises:
        ConfigError: anything else (copied drafts share the step's max_draft_len).
    """
    if prompt_lookup == "auto":
        return prompt_lookup
    if isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) or not 0 <= prompt_lookup <= max_draft_len:
        raise ConfigError(f'prompt_lookup must be "auto" or an integer in [0, max_draft_len = {max_draft_len}] '
                          f"(0 = off), got {prompt_lookup!r}: copied drafts share the step's max_draft_len "
                          "(lower --prompt-lookup, or raise --max-draft-len / --block-size)")
    return prompt_lookup


class DFlashProposer:
    """Drafts blocks of `block_size` tokens with a DFlash drafter over a shared target.

    The block input is [last verified token, mask x (block_size - 1)] embedded with the target's
    embedding; draft logits use the target's lm_head (both frozen, not part of the drafter).

    `max_draft_len` (TensorRT-LLM's name; vLLM: num_speculative_tokens) caps how many of the block's
    drafts are handed to verification: the drafter still runs the whole block (the bidirectional
    attention it was trained with), only the first `max_draft_len` positions get draft logits, and
    the target verifies max_draft_len + 1 tokens per step. Default block_size - 1 (the paper's
    setting). A smaller value pays when late positions are rarely accepted and verifying a position
    costs more than it gains (a weak drafter on a compute-bound device).

    `draft_confidence` (dynamic draft length; 0 = off) cuts each row's draft where the drafter
    itself stops being confident: the row verifies its first m drafts, m the longest prefix whose
    product of the drafter's top-token probabilities (q's largest entry at each position) is
    >= draft_confidence; m may be 0 (then the step verifies only the target's own next token).
    The same idea as EAGLE-2's confidence-driven draft tree (Li et al. 2024, "EAGLE-2": the drafter's
    confidence approximates the acceptance rate). It only changes how many drafts are verified,
    and the length is a function of the drafter's outputs alone, so greedy output stays the
    target's and sampling keeps the target's distribution. It pays where verifying a position
    costs real compute (a CPU: the verify pass grows with its length), not on a GPU at batch 1.
    "auto" picks by the target's device, with a lower threshold for rows whose drafts are sampled
    (`auto_draft_confidence`; the attributes `draft_confidence` and `sampled_draft_confidence`); a
    number sets both.

    `tree_topk` > 1 drafts a tree instead of a chain for greedy rows (`dflash_trt.runtime.draft_tree`):
    the top-`tree_topk` tokens of each block position combine into candidate paths, and the
    `max_draft_len` paths with the largest products of draft probabilities (only those >=
    draft_confidence when it is > 0) are verified together in one target pass (max_draft_len is
    then TensorRT-LLM's max_total_draft_tokens: the verify pass still has at most max_draft_len + 1
    tokens). Sampling rows keep the chain (multi-candidate speculative sampling is not implemented).
    "auto" picks by the target's device (`auto_tree_topk`).

    `prompt_lookup` > 0 adds to each greedy row's draft tree up to that many tokens copied from the
    request's own context (`dflash_trt.runtime.prompt_lookup`: what followed the latest earlier
    occurrence of its last 3-4 tokens), merged as one more branch (`draft_tree.add_path`; the tree
    stays within max_draft_len nodes, its least likely drafter nodes making room). The engine keeps
    each request's n-gram index and passes the candidates to `propose`. 0 = off (the paper's
    DFlash); "auto" picks by the target's device (`auto_prompt_lookup`). A sampling row (which drafts a
    chain) drafts the copied tokens instead of its sampled ones when there are any, as argmax drafts
    (q one-hot: speculative sampling accepts each with the target's probability p(x)).

    `max_concurrency` (TensorRT-LLM's speculative-decoding `max_concurrency`): while more requests
    than this are active, the engine decodes them autoregressively, one token per step, and keeps
    the drafter's context up to date; drafting resumes when enough of them have finished. None =
    always speculate (the default); "auto" picks by the target's device (`auto_max_concurrency`).

    Raises:
        ConfigError: block_size < 2, max_draft_len outside [1, block_size - 1],
            draft_confidence outside [0, 1) (and not "auto"), tree_topk < 1 (and not "auto"),
            prompt_lookup outside [0, max_draft_len] (and not "auto"), or max_concurrency < 1 (and
            not None or "auto").
        IncompatibleModelsError / CheckpointError: a speculators-format drafter whose copy of the target's
            embedding or lm_head rows is another model's, or of the wrong shape
            (`dflash_trt.models.speculators.TargetCopies.check`).
    """

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, block_size: int | None = None,
                 sample_drafts: bool = True, max_draft_len: int | None = None,
                 draft_confidence: float | str = 0.0, tree_topk: int | str = 1, prompt_lookup: int | str = 0,
                 max_concurrency: int | str | None = None):
        self.drafter = drafter
        self.target = target
        self.block_size = drafter.config.block_size if block_size is None else block_size  # 0 is refused, not a default
        self.max_draft_len = check_draft_len(self.block_size, max_draft_len)
        sampled_draft_confidence = draft_confidence
        if draft_confidence == "auto":
            draft_confidence = auto_draft_confidence(target.embed_weight.device)
            sampled_draft_confidence = auto_draft_confidence(target.embed_weight.device, sampled=True)
        if (isinstance(draft_confidence, bool) or not isinstance(draft_confidence, (int, float))
                or not 0.0 <= draft_confidence < 1.0):
            raise ConfigError(f'draft_confidence must be "auto" or a number in [0, 1) (0 = verify every draft), '
                              f"got {draft_confidence!r}")
        self.draft_confidence = float(draft_confidence)  # argmax drafts (greedy rows) and trees
        self.sampled_draft_confidence = float(sampled_draft_confidence)  # drafts sampled from q
        if tree_topk == "auto":
            tree_topk = auto_tree_topk(target.embed_weight.device)
        if isinstance(tree_topk, bool) or not isinstance(tree_topk, int) or tree_topk < 1:
            raise ConfigError(f'tree_topk must be "auto" or an integer >= 1 (1 = a chain of drafts, the paper\'s DFlash), '
                              f"got {tree_topk!r}")
        vocab = drafter.config.draft_vocab_size or target.config.vocab_size
        if tree_topk > vocab:
            raise ConfigError(f"tree_topk {tree_topk} is more than the drafter's {vocab} draft tokens; use at most {vocab} "
                              "(the CLI's --tree-topk takes 1 to 16)")
        self.tree_topk = tree_topk
        if prompt_lookup == "auto":
            prompt_lookup = min(auto_prompt_lookup(target.embed_weight.device), self.max_draft_len)
        self.prompt_lookup = check_prompt_lookup(prompt_lookup, self.max_draft_len)
        if max_concurrency == "auto":
            max_concurrency = auto_max_concurrency(target.embed_weight.device)
        if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                            or max_concurrency < 1):
            raise ConfigError(f'max_concurrency must be "auto", None (always speculate) or an integer >= 1, '
                              f"got {max_concurrency!r}")
        self.max_concurrency = max_concurrency
        self.mask_token_id = drafter.config.mask_token_id
        self.sample_drafts = sample_drafts
        self.cache = None
        # reduced draft vocabulary: draft logits use only those rows of the target lm_head (less
        # work per draft), and draft ids map back to target ids
        self.draft_ids = drafter.draft_token_ids()
        copies = getattr(drafter, "target_copies", None)
        if copies:  # a speculators checkpoint's copies of the target's embedding / lm_head rows
            copies.check(target.embed_weight, target.head_weight, self.draft_ids)
            drafter.target_copies = None  # checked: the target's own weights are used, the copies are not kept
        self.draft_head = None if self.draft_ids is None else target.head_weight[self.draft_ids].contiguous()
        self.packed_draft_head: torch.nn.Module | None = None

    def use_packed_linears(self) -> None:
        """Run the drafter's linears and the draft-vocabulary head through the packed CPU float32
        kernel (`dflash_trt.ops.packed_linear`), and its KV injection through the fused op
        (`DFlashDrafter.use_fused_injection`); the target's own layers are packed by the target."""
        from dflash_trt.ops.packed_linear import PackedLinear, use_packed_linears

        self.drafter.use_fused_injection()  # reads k_proj / v_proj before they are packed
        use_packed_linears(self.drafter)
        if self.draft_head is not None:
            self.packed_draft_head = PackedLinear(self.draft_head)

    def speculates(self, active: int) -> bool:
        """Whether a step with `active` requests drafts (`max_concurrency`)."""
        return self.max_concurrency is None or active <= self.max_concurrency

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    @property
    def max_position(self) -> int:
        """Drafting is skipped for blocks that would reach past the drafter's context."""
        return self.drafter.config.max_position_embeddings

    def reset(self, batch: int, capacity: int) -> None:
        self.cache = self.drafter.new_cache(batch, capacity)

    def add_context(self, features: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> None:
        """KV injection of newly committed tokens: features [n, c, fc_in] at positions [n, c]."""
        self.drafter.inject_context(features, positions, self.cache, rows)

    def propose(self, last_tokens: torch.Tensor, starts: torch.Tensor, max_start: int, rows: torch.Tensor | None,
                params: list[SamplingParams], generators: list[torch.Generator | None],
                lookups: list[list[int]] | None = None,
                processing: list[Callable[[torch.Tensor, list[list[int]]], torch.Tensor] | None] | None = None,
                ) -> DraftBatch:
        """Draft max_draft_len tokens per row (one drafter pass over the whole block).

        Args:
            last_tokens: [n] int64 the last verified token of each row (block position 0).
            starts: [n] int64 its absolute position (= committed context length of the row).
            max_start: host int == starts.max().
            rows: [n] cache rows, or None for all rows.
            params / generators: per row; greedy rows draft by argmax, sampling rows sample from q
                (or argmax when `sample_drafts` is False).
            lookups: per row, prompt-lookup candidates for block positions 1, 2, ... (target ids,
                at most `prompt_lookup` of them; [] for none), or None.
            processing: per row, None or its request's logits processing (`Request.scores`: logits [m, V]
                and one history prefix per row -> processed logits), which the row's drafts then follow
                (`_processed`); None for none.
        """
        b = self.block_size
        n = last_tokens.shape[0]
        offsets = torch.arange(b, device=last_tokens.device)
        block = torch.full((n, b), self.mask_token_id, dtype=torch.int64, device=last_tokens.device)
        block[:, 0] = last_tokens
        positions = starts[:, None] + offsets
        embeds = torch.nn.functional.embedding(block, self.target.embed_weight)
        state = self.drafter.encode_block(embeds, positions, self.cache, starts, max_start, rows)
        k, c = self.max_draft_len, LAZY_DRAFT_POSITIONS
        thresholds = self._thresholds(params)
        if min(thresholds) > 0 and k > c:
            # dynamic draft length: positions past the first c matter only while some row's running
            # product of draft confidences is still >= its threshold at c (it only falls); else
            # they get neither the drafter's last layer nor the head, and no chain length or tree
            # path reaches them
            raw = self._draft_logits(self.drafter.block_outputs(state, 1, c + 1))
            logits = self._processed(raw, processing)  # the confidence of the drafts the rows will make
            reach = self._confidence(logits, self._sampled_q(logits, params)).double().prod(1).tolist()  # [n]
            if any(r >= t for r, t in zip(reach, thresholds)):
                raw = torch.cat([raw, self._draft_logits(self.drafter.block_outputs(state, c + 1, k + 1))], 1)
                logits = self._processed(raw, processing)
        else:
            logits = self._processed(self._draft_logits(self.drafter.block_outputs(state, 1, k + 1)), processing)
        trees = self.tree_topk > 1 or (lookups is not None and self.prompt_lookup > 0)
        tree_rows = [r for r, p in enumerate(params) if trees and p.greedy]
        if tree_rows:
            return self._propose_trees(logits, tree_rows, params, generators, lookups)
        return self._chain_drafts(logits, params, generators, lookups)

    def _processed(self, logits: torch.Tensor,
                   processing: list[Callable[[torch.Tensor, list[list[int]]], torch.Tensor] | None] | None,
                   ) -> torch.Tensor:
        """Draft logits [n, m, V'] after each row's logits processing (logit bias, penalties, min_tokens:
        `dflash_trt.runtime.penalties`), so that its drafts follow the distribution the target verifies
        them against (a penalized target rejects the repeats an unprocessed drafter proposes). Draft
        position i's history holds the raw argmax drafts before it (one product for the block; the drafts
        need not be exact: the verifier is). A draft vocabulary goes through the target's ids and back.
        `logits` itself when no row has any (`processing` None or all None)."""
        if processing is None or all(f is None for f in processing):
            return logits
        out = logits.clone()
        raw = greedy_tokens(logits)  # [n, m]
        if self.draft_ids is not None:
            raw = self.draft_ids[raw]
        vocab, m = self.target.config.vocab_size, logits.shape[1]
        for r, process in enumerate(processing):
            if process is None:
                continue
            row = logits[r]
            if self.draft_ids is not None:
                row = row.new_full((m, vocab), float("-inf")).index_copy_(1, self.draft_ids, row)
            row = process(row, chain_prefixes(raw[r].tolist(), 0, m))
            out[r] = row if self.draft_ids is None else row[:, self.draft_ids]
        return out

    def _thresholds(self, params: list[SamplingParams]) -> list[float]:
        """Per row, the draft confidence its drafts are cut at: `sampled_draft_confidence` where its
        drafts are sampled from q, else `draft_confidence`."""
        return [self.sampled_draft_confidence if not p.greedy and self.sample_drafts else self.draft_confidence
                for p in params]

    def _sampled_q(self, logits: torch.Tensor, params: list[SamplingParams]) -> dict[int, torch.Tensor]:
        """q [m, V'] of each row whose drafts are sampled (`probs_from_logits`: its temperature,
        top-k, top-p), from draft logits [n, m, V']."""
        return {r: probs_from_logits(logits[r], p) for r, p in enumerate(params) if not p.greedy and self.sample_drafts}

    def _confidence(self, logits: torch.Tensor, sampled: dict[int, torch.Tensor]) -> torch.Tensor:
        """[n, m] the drafter's probability of its draft at each position of draft logits [n, m, V']:
        q's largest entry, q = softmax(logits), or the row's `sampled` q where its drafts are sampled."""
        confidence = torch.softmax(logits, -1).amax(-1)
        for r, q in sampled.items():
            confidence[r] = q.amax(-1)
        return confidence

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits float32 [n, m, V'] (V' the draft vocabulary, or the target's) of drafter
        hidden states [n, m, H], through the target's lm_head rows."""
        hidden = hidden.to(self.target.embed_weight.dtype)
        if self.draft_head is None:
            return self.target.compute_logits(hidden).float()
        n, m = hidden.shape[:2]  # a 2-D product: a 3-D matmul of a strided slice takes a slow bmm path
        flat = hidden.reshape(n * m, -1)
        logits = self.packed_draft_head(flat) if self.packed_draft_head is not None else head_matmul(flat, self.draft_head)
        return logits.float().view(n, m, -1)

    def _chain_drafts(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None], lookups: list[list[int]] | None = None) -> DraftBatch:
        """Chains of max_draft_len = k drafts per row from draft logits [n, m, V'] of its first m <= k
        positions (the others, out of draft_confidence's reach, are never verified): argmax (greedy
        rows) or sampled from q, cut by draft_confidence (and a sampled chain before a position where the
        row's logits processing leaves no draft token: q has none there); a sampling row with prompt-lookup
        candidates drafts those instead (q one-hot: speculative sampling accepts each with the
        target's probability p(x))."""
        n, m = logits.shape[:2]
        k = self.max_draft_len
        tokens = torch.zeros(n, k, dtype=torch.int64, device=logits.device)
        tokens[:, :m] = greedy_tokens(logits)
        sampled = self._sampled_q(logits, params)  # q [m, V'] per sampling row
        thresholds = self._thresholds(params)
        lengths = None if max(thresholds) == 0 else \
            confident_prefix_lengths(self._confidence(logits, sampled), thresholds)
        probs: list[torch.Tensor | None] = [None] * n
        # sampled drafts come from q and are accepted by p / q: one check (one device sync) per step, not per row;
        # -inf is a probability 0 (a request's min_tokens holding its stop tokens back, `_processed`)
        if sampled and not bool(((logits < float("inf")) | (logits == float("-inf"))).all()):
            raise DFlashError("the drafter produced non-finite draft probabilities (NaN or inf: overflow in this "
                              "dtype, or corrupt activations); try --dtype float32, or another drafter")
        if sampled:
            # a position where the row's logits processing leaves no draft token (a grammar whose next tokens all
            # lie outside a reduced draft vocabulary) has no q to sample from: the row's drafts end before it (a
            # function of the drafter's logits alone, as draft_confidence's cut: the output's distribution stays)
            rows = list(sampled)
            open_ = (~torch.isneginf(logits[rows]).all(-1)).to(torch.int64).cumprod(1).sum(1).tolist()
            if min(open_) < m:
                lengths = [k] * n if lengths is None else lengths
                for r, o in zip(rows, open_):
                    lengths[r] = min(lengths[r], o)
        for r, q in sampled.items():
            q = q[: k if lengths is None else lengths[r]]  # only the drafts the target will verify
            if q.shape[0]:
                tokens[r, : q.shape[0]] = torch.multinomial(q, 1, generator=generators[r])[:, 0]
            if self.draft_ids is not None:  # q over the full vocabulary: zero off the draft vocab
                full = q.new_zeros(q.shape[0], self.target.config.vocab_size)
                q = full.index_copy_(1, self.draft_ids, q)
            probs[r] = q
        if self.draft_ids is not None:
            tokens = self.draft_ids[tokens]
        copied = [r for r, p in enumerate(params) if not p.greedy and lookups is not None and lookups[r]]
        if copied:
            lengths = [k] * n if lengths is None else lengths
            for r in copied:
                tokens[r, : len(lookups[r])] = torch.tensor(lookups[r], device=tokens.device)
                probs[r], lengths[r] = None, len(lookups[r])
        return DraftBatch(tokens, probs, lengths)

    def _propose_trees(self, logits: torch.Tensor, tree_rows: list[int], params: list[SamplingParams],
                       generators: list[torch.Generator | None], lookups: list[list[int]] | None) -> DraftBatch:
        """Drafts of a batch with draft trees in `tree_rows` (module draft_tree; with their
        prompt-lookup candidates merged in) and chains in the others (sampling rows, drafted as
        `propose` does without trees). logits: [n, m, V'] of the first m <= max_draft_len = k
        positions (the others are out of draft_confidence's reach: no tree node goes there)."""
        n, m = logits.shape[:2]
        k = self.max_draft_len
        chain_rows = [r for r in range(n) if r not in tree_rows]
        chain = DraftBatch(logits.new_zeros(n, k, dtype=torch.int64), [None] * n, [k] * n)
        if chain_rows:  # the chain path on those rows alone
            idx = torch.tensor(chain_rows, device=logits.device)
            sub = self._chain_drafts(logits[idx], [params[r] for r in chain_rows], [generators[r] for r in chain_rows],
                                     None if lookups is None else [lookups[r] for r in chain_rows])
            chain.tokens[idx] = sub.tokens
            for j, r in enumerate(chain_rows):
                chain.probs[r] = sub.probs[j]
                chain.lengths[r] = k if sub.lengths is None else sub.lengths[j]
        parents = chain_parents(n, k, logits.device)
        # (a position whose processing leaves no draft token: probabilities 0, not NaN, so no path goes there)
        top_p, top_i = torch.softmax(logits[tree_rows], -1).nan_to_num_(0.0).topk(self.tree_topk, -1)  # [t, m, topk]
        if self.draft_ids is not None:
            top_i = self.draft_ids[top_i]
        tokens = chain.tokens
        top_p, top_i = top_p.tolist(), top_i.tolist()  # one device sync each, not one per row
        for j, r in enumerate(tree_rows):
            toks, pars = build_tree(top_p[j], top_i[j], k, self.draft_confidence)
            if lookups is not None and lookups[r]:
                toks, pars = add_path(toks, pars, lookups[r][: self.prompt_lookup], k)
            if toks:
                tokens[r, : len(toks)] = torch.tensor(toks, device=tokens.device)
                parents[r, : len(toks)] = torch.tensor(pars, device=tokens.device)
            chain.lengths[r] = len(toks)
        return DraftBatch(tokens, chain.probs, chain.lengths, parents)
