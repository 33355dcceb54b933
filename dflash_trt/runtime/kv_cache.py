"""KV caches that own their buffers, are written by absolute position and roll back in O(1).

Both the target's cache and the drafter's context cache use `KVCache`: for the target a row holds
the K/V of every token it has processed; for the drafter a row holds the projected context K/V
(after k_norm and RoPE) of every committed token (DFlash paper sec. 3.2, "KV injection").
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated K/V buffers for `num_layers` layers.

    Buffers are [batch, kv_heads, capacity, head_dim]; slot j of a row holds the token at absolute
    position j. `lengths[r]` is the number of committed positions of row r. Rollback is
    `set_length(r, n)`: a pointer move; slots >= n are stale and get overwritten by the next write
    at those positions before any attention reads them (attention masks by position).
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.batch = batch
        self.lengths = [0] * batch

    def write(self, layer: int, rows: torch.Tensor | None, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [n, kv_heads, t, head_dim] at `positions` [n, t] (int64) of `rows` [n]
        (None = all rows, n == batch).

        Raises:
            IndexError: a position is >= capacity.
        """
        if rows is None:
            rows = torch.arange(self.batch, device=positions.device)
        idx_rows = rows[:, None]
        self.k[layer][idx_rows, :, positions] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][idx_rows, :, positions] = v.transpose(1, 2).to(self.v[layer].dtype)

    def read(self, layer: int, rows: torch.Tensor | None, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of slots [0, kv_len) of `rows`: two tensors [n, kv_heads, kv_len, head_dim]."""
        if rows is None:
            return self.k[layer][:, :, :kv_len], self.v[layer][:, :, :kv_len]
        return self.k[layer][rows, :, :kv_len], self.v[layer][rows, :, :kv_len]

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (kept in that order): one copy of the buffers per call, so a
        batch whose finished requests leave reads contiguous buffers again on every later step."""
        if rows == list(range(self.batch)):
            return
        idx = torch.tensor(rows, device=self.k[0].device)
        self.k = [t.index_select(0, idx) for t in self.k]
        self.v = [t.index_select(0, idx) for t in self.v]
        self.lengths = [self.lengths[r] for r in rows]
        self.batch = len(rows)

    def set_length(self, row: int, length: int) -> None:
        """Commit (or roll back to) `length` positions of `row`: O(1), no data moves."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        self.lengths[row] = length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
