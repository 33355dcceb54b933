"""Tensor parallelism of a Qwen3-MoE target (gloo on this CPU): every expert split along its intermediate
features, the router replicated; the ranks agree, greedy DFlash equals greedy AR under tp, and the tokens are
one process's."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.errors import ConfigError
from tests.models.qwen3_moe_helpers import make_moe_model, write_moe_drafter
from tests.runtime.test_tensor_parallel import reference, run_tp, torchrun_generate


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, smollm2_path):
    """A tiny Qwen3-MoE target with SmolLM2's tokenizer (the TP worker also decodes under a JSON grammar) and an
    untrained drafter."""
    root = tmp_path_factory.mktemp("tp-moe")
    _, target = make_moe_model(root / "target", tokenizer_from=smollm2_path, vocab_size=49152)
    return target, write_moe_drafter(root / "drafter", target)


def test_tp2_moe_ranks_agree_and_match_one_process(tmp_path, tiny_moe):
    prompts = [[1, 520, 3011, 44, 7], [9, 8, 7]]
    ranks = run_tp(tmp_path, 2, *tiny_moe, prompts, 10)
    assert ranks[0] == ranks[1]  # the same tokens and the same logits, bit for bit
    assert ranks[0]["dflash"] == ranks[0]["ar"]  # lossless under tp, token for token
    ref_tokens, ref_logits = reference(*tiny_moe, prompts, 10)
    assert ranks[0]["ar"][0] == ref_tokens
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]), ref_logits, rtol=0, atol=1e-4)
    assert float(ref_logits.abs().max()) > 1


def test_generate_tp2_moe_under_torchrun_gives_one_process_tokens(tiny_moe):
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    target, drafter = map(str, tiny_moe)
    proc = torchrun_generate(2, "--target", target, "--drafter", drafter, "--tp-size", "2", "--prompt",
                             "The history of", "--max-tokens", "12", "--min-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    pipe = load_pipeline(target, drafter, "float32")
    [one] = pipe.generate([pipe.encode("The history of")], SamplingParams(max_tokens=12, min_tokens=12), mode="ar")
    assert json.loads(lines[0])["token_ids"] == one.token_ids and len(one.token_ids) == 12


def test_a_tp_size_that_does_not_divide_the_experts_is_refused(tmp_path):
    from dflash_trt.api import load_pipeline

    _, target = make_moe_model(tmp_path / "target", moe_intermediate_size=36, num_attention_heads=8,
                               num_key_value_heads=8, intermediate_size=64)
    drafter = write_moe_drafter(tmp_path / "drafter", target)
    with pytest.raises(ConfigError, match=r"tp_size 8 does not divide the target's expert MLP intermediate features "
                                          r"\(36\); use a tp_size that divides them: 1, 2, 4$"):
        load_pipeline(str(target), str(drafter), tp_size=8)
