"""`generate --bundle B --tp-size N` under torchrun: the bundle's target split over the ranks (its FP8 weights
dequantized on load first, as an FP8 --target is), the same tokens as the bundle in one process, printed once.
It was refused ("FP8 / NVFP4 layers are not split"), even for a bundle with no quantized layer."""

from __future__ import annotations

import json

import pytest

from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.test_tensor_parallel import torchrun_generate


@pytest.mark.slow
def test_generate_a_bundle_at_tp3_under_torchrun_gives_the_one_process_tokens(tiny_bundle_fp8_tp3):
    from dflash_trt.api import load_bundle

    prompt = "def add(a, b):"
    proc = torchrun_generate(3, "--bundle", str(tiny_bundle_fp8_tp3), "--tp-size", "3", "--prompt", prompt,
                             "--max-tokens", "12", "--mode", "ar")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    pipe = load_bundle(tiny_bundle_fp8_tp3, load_drafter_model=False)
    [one] = pipe.generate([pipe.encode(prompt)], SamplingParams(max_tokens=12), mode="ar")
    assert json.loads(lines[0])["token_ids"] == one.token_ids and len(one.token_ids) == 12


def test_a_bundle_split_its_heads_do_not_allow_is_refused_before_torchrun(tiny_bundle_fp8_tp3, monkeypatch, capsys):
    """tp 2 of a target with 6 heads / 3 KV heads: the bundle's target config is read (not the default target's)
    and the split refused naming the sizes that work, before the launch under torchrun is asked for."""
    from tests.conftest import run_main

    code, out, err = run_main(monkeypatch, capsys, "generate", "--bundle", str(tiny_bundle_fp8_tp3), "--tp-size", "2",
                              "--prompt", "Hi")
    assert (code, out, err) == (1, "", "error: --tp-size 2 does not divide the target's KV heads (3); use a "
                                       "--tp-size that divides them: 1, 3\n")
