from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime.kv_cache import KVCache


def test_write_by_position_read_and_rollback():
    cache = KVCache(num_layers=2, batch=3, kv_heads=2, capacity=10, head_dim=4)
    k = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).view(2, 2, 3, 4)
    rows = torch.tensor([0, 2])
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    cache.write(1, rows, pos, k, -k)
    kr, vr = cache.read(1, rows, 8)
    assert torch.equal(kr[0, :, :3], k[0]) and torch.equal(kr[1, :, 5:8], k[1]) and torch.equal(vr[1, :, 5:8], -k[1])
    assert torch.count_nonzero(cache.k[1][1]) == 0 and torch.count_nonzero(cache.k[0]) == 0  # row 1, layer 0 untouched
    cache.set_length(2, 8)
    cache.set_length(2, 6)  # rollback is a pointer move: data stays until overwritten
    assert cache.lengths == [0, 0, 6] and torch.equal(cache.k[1][2, :, 7], k[1, :, 2])
    with pytest.raises(ValueError):
        cache.set_length(0, 11)
    with pytest.raises(IndexError):
        cache.write(0, rows, pos + 5, k, k)


def test_reserve_grows_once_keeping_every_written_slot():
    """reserve copies all current slots (committed or not: a chunked prefill writes before it commits) into a
    zeroed buffer of exactly the asked capacity, keeps lengths, and does nothing when there is room already."""
    cache = KVCache(num_layers=2, batch=2, kv_heads=1, capacity=4, head_dim=3)
    cache.buffer.copy_(torch.randn(cache.buffer.shape))
    before = cache.buffer.clone()
    cache.set_length(1, 3)
    cache.reserve(3)
    assert cache.capacity == 4 and torch.equal(cache.buffer, before)  # room already: untouched
    cache.reserve(9)
    assert (cache.capacity, tuple(cache.buffer.shape), cache.lengths) == (9, (2, 2, 2, 1, 9, 3), [0, 3])
    assert torch.equal(cache.buffer[..., :4, :], before) and torch.count_nonzero(cache.buffer[..., 4:, :]) == 0
    assert cache.k[1].data_ptr() == cache.buffer[0, 1].data_ptr()  # the layer views follow the new buffer
    cache.write(0, None, torch.tensor([[8], [8]]), torch.ones(2, 1, 1, 3), torch.ones(2, 1, 1, 3))  # slot 8 fits now
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        cache.reserve(-1)


def test_keep_rows_copies_only_the_kept_slots():
    cache = KVCache(num_layers=1, batch=3, kv_heads=1, capacity=6, head_dim=2)
    cache.buffer.copy_(torch.randn(cache.buffer.shape))
    before = cache.buffer.clone()
    cache.keep_rows([2, 0], 4)
    assert cache.buffer.is_contiguous() and tuple(cache.buffer.shape) == (2, 1, 2, 1, 4, 2)
    assert torch.equal(cache.buffer, before[:, :, [2, 0], :, :4])
