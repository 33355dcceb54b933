"""The steps of `dflash-trt train-drafter`, each resumable: prompts -> target data -> train -> export.

Work folder layout: `data/` (the target-written data cache, see `datagen`), `run/` (trainer
checkpoints, see `trainer`). The final drafter goes to `--out` through a temporary folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from dflash_trt.errors import ConfigError
from dflash_trt.training.datagen import DataStats, generate_dataset, prompts_fingerprint
from dflash_trt.training.prompts import Prompt, default_corpus, encode_prompt, load_prompts_jsonl


def load_target_and_tokenizer(target: str | Path | None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(target path, TargetModel, tokenizer, stop ids) for a HF folder (None = the embedded default),
    the model moved to `device` ("cpu", "cuda", "cuda:N").

    Raises:
        ConfigError: `device` is a CUDA device but torch sees no GPU.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from dflash_trt.api import load_tokenizer, stop_token_ids
    from dflash_trt.models.checkpoints import check_device, load_target
    from dflash_trt.models.default import default_target_path

    path = Path(target) if target is not None else default_target_path()
    check_device(device)
    model = load_target(path, dtype, device)
    tokenizer = load_tokenizer(path)
    return path, model, tokenizer, stop_token_ids(path, model.config)


def training_prompts(prompts_file: str | Path | None, num_chat: int | None = None,
                     num_code: int | None = None) -> list[Prompt]:
    """User prompts from a JSONL file, or the default corpus (see `prompts`). A conversation that ends with
    assistant turns (the usual shape of SFT datasets: ShareGPT, UltraChat) loses them, with one stderr line
    counting such conversations: the target writes its own answer there (DFlash trains on the target's responses,
    paper sec. 4.2); kept, the chat template's generation prompt would follow the finished turn, a layout
    that serving never produces."""
    if prompts_file is None:
        return default_corpus(num_chat, num_code)
    prompts = load_prompts_jsonl(prompts_file)
    ended = [i for i, p in enumerate(prompts) if not isinstance(p, str) and p[-1]["role"] == "assistant"]
    for i in ended:
        turns = list(prompts[i])
        while turns[-1]["role"] == "assistant":
            turns.pop()
        prompts[i] = turns
    if ended:
        print(f"note: {len(ended)} of {len(prompts)} prompts in {prompts_file} end with an assistant turn (the "
              f"first is prompt {ended[0] + 1}); it is dropped and the target writes its own answer "
              "there", file=sys.stderr, flush=True)
    return prompts


MIN_PROMPT_BUDGET = 384
"""Prompt tokens always kept (the built-in corpus's prompts fit in it; a longer window keeps more)."""


def prompt_budget(max_seq_len: int, max_new_tokens: int, context_len: int | None = None) -> int:
    """The prompt tokens train-drafter keeps: max(MIN_PROMPT_BUDGET, max_seq_len - max_new_tokens), so a
    window of --max-seq-len tokens holds a whole prompt and its response (512 - 128 = 384 by default);
    windows under 512 still keep 384 (the trainer cuts each sample at the window, and a prompt that
    fills it alone is refused: `trainer.check_prompt_window`). With the target's `context_len`, at most
    context_len - 1 (a longer prompt would stop the data generation with PromptTooLongError).
    """
    budget = max(MIN_PROMPT_BUDGET, max_seq_len - max_new_tokens)
    return min(budget, context_len - 1) if context_len is not None else budget


def encode_all(tokenizer, prompts: list[Prompt], target_path: Path, max_prompt_len: int,
               warn: bool = False) -> list[list[int]]:
    """Tokenize every prompt; prompts longer than `max_prompt_len` tokens are cut to their last
    `max_prompt_len` tokens (the end holds the generation prompt). `warn` prints one stderr line
    counting the cut prompts (`build_data` sets it; a check on a few prompts need not).

    Raises:
        ConfigError: `max_prompt_len` < 1; messages with a target that has no chat template.
    """
    if max_prompt_len < 1:
        raise ConfigError(f"max prompt length must be >= 1, got {max_prompt_len}")
    ids = [encode_prompt(tokenizer, p, f"the target at {target_path}") for p in prompts]
    cut = [i for i, x in enumerate(ids) if len(x) > max_prompt_len]
    if warn and cut:
        first, are = cut[0], "is" if len(cut) == 1 else "are"
        print(f"warning: {len(cut)} of {len(ids)} prompt{'' if len(ids) == 1 else 's'} {are} longer than "
              f"{max_prompt_len} tokens (the first is prompt {first + 1}, {len(ids[first])} tokens); each keeps its "
              f"last {max_prompt_len} tokens (the end holds the generation prompt); shorten them to keep their "
              "beginning", file=sys.stderr, flush=True)
    return [x[-max_prompt_len:] for x in ids]


def build_data(target_path: Path, model, tokenizer, stops, prompts: list[Prompt], work_dir: str | Path,
               layer_ids: tuple[int, ...], max_new_tokens: int = 128, batch_size: int = 64,
               max_prompt_len: int = MIN_PROMPT_BUDGET, progress: bool = True, max_samples: int | None = None,
               max_seq_len: int | None = None) -> DataStats:
    """Regenerate the training responses with the target (float32, greedy) into work_dir/data, each
    prompt cut to its last `max_prompt_len` tokens (one stderr warning counts the cut ones, `encode_all`).
    With `max_seq_len` (the training window), prompts that would all fill it are refused before any
    generation (`trainer.check_prompt_window`).

    Raises:
        ConfigError: messages with a target that has no chat template.
        DFlashError: work_dir/data holds data made with other settings; every prompt fills max_seq_len.

    `layer_ids` empty caches tokens only (features computed online while training, see `features`).
    """
    from dflash_trt.runtime.engine import Engine

    ids = encode_all(tokenizer, prompts, target_path, max_prompt_len, warn=True)
    if max_seq_len is not None:
        from dflash_trt.training.trainer import check_prompt_window

        check_prompt_window([len(x) for x in ids], max_seq_len)
    engine = Engine(model, None, stops)
    # the target's name, not its path: a cache made on one machine is valid on another; its weights' fingerprint:
    # another model in a folder of the same name (a fine-tuned one saved over it) does not reuse this data
    from dflash_trt.models.loading import weights_fingerprint

    settings = {"target": Path(target_path).resolve().name, "target_weights": weights_fingerprint(target_path),
                "prompts_sha256": prompts_fingerprint(prompts),
                "max_prompt_len": max_prompt_len, "dtype": "float32"}
    return generate_dataset(engine, ids, Path(work_dir) / "data", tuple(layer_ids), max_new_tokens, batch_size,
                            settings, progress, max_samples)


def feature_columns(data_layer_ids: tuple[int, ...], wanted: tuple[int, ...], hidden: int) -> torch.Tensor:
    """Column indices [len(wanted) * hidden] of `wanted` layers inside cached features of `data_layer_ids`.

    Raises:
        ConfigError: a wanted layer was not recorded in the data cache.
    """
    missing = [i for i in wanted if i not in data_layer_ids]
    if missing:
        raise ConfigError(f"target layers {missing} are not in the data cache (it holds {list(data_layer_ids)}); "
                          "regenerate the data with those layers")
    return torch.cat([torch.arange(hidden) + data_layer_ids.index(i) * hidden for i in wanted])


def make_train_data(samples: list[dict], data_layer_ids: tuple[int, ...], drafter_layer_ids: tuple[int, ...],
                    target, draft_ids: torch.Tensor | None, soft_labels: bool = True, max_seq_len: int = 512):
    """TrainData (see `trainer.TrainData`) from data-cache samples.

    The teacher hidden state is the target's LAST layer entry of the cache (its final-normed output).
    draft_ids None means the full vocabulary. Samples without "features" (a tokens-only cache) get
    features computed online by the target (`features.OnlineFeatures`, cut at `max_seq_len`).
    """
    from dflash_trt.training.features import OnlineFeatures
    from dflash_trt.training.trainer import TrainData
    from dflash_trt.training.vocab import target_to_draft

    hidden = target.config.hidden_size
    vocab = target.config.vocab_size
    ids = draft_ids if draft_ids is not None else torch.arange(vocab)
    ids = ids.to(target.head_weight.device)
    head = target.head_weight.detach()[ids].float().contiguous()
    t2d = target_to_draft(ids.cpu(), vocab)
    if samples and "features" not in samples[0]:
        tokens = [s["tokens"] for s in samples]
        online = OnlineFeatures(target, tokens, tuple(drafter_layer_ids), soft_labels, max_seq_len)
        return TrainData(tokens, [s["prompt_len"] for s in samples], None, None, t2d, head,
                         target.embed_weight.detach(), online)
    cols = feature_columns(tuple(data_layer_ids), tuple(drafter_layer_ids), hidden)
    last = target.config.num_hidden_layers - 1
    tcols = feature_columns(tuple(data_layer_ids), (last,), hidden) if soft_labels else None
    contiguous = bool((cols == torch.arange(cols[0], cols[0] + cols.numel())).all())
    feats, teach = [], []
    for s in samples:
        f = s["features"]
        feats.append(f[:, int(cols[0]) : int(cols[0]) + cols.numel()] if contiguous else f[:, cols])
        if tcols is not None:
            teach.append(f[:, int(tcols[0]) : int(tcols[0]) + hidden])
    return TrainData([s["tokens"] for s in samples], [s["prompt_len"] for s in samples], feats,
                     teach if tcols is not None else None, t2d, head, target.embed_weight.detach())
