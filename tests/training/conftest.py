"""Tiny training fixtures: a 4-layer random Llama target (vocab 64) written as a HF folder, and
target-written training data made by our engine's "ar" mode (seconds on one CPU thread)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import load_target
from dflash_trt.models.loading import save_checkpoint
from dflash_trt.models.target import TargetModel
from dflash_trt.runtime.engine import Engine
from dflash_trt.training.datagen import generate_dataset, load_shards

VOCAB = 64
EOS = 2
MASK = 3
TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "eos_token_id": EOS, "bos_token_id": 1,
}
DATA_LAYERS = (0, 1, 3)  # drafter features (layers 0, 1) + the last layer (teacher)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A random tiny Llama target saved as config.json + model.safetensors (weights N(0, 0.15):
    sharp logits, so greedy continuations are predictable enough to learn in a few steps)."""
    torch.manual_seed(0)
    cfg = TargetConfig.from_hf_config(TINY)
    model = TargetModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    folder = tmp_path_factory.mktemp("tiny") / "target"
    save_checkpoint(folder, TINY, model.state_dict())
    return folder


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return load_target(tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_prompts():
    """24 random prompts of 4-8 tokens (ids 4..63: no EOS, no mask)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(4, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 9, (24,), generator=gen)]


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory, tiny_target, tiny_prompts):
    out = tmp_path_factory.mktemp("data")
    engine = Engine(tiny_target, None, (EOS,))
    generate_dataset(engine, tiny_prompts, out, DATA_LAYERS, max_new_tokens=40, batch_size=8,
                     settings={"test": True}, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_samples(tiny_data_dir):
    return load_shards(tiny_data_dir)


def word_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over the tiny vocabulary ("w0".."w63" -> ids 0..63, EOS "w2"; `vocab` words in
    all), no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token=f"w{EOS}")


@pytest.fixture(scope="session")
def target_with_tokenizer(tiny_target_dir, tmp_path_factory):
    """The tiny target plus a word-level tokenizer ("w0".."w63" -> ids 0..63), no chat template."""
    import shutil

    folder = tmp_path_factory.mktemp("tok") / "target"
    shutil.copytree(tiny_target_dir, folder)
    word_tokenizer().save_pretrained(folder)
    return folder
