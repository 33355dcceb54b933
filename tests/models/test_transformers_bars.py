"""`no_transformers_bars`: transformers' progress bars ("Loading weights", "Writing model shards", the GGUF
reader's) stay out of our commands' output where they load or save with transformers; our own tqdm bars stay."""

from __future__ import annotations

import torch

from dflash_trt.models.loading import no_transformers_bars
from tests.conftest import tiny_hf_config


def save_and_load(folder) -> None:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_hf_config(layers=1), dtype=torch.float32).save_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_transformers_bars_are_off_in_the_block_and_restored_after(tmp_path, capsys):
    """Outside the block, save_pretrained and from_pretrained write transformers' bars to stderr (so the check can
    fail); inside, none, while a tqdm bar of our own still shows, and the GGUF reader's tqdm is silenced; after
    it, transformers' switch and the GGUF reader's tqdm are what they were."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    import transformers.modeling_gguf_pytorch_utils as gguf

    original = gguf.tqdm
    save_and_load(tmp_path / "loud")
    loud = capsys.readouterr().err
    assert "Writing model shards" in loud and "Loading weights" in loud
    with no_transformers_bars():
        save_and_load(tmp_path / "quiet")
        list(gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
        list(tqdm(range(3), desc="train drafter"))
    quiet = capsys.readouterr().err
    assert "Writing model shards" not in quiet and "Loading weights" not in quiet and "GGUF" not in quiet
    assert "train drafter" in quiet
    assert hf_logging.is_progress_bar_enabled() and gguf.tqdm is original
    hf_logging.disable_progress_bar()  # off before (HF_HUB_DISABLE_PROGRESS_BARS): left off
    try:
        with no_transformers_bars():
            pass
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
