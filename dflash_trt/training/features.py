"""Target features computed online, during training, instead of read from the data cache.

The offline cache (`datagen`) stores bfloat16 features of every consumed token: about
len(layer_ids) * hidden * 2 bytes per token (7 KB for the default target's 6 layers), i.e. tens of
GB for tens of thousands of samples. On a GPU a batched target forward over the training sequences
is cheap, so `train-drafter --online-features` caches only the tokens and computes the features
for each optimizer step's sequences with one target forward (float32, the target's own dtype).

Row p of a sequence's features is the target's output at position p for each requested layer id
(z-lab/dflash's indexing, the same as `datagen`): identical to what the offline cache holds up to
the bfloat16 rounding of that cache.
"""

from __future__ import annotations

import torch

from dflash_trt.models.target import TargetModel


class OnlineFeatures:
    """Callable (sample indices) -> (drafter features, teacher hidden states) for those samples.

    Args:
        target: the frozen target (any device; features come back on its device).
        tokens: per sample int32 [T + 1] prompt + response tokens.
        drafter_layer_ids: the drafter's `target_layer_ids` (features = their outputs, concatenated).
        teacher: also return the final-normed last-layer states (soft labels).
        max_seq_len: sequences are cut to their first max_seq_len + 1 tokens (the trainer's rule).
    """

    def __init__(self, target: TargetModel, tokens: list[torch.Tensor], drafter_layer_ids: tuple[int, ...],
                 teacher: bool, max_seq_len: int):
        self.target = target
        self.tokens = tokens
        self.layer_ids = tuple(drafter_layer_ids)
        self.last = target.config.num_hidden_layers - 1
        self.teacher = teacher
        self.max_seq_len = max_seq_len

    @torch.no_grad()
    def __call__(self, indices: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Features for samples `indices`: (per sample float32 [T_i, len(ids) * hidden], per sample
        float32 [T_i, hidden] or None), T_i = min(len(tokens_i), max_seq_len + 1) - 1."""
        seqs = [self.tokens[i][: self.max_seq_len + 1][:-1].long() for i in indices]
        lens = [s.numel() for s in seqs]
        longest = max(lens)
        dev = self.target.embed_weight.device
        ids = torch.zeros(len(seqs), longest, dtype=torch.int64)
        for r, s in enumerate(seqs):
            ids[r, : lens[r]] = s  # right padding: causal attention never lets a real token see it
        ids = ids.to(dev)
        positions = torch.arange(longest, device=dev).expand(len(seqs), longest)
        cache = self.target.new_cache(len(seqs), longest)
        wanted = self.layer_ids + ((self.last,) if self.teacher else ())
        out = self.target(ids, positions, cache, longest, None, wanted, torch.zeros(len(seqs), 1, dtype=torch.int64,
                                                                                     device=dev))
        width = len(self.layer_ids) * self.target.config.hidden_size
        feats = [out.features[r, : lens[r], :width].float() for r in range(len(seqs))]
        teach = [out.features[r, : lens[r], width:].float() for r in range(len(seqs))] if self.teacher else None
        return feats, teach
