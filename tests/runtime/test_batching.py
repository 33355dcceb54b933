"""Ragged batches on a tiny model: requests finish at different steps (their cache rows are dropped
as they finish) and each output still equals the request decoded alone."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.kv_cache import KVCache
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    _, folder = make_hf_model(tmp, "llama", vocab=96, seed=7)
    target = load_target(folder)
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 3])
    drafter = load_drafter(init_drafter(dcfg, tmp / "d", seed=2))
    return Engine(target, DFlashProposer(drafter, target))


@pytest.mark.parametrize("mode", ["dflash", "ar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_finishing_at_different_steps(engine, mode, temperature):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (3, 11, 6, 17, 1, 9)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, seed=i, ignore_eos=True)
              for i, m in enumerate((5, 23, 1, 12, 30, 8))]
    alone = [engine.generate([p], [sp], mode)[0].token_ids for p, sp in zip(prompts, params)]
    together = engine.generate(prompts, params, mode)
    assert [r.token_ids for r in together] == alone
    assert [len(r.token_ids) for r in together] == [5, 23, 1, 12, 30, 8]


def test_keep_rows_drops_and_reorders_rows():
    cache = KVCache(1, 3, 1, 4, 2)
    for r in range(3):
        cache.k[0][r] = r
        cache.set_length(r, r + 1)
    cache.keep_rows([2, 0])
    assert cache.batch == 2 and cache.lengths == [3, 1]
    assert cache.k[0][0].unique().tolist() == [2.0] and cache.k[0][1].unique().tolist() == [0.0]
