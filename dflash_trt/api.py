r"""Load a ready-to-run engine from checkpoint paths (or the embedded defaults).

    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    pipe = load_pipeline()                      # SmolLM2-135M-Instruct + default drafter, float32
    prompt = pipe.encode_chat("What is the capital of France?")   # chat template applied
    [res] = pipe.generate([prompt], SamplingParams(max_tokens=32))  # mode="dflash" (or "ar")
    print(res.text, res.metrics.acceptance_length)
    [code] = pipe.generate(["def fib(n):"], SamplingParams(max_tokens=32, stop=["\n\n"]))  # plain text, a stop string
"""

from __future__ import annotations

import numbers

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_trt.compat import check_compatible
from dflash_trt.config import DrafterConfig, TargetConfig, read_config_json
from dflash_trt.errors import ConfigError, InvalidRequestError
from dflash_trt.models.target import TargetModel
from dflash_trt.ops.cuda import require_cuda_kernels, resolve_cuda_kernels
from dflash_trt.ops.packed_linear import resolve_cpu_kernels
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer, check_draft_len, check_prompt_lookup
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import GenerationResult
from dflash_trt.text import short_repr

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --dtype name ("float32", "bfloat16", "float16").

    Raises:
        ConfigError: another name.
    """
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def stop_token_ids(target_path: Path, cfg: TargetConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it may list several), else config.json."""
    gen = target_path / "generation_config.json"
    if gen.is_file():
        eos = read_config_json(gen).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return cfg.eos_token_id


#: the tokenizer files AutoTokenizer reads as JSON, the ones `load_tokenizer` names when they are not JSON
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json")


