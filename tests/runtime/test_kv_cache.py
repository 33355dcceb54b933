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
