"""`dflash_trt.training.evaluate.evaluate`: tau + greedy parity per set, a cache that skips repeated
decodes, and one progress line per decode."""

import torch

from conftest import EOS, MASK, word_tokenizer
from dflash_trt.models.checkpoints import new_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.training.evaluate import evaluate


def test_evaluate_reports_parity_caches_and_prints_progress(tmp_path, tiny_target, capsys):
    torch.manual_seed(0)
    drafter = DFlashDrafter(new_drafter_config(tiny_target.config, 1, 4, MASK, [0, 1])).eval()
    sets = {"tiny": ["w5 w6 w7 w9", "w8 w9 w10", "w11 w4 w30 w31 w7"]}
    cache = tmp_path / "cache.json"
    args = (tiny_target, word_tokenizer(), (EOS,), {"d": drafter}, sets, 12, None, cache)
    first = evaluate(*args, drafter_keys={"d": "k1"}, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("evaluate: tiny: autoregressive reference, 3 prompts, ")
    entry = first["sets"]["tiny"]["drafters"]["d"]
    assert err[1].startswith(f"evaluate: tiny: d: tau {entry['tau']:.3f}, parity 3/3, ")
    assert entry["parity"] and entry["tau"] >= 1.0 and first["sets"]["tiny"]["prompts"] == 3
    again = evaluate(*args, drafter_keys={"d": "k1"}, progress=True)  # everything cached: no decode
    assert capsys.readouterr().err == "" and again["sets"]["tiny"]["drafters"]["d"] == entry