def load_tokenizer(path: Path):
    """The HF tokenizer saved in `path`, loaded by transformers' AutoTokenizer.

    Raises:
        CheckpointError: the folder has no usable tokenizer files: none, or files AutoTokenizer cannot load;
            the message names the first of `TOKENIZER_JSON_FILES` that is not valid JSON (a download or copy
            cut short), else the error AutoTokenizer gave.
    """
    import json

    from transformers import AutoTokenizer

    from dflash_trt.errors import CheckpointError

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - a broken file raises what its reader raises (JSONDecodeError,
        # KeyError, TypeError, the tokenizers library's bare Exception), a folder without tokenizer files OSError
        fix = "copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into the folder"
        for name in TOKENIZER_JSON_FILES:
            file = Path(path) / name
            try:
                json.loads(file.read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as bad:  # ValueError: JSONDecodeError, UnicodeDecodeError
                from dflash_trt.models.default import cached_copy_fix

                again = cached_copy_fix(file) or f"{fix} again (a download or copy cut short leaves a truncated file)"
                raise CheckpointError(f"{file} is not valid JSON ({bad}), so the tokenizer does not load; "
                                      f"{again}") from exc
        why = type(exc).__name__ if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"  # OSError: no files
        raise CheckpointError(f"{path}: no usable tokenizer ({why}); {fix}") from exc


def check_text(text, name: str) -> None:
    """Raises InvalidRequestError when `text` (the argument `name`) is not a str a tokenizer takes (the
    tokenizer's own error is a TypeError naming none of it)."""
    from dflash_trt.text import invalid_unicode

    if not isinstance(text, str):
        raise InvalidRequestError(f"{name} must be a str, got {type(text).__name__}")
    why = invalid_unicode(text)
    if why is not None:
        raise InvalidRequestError(f"{name} holds {why}; give valid Unicode text")


@dataclass
class Pipeline:
    """An engine plus the target's tokenizer."""

    engine: Engine
    tokenizer: Any
    target_path: Path
    drafter_path: Path | None
    #: one-line warnings from loading (`load_bundle`: bundle files altered or missing that it does not load)
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.engine is not None and self.tokenizer is not None:  # guided decoding compiles with the tokenizer
            from dflash_trt.runtime.guided import Grammars

            self.engine.grammars = Grammars(self.tokenizer, self.engine.target.config.vocab_size,
                                            self.engine.eos_token_ids)
            self.engine.detokenize = self._detokenize  # stop strings (SamplingParams.stop)

    def encode_chat(self, message: str | list[dict]) -> list[int]:
        """Token ids of a chat prompt with the target's chat template (generation prompt added).

        `message`: one user message's text, or a conversation: a list of OpenAI-style messages
        ({"role": "system" | "user" | "assistant", "content": text or a list of text parts}). Any conversation is
        taken, as OpenAI's chat API and `dflash-trt serve` take it: an empty user message ("" is the same as
        [{"role": "user", "content": ""}]) or a system prompt alone is rendered as the template renders it (a
        prompts file's conversation, where a blank one is a mistake in the file, needs a user message with text).

        Raises:
            ConfigError: the tokenizer has no chat template.
            InvalidRequestError: `message` is neither, holds a lone surrogate (`text.invalid_unicode`), or a message
                of the list is malformed (`parse_messages`; named by its index).
        """
        from dflash_trt.training.prompts import encode_prompt, parse_messages

        if isinstance(message, list):
            try:
                messages = parse_messages({"messages": message}, "message", user_text=False)  # as the server
            except ConfigError as exc:
                raise InvalidRequestError(str(exc)) from None
            if messages is None:
                raise InvalidRequestError('message is an empty list; give a conversation of at least one {"role": '
                                          '"user", "content": "<text>"} message, or the text of one')
        else:
            if not isinstance(message, str):
                raise InvalidRequestError(f'message must be a str (one user message) or a list of {{"role", "content"}} '
                                          f"messages, got {type(message).__name__}")
            check_text(message, "message")
            messages = [{"role": "user", "content": message}]
        return encode_prompt(self.tokenizer, messages, f"the target at {self.target_path}")

    def encode(self, text: str) -> list[int]:
        """Token ids of plain `text` (no chat template).

        Raises:
            InvalidRequestError: `text` is not a str, or holds a lone surrogate (`text.invalid_unicode`).
        """
        check_text(text, "text")
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids) -> str:
        """Text of token ids (special tokens such as EOS left out, spacing as the tokenizer writes it).

        `ids`: a flat sequence of token ids: a list or tuple of ints, or a 1-D integer numpy array or torch
        tensor (e.g. a `GenerationResult.token_ids`).

        Raises:
            InvalidRequestError: `ids` is not such a sequence (names what it is), or holds an id outside
                the vocabulary [0, the target's vocab_size) (the tokenizer itself decodes one to '' silently).
        """
        if hasattr(ids, "tolist") and hasattr(ids, "ndim"):  # numpy array, torch tensor
            if ids.ndim != 1 or not str(ids.dtype).removeprefix("torch.").startswith(("int", "uint")):
                raise InvalidRequestError(f"ids must be a flat sequence of integer token ids, got a {ids.ndim}-D "
                                          f"{type(ids).__name__} of {ids.dtype} with shape {tuple(ids.shape)}")
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError(f"ids must be a flat sequence of integer token ids, got {type(ids).__name__}")
        if not all(type(t) is int for t in ids):  # the fast check passes engine output (serve decodes every step)
            odd = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
            if odd is not None:
                raise InvalidRequestError(f"ids must be a flat sequence of integer token ids, got a "
                                          f"{type(ids).__name__} holding {odd!r} ({type(odd).__name__})")
            ids = [int(t) for t in ids]  # numpy integers
        elif type(ids) is tuple:
            ids = list(ids)
        vocab = self.engine.target.config.vocab_size if self.engine is not None else len(self.tokenizer)
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab}); decode the ids a "
                                      "generate call returned, or encode() gave")
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def generate(self, prompts: str | list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 mode: str = "dflash", on_tokens=None, on_finished=None, on_text=None,
                 **unknown) -> list[GenerationResult]:
        """Engine.generate plus detokenized `text` on each result (cut before the stop string that ended it,
        for a request with `SamplingParams.stop`); `on_finished(prompt_index, result)` gets each result with its
        text, as its request ends.

        `prompts`: a list whose items are token id lists (`encode`, `encode_chat`) or plain text (a str, encoded
        as `encode` does: no chat template, as vLLM's and TensorRT-LLM's `LLM.generate` take text); a single
        str is one prompt.

        `on_text(prompt_index, delta)`: streamed text, as the OpenAI server streams it
        (`dflash_trt.runtime.stop_text.StopText`): `delta` (a non-empty str) is the text that prompt's new tokens
        complete, decoded incrementally: a multi-byte character split over tokens comes whole, once its last
        byte is there, and text that may begin a stop string of the request is held back until it does not, so
        the stop string itself is never sent. A prompt's deltas joined are exactly its result's `text` (the
        last one, what was held back, comes just before `on_finished` gets the result). `on_tokens` (token ids,
        logprobs) may be given beside it.

        `sampling_params=` (vLLM's and TensorRT-LLM's name) is taken for `params`.

        Calls run one at a time on a pipeline (see `Engine.generate`); a call blocks its thread until the batch
        ends, callbacks included, which run on that thread (from asyncio: `await asyncio.to_thread(pipe.generate,
        ...)`, README's Python API).

        Raises:
            what `Engine.generate` and `encode` raise (InvalidRequestError: a prompt of no accepted kind, text
            holding a lone surrogate, a callback that is not callable or cannot take the arguments it would get);
            InvalidRequestError for another keyword (a sampling setting such as max_tokens=: it names
            SamplingParams), and for both `params` and `sampling_params`.
        """
        from dflash_trt.runtime.request import check_arity, check_callbacks
        from dflash_trt.runtime.stop_text import StopText

        if "sampling_params" in unknown:
            if params is not None:
                raise InvalidRequestError("generate got both params and sampling_params (the same argument by two "
                                          "names); give one")
            params = unknown.pop("sampling_params")
        if unknown:
            name = next(iter(unknown))
            fix = (f"give it in params: SamplingParams({name}=...)" if name in SamplingParams.__dataclass_fields__
                   else "its arguments are prompts, params (SamplingParams), mode, on_tokens, on_finished and on_text")
            raise InvalidRequestError(f"generate has no argument {name!r}; {fix}")
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, (list, tuple)) and any(isinstance(p, str) for p in prompts):
            prompts = [self.encode(p) if isinstance(p, str) else p for p in prompts]
        plist = params if isinstance(params, (list, tuple)) else [SamplingParams() if params is None else params]
        check_callbacks(on_tokens, on_finished, plist)  # here: the engine sees the wrappers below
        if on_text is not None:
            if not callable(on_text):
                raise InvalidRequestError(f"on_text must be a function (prompt_index, delta) or None, got "
                                          f"{short_repr(on_text)} ({type(on_text).__name__})")
            check_arity("on_text", on_text, {2: ""}, ("prompt_index", "delta"))
        streams: dict[int, StopText] = {}  # on_text: each prompt's text so far, what was sent

        user_on_tokens = on_tokens

        def on_tokens_with_text(i: int, ids: list[int], *rest, **logits):
            reason = user_on_tokens(i, ids, *rest, **logits) if user_on_tokens is not None else None
            text = streams.get(i)
            if text is None:  # the engine checked params (a list of the prompts' length) before any tokens
                p = params[i] if isinstance(params, (list, tuple)) else plist[0]
                text = streams[i] = StopText(self._detokenize, p.stop or (), min_tokens=p.min_tokens)
            text.add(ids)
            delta = text.delta()
            if delta:
                on_text(i, delta)
            return reason

        if on_finished is not None and not callable(on_finished):
            on_finished_with_text = on_finished  # the engine refuses it, naming it
        else:
            def on_finished_with_text(i: int, r: GenerationResult) -> None:
                if r.text is None:  # the engine set the text of requests with stop strings
                    r.text = self.decode(r.token_ids)
                if on_text is not None:  # what was held back: a character or a stop string's beginning
                    sent = streams[i].sent if i in streams else ""
                    if len(r.text) > len(sent) and r.text.startswith(sent):
                        on_text(i, r.text[len(sent):])
                if on_finished is not None:
                    on_finished(i, r)
        if on_text is not None and (on_tokens is None or callable(on_tokens)):  # else the engine refuses on_tokens
            on_tokens = on_tokens_with_text
        return self.engine.generate(prompts, params, mode, on_tokens, on_finished_with_text)

    def _detokenize(self, ids: list[int]) -> str:
        """`decode` of the engine's own output ids (no checks: they are valid ids)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def use_cpu_kernels(target: TargetModel, proposer: DFlashProposer | None) -> None:
    """Pack the target's and the drafter's linears for the CPU float32 kernel, in place (inference only;
    `dflash_trt.ops.packed_linear`). Raises RuntimeError from the op if used off the CPU or in another dtype."""
    target.use_packed_linears()
    if proposer is not None:
        proposer.use_packed_linears()


def check_load_args(target, drafter, block_size, max_draft_len) -> None:
    """Raises ConfigError naming the argument when a path is not a str / os.PathLike / None, or a block size
    or max_draft_len is not an int / None (the Python API's callers; the CLI parses these itself)."""
    import os

    for name, value in (("target", target), ("drafter", drafter)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"{name} must be a folder path (str or pathlib.Path) or None for the default, got "
                              f"{type(value).__name__} {value!r}")
    for name, value in (("block_size", block_size), ("max_draft_len", max_draft_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{name} must be an integer or None, got {type(value).__name__} {value!r}")


def check_tp_args(tp_size: int, device: str) -> None:
    """Refuse a `tp_size` that is not an integer >= 1, and a device naming one GPU ("cuda:1") with tp_size > 1 (each
    rank takes its LOCAL_RANK's GPU).

    Raises:
        ConfigError: naming the value and the fix.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    if tp_size > 1 and isinstance(device, str) and device.startswith("cuda:"):  # every rank would load onto that GPU
        raise ConfigError(f"device {device!r} with tp_size {tp_size}: each rank uses the GPU of its LOCAL_RANK "
                          "(torchrun's); give device 'cuda' (--device cuda), and choose the GPUs with "
                          "CUDA_VISIBLE_DEVICES")


def _load_target_rank(path: Path, tcfg: TargetConfig, torch_dtype: torch.dtype, device: str, fp8_matmul: str,
                      tp_size: int):
    """The target at `path`, whole (tp_size 1) or this process's rank's part of it (`shard_target`; FP8 and NVFP4
    weights dequantized on load first, `tp_fp8_matmul`), with the same RNG on every rank.

    Raises:
        ConfigError: a tp_size the heads or the process group do not match; fp8_matmul "on" with tp_size > 1.
    """
    from dflash_trt.models.checkpoints import load_target

    if tp_size == 1:
        return load_target(path, torch_dtype, device, fp8_matmul=fp8_matmul)
    from dflash_trt.runtime.tensor_parallel import (check_target_tp, process_group_rank, same_rng_on_every_rank,
                                                    shard_target, tp_fp8_matmul)

    check_target_tp(tcfg, tp_size)
    fp8_matmul = tp_fp8_matmul(fp8_matmul, tp_size)
    rank = process_group_rank(tp_size)
    model = load_target(path, torch_dtype, device, fp8_matmul=fp8_matmul)
    shard_target(model, rank, tp_size)
    same_rng_on_every_rank()
    return model


def load_pipeline(target: str | Path | None = None, drafter: str | Path | None = None, dtype: str = "float32",
                  block_size: int | None = None, load_drafter_model: bool = True,
                  sample_drafts: bool = True, max_draft_len: int | None = None, fp8_matmul: str = "auto",
                  device: str = "cpu", draft_confidence: float | str = "auto", cpu_kernels: str = "auto",
                  tree_topk: int | str = "auto", prompt_lookup: int | str = "auto",
                  max_concurrency: int | str | None = "auto", tp_size: int = 1, cuda_kernels: str = "off") -> Pipeline:
    """Load target (+ drafter) and tokenizer onto `device` ("cpu", "cuda", "cuda:N"). `None` paths mean
    the embedded defaults.

    `tp_size` > 1: this process keeps its rank's part of the target (`dflash_trt.runtime.tensor_parallel`;
    the default process group must hold tp_size processes, each calling this with the same arguments);
    the drafter is replicated. Every rank then runs `generate` on the same prompts and gets the same results.

    `block_size` (default: the drafter's) is the drafter's block; `max_draft_len` (default
    block_size - 1) how many of its drafts the target verifies per step, `draft_confidence` (0 = off) a
    dynamic draft length cut by the drafter's own confidence (all three: `DFlashProposer`; "auto": 0.2
    on a CPU, 0 on a GPU, `dflash_trt.runtime.proposer.auto_draft_confidence`), `tree_topk` (1 = a
    chain) the top-k per block position of a draft tree for greedy requests
    (`dflash_trt.runtime.draft_tree`; "auto": 4 on a CPU, 1 on a GPU, `auto_tree_topk`), `prompt_lookup`
    (0 = off) how many prompt-lookup tokens join each greedy row's draft tree
    (`dflash_trt.runtime.prompt_lookup`; "auto": 8 on a CPU, 0 on a GPU, `auto_prompt_lookup`),
    `max_concurrency` (None = always) speculate only while at most that many requests are active
    ("auto": 1 on a CPU, None on a GPU, `auto_max_concurrency`).
    Compatibility is checked from the configs BEFORE weights load. `fp8_matmul` ("auto", "on", "off")
    chooses FP8 (W8A8) matmuls or dequantize-on-load for a ModelOpt FP8 target (`dflash_trt.models.fp8`;
    "auto" is on for a CUDA GPU of compute capability >= 8.9 only; with tp_size > 1 it dequantizes and "on" is
    refused: FP8 layers are not split, `dflash_trt.runtime.tensor_parallel.tp_fp8_matmul`). `cpu_kernels`
    ("auto", "on", "off") runs the linears of both models through the packed CPU float32 kernel
    (`dflash_trt.ops.packed_linear`; "auto": when running float32 on a CPU where it builds). `cuda_kernels`
    ("on", "off") injects the drafter's context K/V with the fused CUDA kernel
    (`dflash_trt.ops.cuda.resolve_cuda_kernels`).
    Raises:
        CheckpointError, ConfigError, IncompatibleModelsError (see `dflash_trt.compat`); ConfigError for
        fp8_matmul "on" with a target that is not FP8 or with tp_size > 1, cpu_kernels or cuda_kernels "on" where
        the kernels cannot run, a tp_size that the process group or the target's heads do not match, or a device
        naming one GPU ("cuda:1") with tp_size > 1 (each rank takes its LOCAL_RANK's).
    """
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from dflash_trt.models.checkpoints import check_device, load_drafter
    from dflash_trt.models.default import default_drafter_path, default_target_path, drafter_required

    check_load_args(target, drafter, block_size, max_draft_len)
    torch_dtype = parse_dtype(dtype)
    check_tp_args(tp_size, device)
    check_device(device)  # these first: before a default model is converted or anything is built
    fused_cuda = resolve_cuda_kernels(cuda_kernels, device)
    target_path = Path(target) if target is not None else default_target_path()
    tcfg = TargetConfig.from_pretrained(target_path)
    drafter_path = None
    if load_drafter_model:
        why = drafter_required(target, drafter)
        if why is not None:
            raise ConfigError(why)
        drafter_path = Path(drafter) if drafter is not None else default_drafter_path()
        dcfg = DrafterConfig.from_pretrained(drafter_path)
        check_compatible(tcfg, dcfg)
        # before any weights load
        check_prompt_lookup(prompt_lookup, check_draft_len(dcfg.block_size if block_size is None else block_size,
                                                           max_draft_len))
    packed = resolve_cpu_kernels(cpu_kernels, device, torch_dtype)
    if fused_cuda:
        require_cuda_kernels(device)
    model = _load_target_rank(target_path, tcfg, torch_dtype, device, fp8_matmul, tp_size)
    proposer = None
    if drafter_path is not None:
        proposer = DFlashProposer(load_drafter(drafter_path, torch_dtype, device), model, block_size, sample_drafts,
                                  max_draft_len, draft_confidence, tree_topk, prompt_lookup, max_concurrency)
    tokenizer = load_tokenizer(target_path)
    if packed:
        use_cpu_kernels(model, proposer)
    if fused_cuda and proposer is not None:
        proposer.drafter.use_fused_injection()
    engine = Engine(model, proposer, stop_token_ids(target_path, tcfg))
    return Pipeline(engine, tokenizer, target_path, drafter_path)


def load_bundle(bundle: str | Path, dtype: str = "float32", block_size: int | None = None,
                load_drafter_model: bool = True, max_draft_len: int | None = None, fp8_matmul: str = "auto",
                device: str = "cpu", draft_confidence: float | str = "auto", cpu_kernels: str = "auto",
                tree_topk: int | str = "auto", prompt_lookup: int | str = "auto",
                max_concurrency: int | str | None = "auto", cuda_kernels: str = "off", tp_size: int = 1) -> Pipeline:
    """Load a `dflash-trt build` bundle: verify its manifest (the sha256 of every file of the folders it loads;
    any other file altered or missing since the build, e.g. a tuned trtllm/serve.yaml, is named in the
    one line of the returned Pipeline's `warnings`), then load the target
    from `trtllm/target` and the drafter from the manifest's drafter path: `trtllm/drafter`, or
    `runtime/drafter` for a reduced-vocabulary drafter (kept as given, d2t included), a speculators-format one
    (as given) or an FP8 one (`--drafter-quant fp8`); `trtllm/drafter` then holds the z-lab, full-vocabulary,
    unquantized variant TensorRT-LLM loads (`dflash_trt.build.pipeline.drafter_as_given`).

    NVFP4 weights (and FP8 drafter weights) are dequantized to `dtype` on load (`dflash_trt.models.dequant`:
    activations not quantized). An FP8 target runs FP8 matmuls with the checkpoint's weight and input scales
    (W8A8, as TensorRT-LLM; `dflash_trt.models.fp8`) when `fp8_matmul` is "on", or "auto" on a CUDA GPU of
    compute capability >= 8.9; otherwise ("off", or "auto" on the CPU) it is dequantized too.

    `max_draft_len` defaults to the manifest's (the value in the bundle's serve.yaml) unless a
    `block_size` is given; then, as in `load_pipeline`, to block_size - 1. `draft_confidence`,
    `tree_topk`, `prompt_lookup`, `max_concurrency`, `cuda_kernels` and `tp_size` (the target split over the
    process group's ranks, its FP8 / NVFP4 weights dequantized first): as in `load_pipeline`.

    Raises:
        BundleError: missing bundle or manifest, a manifest that is not what the build writes (edited: its models,
            tokenizer or files entries missing or malformed), newer manifest schema, a missing or altered file in
            the target, drafter or tokenizer folder.
        IncompatibleModelsError, CheckpointError: as `load_pipeline`.
        ConfigError: fp8_matmul "on" for a bundle whose target is not FP8 (use "auto" or "off"); cpu_kernels
            or cuda_kernels "on" where the kernels cannot run.
    """
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from dflash_trt.build.manifest import verified_bundle
    from dflash_trt.models.checkpoints import check_device, load_drafter

    check_tp_args(tp_size, device)
    check_device(device)
    fused_cuda = resolve_cuda_kernels(cuda_kernels, device)
    manifest, target_path, drafter_path, tokenizer_path, unloaded = verified_bundle(bundle)
    root = Path(bundle)
    torch_dtype = parse_dtype(dtype)
    notes = [f"bundle {root}: {', '.join(unloaded)} since the build; dflash-trt does not load "
             f"{'this file' if len(unloaded) == 1 else 'these files'}, and what it loads is verified"] if unloaded else []
    tcfg = TargetConfig.from_pretrained(target_path)
    check_compatible(tcfg, DrafterConfig.from_pretrained(drafter_path))
    packed = resolve_cpu_kernels(cpu_kernels, device, torch_dtype)
    if fused_cuda:
        require_cuda_kernels(device)
    model = _load_target_rank(target_path, tcfg, torch_dtype, device, fp8_matmul, tp_size)
    proposer = None
    if load_drafter_model:
        if max_draft_len is None and block_size is None:
            max_draft_len = manifest.get("max_draft_len")
        proposer = DFlashProposer(load_drafter(drafter_path, torch_dtype, device), model, block_size,
                                  max_draft_len=max_draft_len, draft_confidence=draft_confidence, tree_topk=tree_topk,
                                  prompt_lookup=prompt_lookup, max_concurrency=max_concurrency)
    tokenizer = load_tokenizer(tokenizer_path)
    if packed:
        use_cpu_kernels(model, proposer)
    if fused_cuda and proposer is not None:
        proposer.drafter.use_fused_injection()
    engine = Engine(model, proposer, stop_token_ids(target_path, tcfg))
    return Pipeline(engine, tokenizer, target_path, drafter_path if load_drafter_model else None, notes)
