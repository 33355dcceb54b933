"""Tensor parallelism of a gpt-oss target (gloo on this CPU): every expert split along its intermediate features
(interleaved gate/up pairs kept together, down_proj's bias added once), the sinks split with their heads, the
router replicated; the ranks agree, greedy DFlash equals greedy AR under tp, and the tokens are one process's."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import ConfigError
from tests.models.gpt_oss_helpers import make_gpt_oss_model, write_gpt_oss_drafter
from tests.runtime.test_tensor_parallel import reference, run_tp


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory, smollm2_path):
    """A tiny gpt-oss target with SmolLM2's tokenizer (the TP worker also decodes under a JSON grammar) and an
    untrained drafter."""
    root = tmp_path_factory.mktemp("tp-gpt-oss")
    _, target = make_gpt_oss_model(root / "target", tokenizer_from=smollm2_path, vocab_size=49152)
    return target, write_gpt_oss_drafter(root / "drafter", target)


def test_tp2_gpt_oss_ranks_agree_and_match_one_process(tmp_path, tiny_gpt_oss):
    prompts = [[1, 520, 3011, 44, 7, 90, 91, 92, 93], [9, 8, 7]]  # 9 tokens: past the window of 5
    ranks = run_tp(tmp_path, 2, *tiny_gpt_oss, prompts, 10)
    assert ranks[0] == ranks[1]  # the same tokens and the same logits, bit for bit
    assert ranks[0]["dflash"] == ranks[0]["ar"]  # lossless under tp, token for token
    ref_tokens, ref_logits = reference(*tiny_gpt_oss, prompts, 10)
    assert ranks[0]["ar"][0] == ref_tokens
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]), ref_logits, rtol=0, atol=1e-4)
    assert float(ref_logits.abs().max()) > 1


def test_a_tp_size_that_does_not_divide_the_experts_is_refused(tmp_path):
    from dflash_trt.api import load_pipeline

    _, target = make_gpt_oss_model(tmp_path / "target", intermediate_size=36, num_attention_heads=8,
                                   num_key_value_heads=8)
    drafter = write_gpt_oss_drafter(tmp_path / "drafter", target)
    # every gpt-oss layer is sparse: its experts' width (intermediate_size) is the one named, no dense MLP's
    with pytest.raises(ConfigError, match=r"^tp_size 8 does not divide the target's expert MLP intermediate features "
                                          r"\(36\); use a tp_size that divides them: 1, 2, 4$"):
        load_pipeline(str(target), str(drafter), tp_size=8)
