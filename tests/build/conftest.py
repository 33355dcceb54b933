"""Fixtures for the build tests: a tiny random Llama target that uses SmolLM2's real tokenizer (vocab
49152, so calibration and chat prompts are real text) with 6 heads / 3 KV heads (tp 3 splits evenly),
a tiny Qwen3 target (QWEN3_TINY: 4 heads / 2 KV heads for tp 2, head_dim 32 so the attention width 128
differs from hidden 96, RoPE theta 1e6), and an untrained drafter for each. Builds of a tiny pair take a
few seconds. `smollm2_path` comes from tests/conftest.py."""

from __future__ import annotations

import pytest

pytest.importorskip("modelopt", reason="build tests need the quantization extra (nvidia-modelopt==0.47.0)")

from build_helpers import QWEN3_TINY, build_bundle, write_tiny_drafter, write_tiny_target


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_target(root / "target", smollm2_path)
    drafter = write_tiny_drafter(root / "drafter", target)
    return target, drafter


@pytest.fixture(scope="session")
def tiny_qwen3_pair(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("tiny-qwen3")
    target = write_tiny_target(root / "target", smollm2_path, model_type="qwen3", **QWEN3_TINY)
    drafter = write_tiny_drafter(root / "drafter", target)
    return target, drafter


@pytest.fixture(scope="session")
def tiny_bundle_fp8_tp3(tmp_path_factory, tiny_pair):
    out = tmp_path_factory.mktemp("bundles") / "tiny-fp8-tp3"
    build_bundle(*tiny_pair, out, quant="fp8", tp_size=3)
    return out
