"""KV caches that own their buffers, are written by absolute position, roll back in O(1) and grow on demand.

Both the target's cache and the drafter's context cache use `KVCache`: for the target a row holds
the K/V of every token it has processed; for the drafter a row holds the projected context K/V
(after k_norm and RoPE) of every committed token (DFlash paper sec. 3.2, "KV injection").

A cache is sized for what its rows hold now plus some headroom, not for the most they could ever hold:
its owner (`dflash_trt.runtime.decode_batch.DecodeBatch`) calls `reserve` before a step could write past
the capacity (doubling it, up to what its rows can need at most) and `keep_rows` when rows leave, so memory
follows the tokens actually produced, not `max_tokens`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch


class KVCache:
    """K/V buffers for `num_layers` layers, of `capacity` slots per row until `reserve` grows them.

    Buffers are [batch, kv_heads, capacity, head_dim]; slot j of a row holds the token at absolute
    position j. New slots are zeros (a masked slot that attention reads before anything was written there
    must be finite: a masked NaN would still poison the weighted sum). `lengths[r]` is the number of committed positions of row r. Rollback is
    `set_length(r, n)`: a pointer move; slots >= n are stale and get overwritten by the next write
    at those positions before any attention reads them (attention masks by position).
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        # one buffer [2 (k, v), layers, batch, kv_heads, capacity, head_dim]; k[l] and v[l] are views
        self._set_buffer(torch.zeros((2, num_layers, batch, kv_heads, capacity, head_dim), dtype=dtype, device=device))
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

    def keep_rows(self, rows: list[int], capacity: int | None = None) -> None:
        """Drop every row not in `rows` (kept in that order) and, with a `capacity` below the current one,
        every slot from `capacity` on (the kept rows need no more: the memory of requests that left is
        freed): one copy of the buffers per call, so a batch whose finished requests leave reads
        contiguous buffers again on every later step.

        Raises:
            ValueError: a kept row's length is above `capacity`."""
        capacity = self.capacity if capacity is None else min(capacity, self.capacity)
        if rows == list(range(self.batch)) and capacity == self.capacity:
            return
        if any(self.lengths[r] > capacity for r in rows):
            raise ValueError(f"cannot keep {capacity} slots of rows holding up to {max(self.lengths[r] for r in rows)}")
        self._set_buffer(self._rows_copy(rows, capacity))
        self.lengths = [self.lengths[r] for r in rows]
        self.batch = len(rows)
        self.capacity = capacity

    def take_rows(self, rows: list[int], capacity: int | None = None) -> KVCache:
        """A new cache holding a copy of `rows` (in that order, with their lengths) and the first `capacity`
        slots (default: all); this one is unchanged. With `keep_rows` of the others, it splits a cache in two.

        Raises:
            ValueError: a taken row's length is above `capacity`."""
        capacity = self.capacity if capacity is None else min(capacity, self.capacity)
        if any(self.lengths[r] > capacity for r in rows):
            raise ValueError(f"cannot take {capacity} slots of rows holding up to {max(self.lengths[r] for r in rows)}")
        part = copy.copy(self)
        part._set_buffer(self._rows_copy(rows, capacity))
        part.lengths = [self.lengths[r] for r in rows]
        part.batch = len(rows)
        part.capacity = capacity
        return part

    def _rows_copy(self, rows: list[int], capacity: int) -> torch.Tensor:
        """A new contiguous buffer of `rows` (in that order) and their first `capacity` slots: one copy of only
        those (gathering whole rows first, then cutting, copied a huge buffer twice)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.buffer.device)
        return self.buffer[:, :, :, :, :capacity].index_select(2, index)

    def reserve(self, capacity: int) -> None:
        """Make room for at least `capacity` slots per row: with fewer now, the buffers are replaced by zeroed
        ones of exactly `capacity` slots into which the current slots (all of them: chunked prefill writes slots
        before it commits them) are copied once; with as many or more, nothing happens. The caller picks the
        growth (`DecodeBatch` doubles, capped at what its rows can need, so a row's slots are copied
        O(log(length)) times in all). Views from `read` / `read_row` taken before are of the old buffers.

        Raises:
            ValueError: capacity < 0."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if capacity > self.capacity:
            self._set_buffer(_with_capacity(self.buffer, capacity))
            self.capacity = capacity

    def append_rows(self, other: KVCache) -> None:
        """Append the rows of `other` (same layers, heads, head_dim, dtype and device) after this cache's
        rows, with their lengths: a request joining a running batch. The capacity becomes the larger of
        the two (slots past a row's own capacity are zeros, never read before written).

        Raises:
            ValueError: `other` has another layout (layers, KV heads, head_dim, dtype or device)."""
        a, b = self.buffer, other.buffer
        if a.shape[:2] + a.shape[3:4] + a.shape[5:] != b.shape[:2] + b.shape[3:4] + b.shape[5:] \
                or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(f"cannot append a KV cache of shape {tuple(b.shape)} {b.dtype} on {b.device} to one of "
                             f"{tuple(a.shape)} {a.dtype} on {a.device}")
        capacity = max(self.capacity, other.capacity)
        self._set_buffer(torch.cat([_with_capacity(a, capacity), _with_capacity(b, capacity)], dim=2))
        self.lengths = self.lengths + other.lengths
        self.batch += other.batch
        self.capacity = capacity

    def copy_slots(self, src_rows: list[int], dst_rows: list[int], begin: int, end: int) -> None:
        """Copy the K/V of slots [begin, end) of row src_rows[i] to row dst_rows[i], in every layer (a prompt
        read once for several rows). The destination rows must not be among the sources."""
        dev = self.buffer.device
        dst, src = torch.tensor(dst_rows, device=dev), torch.tensor(src_rows, device=dev)
        self.buffer[:, :, dst, :, begin:end] = self.buffer[:, :, src, :, begin:end]

    def read_row(self, row: int, length: int) -> torch.Tensor:
        """The K/V of slots [0, length) of `row` in every layer: [2 (k, v), layers, kv_heads, length, head_dim],
        this cache's dtype and device. A view, not a copy (what `PrefixCache.store` reads, copying only the part
        its tree lacks): valid until the cache writes those slots again.

        Raises:
            ValueError: length outside [0, capacity]."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        return self.buffer[:, :, row, :, :length]

    def import_row(self, row: int, kv: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Write `kv` ([2, layers, kv_heads, n, head_dim], as `read_row` gives it for a cache of the same layout;
        or a sequence of such parts, consecutive in the token axis, n their total: a `PrefixEntry`'s
        `target_parts`, written without joining them first) to slots [0, n) of `row`, and commit them: the
        row's length becomes n.

        Raises:
            ValueError: another layout, or n above the capacity."""
        b = self.buffer
        parts = [kv] if isinstance(kv, torch.Tensor) else list(kv)
        n = sum(p.shape[3] if p.dim() == 5 else 0 for p in parts)
        for p in parts:
            if p.dim() != 5 or p.shape[:3] != b.shape[:2] + b.shape[3:4] or p.shape[4] != b.shape[5] \
                    or n > self.capacity:
                raise ValueError(f"cannot import K/V of shape {tuple(p.shape)} (of {n} slots in all) into a row of a "
                                 f"cache of shape {tuple(b.shape)} (capacity {self.capacity})")
        at = 0
        for p in parts:
            b[:, :, row, :, at:at + p.shape[3]] = p.to(device=b.device, dtype=b.dtype)
            at += p.shape[3]
        self.lengths[row] = n

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots `src` of `row` to slots `dst` in every layer (the accepted path of a
        draft tree to consecutive positions). The sources are read before any destination is
        written, so the two lists may overlap."""
        if src == dst:
            return
        dev = self.buffer.device
        rows = self.buffer[:, :, row]  # [2, layers, kv_heads, capacity, head_dim], a view
        rows[:, :, :, torch.tensor(dst, device=dev)] = rows[:, :, :, torch.tensor(src, device=dev)]

    def _set_buffer(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.k = list(buffer[0].unbind(0))
        self.v = list(buffer[1].unbind(0))

    def set_length(self, row: int, length: int) -> None:
        """Commit (or roll back to) `length` positions of `row`: O(1), no data moves."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside [0, {self.capacity}]")
        self.lengths[row] = length

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def _with_capacity(buffer: torch.Tensor, capacity: int) -> torch.Tensor:
    """A [2, layers, batch, heads, capacity, head_dim] buffer with `capacity` slots (zeros added at the end)."""
    if buffer.shape[4] == capacity:
        return buffer
    out = buffer.new_zeros(buffer.shape[:4] + (capacity,) + buffer.shape[5:])
    out[:, :, :, :, : buffer.shape[4]] = buffer
    return out
