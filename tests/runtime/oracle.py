"""A test proposer that drafts a KNOWN continuation (optionally corrupted at some block positions),
so the engine's accept/stop/count logic can be driven through full and partial acceptance."""

from __future__ import annotations

import torch

from dflash_trt.runtime.proposer import DraftBatch


class OracleProposer:
    """Drafts references[row][start + 1 : start + 1 + max_draft_len]; draft position j (1-based) is replaced by
    a wrong token when j in `wrong_positions`. `lengths(request, start) -> int`, when given, is the
    dynamic draft length the oracle reports for a row (DraftBatch.lengths). Same interface as DFlashProposer."""

    feature_layer_ids = ()
    prompt_lookup = 0
    max_position = 10**9

    def __init__(self, references: list[list[int]], block_size: int, wrong_positions=(), vocab_size: int = 49152,
                 max_draft_len: int | None = None, lengths=None):
        self.references, self.block_size, self.lengths = references, block_size, lengths
        self.max_draft_len = block_size - 1 if max_draft_len is None else max_draft_len
        self.wrong_positions, self.vocab_size = set(wrong_positions), vocab_size

    def speculates(self, active):
        return True

    def reset(self, batch, capacity):
        self.cache = _RequestRows(batch)

    def add_context(self, features, positions, rows):
        pass

    def propose(self, last_tokens, starts, max_start, rows, params, generators, lookups=None, processing=None):
        ids = [self.cache.requests[r] for r in (rows.tolist() if rows is not None else range(len(starts)))]
        out = torch.zeros(len(ids), self.max_draft_len, dtype=torch.int64)
        for i, (row, s) in enumerate(zip(ids, starts.tolist())):
            ref = self.references[row]
            for j in range(1, self.max_draft_len + 1):
                tok = ref[s + j] if s + j < len(ref) else 0
                out[i, j - 1] = (tok + 1) % self.vocab_size if j in self.wrong_positions else tok
        lengths = None if self.lengths is None else [self.lengths(r, s) for r, s in zip(ids, starts.tolist())]
        return DraftBatch(out, [None] * len(ids), lengths)


class _RequestRows:
    """Stands in for the drafter cache: which request (reference) each row holds as finished
    requests' rows are dropped (`keep_rows`)."""

    def __init__(self, batch: int):
        self.requests = list(range(batch))

    def keep_rows(self, rows: list[int], capacity: int | None = None) -> None:
        self.requests = [self.requests[r] for r in rows]

    def reserve(self, capacity: int) -> None:
        pass  # holds no K/V


def chat_references(pipe, chats: list[str], max_tokens: int) -> tuple:
    """(pipe, chat prompts, greedy AR completions of each decoded alone for exactly `max_tokens` tokens):
    the references an oracle proposer drafts from and the lossless checks compare with."""
    from dflash_trt.runtime.sampling import SamplingParams

    prompts = [pipe.encode_chat(c) for c in chats]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return pipe, prompts, [pipe.engine.generate([p], params, "ar")[0].token_ids for p in prompts]


def record_drafts(proposer) -> list[DraftBatch]:
    """Wrap `proposer.propose` (in place) so that every DraftBatch it returns is also appended to the
    returned list."""
    seen: list[DraftBatch] = []
    propose = proposer.propose

    def recording_propose(*args):
        drafts = propose(*args)
        seen.append(drafts)
        return drafts

    proposer.propose = recording_propose
    return seen
