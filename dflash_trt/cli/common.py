"""Checks shared by the subcommands: option values that must name a folder or a file, sampling
options, the prompts against the target's context, and warnings.

Each names the option, the problem and the fix; the folder, file and sampling checks run before
anything loads.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import socket
import tempfile
from pathlib import Path

import click

from dflash_trt.errors import CheckpointError, ConfigError, InvalidRequestError
from dflash_trt.text import count


def parse_layer_ids(text: str | None, num_layers: int, keep_order: tuple[int, ...] | None = None) -> list[int] | None:
    """--target-layer-ids "a,b,c" -> [a, b, c]; None when the flag is absent (the z-lab default). `keep_order`: ids
    accepted out of order when they are exactly these (a run being resumed that an older version started so).

    Raises:
        ConfigError: not comma-separated integers, empty or with an empty entry ("1,,2"), an id outside [0, num_layers - 1] (the
            target's layers), an id given twice, or ids not in increasing order.
    """
    if text is None:
        return None
    parts = text.split(",")
    if not text.strip():
        raise ConfigError("--target-layer-ids is empty; give comma-separated target layer ids, or leave the flag out "
                          "for the default (the z-lab rule)")
    if any(not x.strip() for x in parts):  # "1,,2" / "3,": a layer id left out by mistake, not dropped silently
        raise ConfigError(f"--target-layer-ids {text!r} has an empty entry; give comma-separated integers such as "
                          "1,8,14")
    try:
        ids = [int(x) for x in parts]
    except ValueError as exc:
        raise ConfigError(f"--target-layer-ids must be comma-separated integers, got {text!r}") from exc
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"--target-layer-ids {ids}: {bad} outside [0, {num_layers - 1}] "
                          f"(the target has {num_layers} layers)")
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ConfigError(f"--target-layer-ids {ids}: {twice} given more than once; name each target layer once")
    if ids != sorted(ids) and tuple(ids) != tuple(keep_order or ()):  # vLLM collects them as the layers run
        raise ConfigError(f"--target-layer-ids {ids}: give them in increasing order ({','.join(map(str, sorted(ids)))}); "
                          "vLLM collects the target's hidden states as its layers run, so a drafter trained on "
                          "another order would get its fc inputs permuted there")
    return ids


def model_folder(option: str, path: str | None, what: str = "model") -> str | None:
    """`path` unchanged when it is None (the embedded default) or an existing folder.

    Raises:
        CheckpointError: `path` is a file (e.g. its config.json) or does not exist, or it is a dflash-trt
            bundle (manifest.json, no config.json: the message names the bundle's model folders and
            `generate --bundle`), or a folder without config.json; the message names `option`.
    """
    if path is None:
        return None
    if not str(path).strip():  # Path("") would be the current folder
        raise CheckpointError(f"{option} is empty; give the {what} folder (the one holding config.json)")
    p = Path(path)
    if p.is_file():
        raise CheckpointError(f"{option} {path} is a file; give the {what} folder (the one holding config.json)")
    if not p.exists():
        hub = ""
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path)):  # OWNER/NAME: a Hugging Face Hub id, most likely
            hub = (f"; {path} looks like a Hugging Face Hub id, which dflash-trt does not download: fetch it first "
                   f"(huggingface-cli download {path} --local-dir DIR) and give DIR")
        raise CheckpointError(f"{option} {path}: no such folder; give the {what} folder (the one holding config.json)"
                              + hub)
    if (p / "manifest.json").is_file() and not (p / "config.json").exists():
        raise CheckpointError(f"{option} {path} is a dflash-trt bundle, not a {what} folder: give its "
                              f"{path}/trtllm/target (--target) and {path}/trtllm/drafter (--drafter) folders, or "
                              f"run it with dflash-trt generate --bundle {path}")
    if not (p / "config.json").exists():
        raise CheckpointError(f"{option} {path}: no config.json in this folder; give the {what} folder (a Hugging Face "
                              "checkpoint folder holding config.json and its safetensors)")
    return path


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Raises click.UsageError when `host`:`port` cannot be bound (in use, or not an address of this
    machine), before the models load; the message names the port's option `flag`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise click.UsageError(f"--host {host}: not an address or name this machine resolves ({exc.strerror}); "
                               "give e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise click.UsageError(f"--host {host} is not an address of this machine ({exc.strerror}); give one of "
                                       "its addresses, 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
            raise click.UsageError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another {flag} (or stop "
                                   "the server that holds it)") from None


def load_models(target: str | None, drafter: str | None, bundle: str | None, dtype: str, block_size: int | None,
                drafting: bool, tp_config: str | None = None, **options):
    """The Pipeline of --bundle, or of --target / --drafter (embedded defaults when None), as `generate` and
    `serve` load it; `drafting` False loads no drafter (mode "ar"); `options` go to `load_pipeline` /
    `load_bundle` as given (max_draft_len, fp8_matmul, device, draft_confidence, cpu_kernels, cuda_kernels, tree_topk,
    prompt_lookup, max_concurrency; tp_size for `load_pipeline` only: > 1 joins the process group torchrun
    describes, `dflash_trt.runtime.tensor_parallel.init_from_env`). The Pipeline's `warnings` go to stderr.
    `tp_config`: the YAML file tp_size came from (serve --config's tensor_parallel_size), which the errors name.

    Raises:
        click.UsageError: --bundle with --target or --drafter; --tp-size > 1 outside torchrun.
        CheckpointError, ConfigError (a --device torch cannot use, checked before --tp-size joins the process group),
        IncompatibleModelsError, BundleError: from `model_folder` and the loaders.
    """
    tp_size = options.get("tp_size", 1)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    named = "--tp-size" if tp_config is None else f"tensor_parallel_size (in {tp_config})"
    given = f"--tp-size {tp_size}" if tp_config is None else f"tensor_parallel_size {tp_size} (in {tp_config})"
    if world > 1 and tp_size != world:
        raise click.UsageError(f"this is one of {world} processes started by torchrun, but {named} is {tp_size}: "
                               f"pass --tp-size {world} (or start one process)")
    if tp_size > 1:
        from dflash_trt.config import TargetConfig
        from dflash_trt.models.checkpoints import check_device
        from dflash_trt.models.default import default_target_path
        from dflash_trt.runtime.tensor_parallel import check_target_tp, init_from_env

        # a split the target does not allow, before asking for a torchrun launch that would then fail on it
        if bundle is not None:
            from dflash_trt.build.manifest import bundle_folder, load_manifest

            cfg = TargetConfig.from_pretrained(bundle_folder(Path(bundle), load_manifest(bundle, verify=False),
                                                             "models.target.path"))
        else:
            cfg = TargetConfig.from_pretrained(model_folder("--target", target) or default_target_path(),
                                               flag="--target")
        check_target_tp(cfg, tp_size, named)
        check_device(options.get("device", "cpu"))  # before the process group's backend (NCCL) is asked of it
        if not init_from_env(options.get("device", "cpu")):
            one = "" if tp_config is None else " (or pass --tp-size 1 to serve in one process)"
            raise click.UsageError(f"{given} runs one process per rank: launch it with torchrun --nproc-per-node "
                                   f"{tp_size} $(which dflash-trt) ... --tp-size {tp_size}{one}")
    if bundle is not None:
        if target is not None or drafter is not None:
            raise click.UsageError("--bundle already holds the target and drafter; drop --target/--drafter")
        from dflash_trt.api import load_bundle

        pipe = load_bundle(bundle, dtype, block_size, load_drafter_model=drafting, **options)
        for line in pipe.warnings:
            click.echo(f"warning: {line}", err=True)
        return pipe
    from dflash_trt.api import load_pipeline

    target, drafter = model_folder("--target", target), model_folder("--drafter", drafter, "drafter")
    return load_pipeline(target, drafter, dtype, block_size, load_drafter_model=drafting, **options)


def drop_repeats(option: str, values, noun: str, outcome: str, names=()) -> tuple[str, ...]:
    """The `values` of a repeatable path option in order, each path once: paths compare resolved
    (good.jsonl and ./good.jsonl are one file), the built-in `names` as given. One stderr warning line
    per dropped repeat: "{option} V is given twice" or "is the same {noun} as {option} FIRST", then
    "; {outcome}" (e.g. "it runs once")."""
    kept: dict[str, str] = {}  # resolved key -> the value first given
    for v in values:
        key = v if v in names else str(Path(v).resolve())
        if key in kept:
            same = "given twice" if v == kept[key] else f"the same {noun} as {option} {kept[key]}"
            click.echo(f"warning: {option} {v} is {same}; {outcome}", err=True)
            continue
        kept[key] = v
    return tuple(kept.values())


def jsonl_file(option: str, path: str | None) -> str | None:
    """`path` unchanged unless it is empty or a folder.

    Raises:
        ConfigError: `path` is empty, or a folder, not a JSONL file.
    """
    if path is not None and not path.strip():  # Path("") is the current folder
        raise ConfigError(f'{option} is empty; give the path of a JSONL file (one {{"prompt": ...}} or '
                          '{"messages": [...]} object per line)')
    if path is not None and Path(path).is_dir():
        raise ConfigError(f'{option} {path} is a directory; give a JSONL file (one {{"prompt": ...}} or '
                          '{"messages": [...]} object per line)')
    return path


def check_out_folder(option: str, path: str, outputs: tuple[str, ...] = ()) -> None:
    """Check that `path` is (or can be created as) a writable folder, leaving nothing behind: the
    missing folders are created, a temporary file is written in it, and the folders it created are
    removed again (so a later error leaves no empty output folder). Works for root too, for whom
    permission bits say nothing. `outputs`: the names the command writes there, each of which must
    not be a folder already (the write would fail at the end of a long run).

    Raises:
        InvalidRequestError: `path` is empty or a file, or it cannot be created or written; an `outputs`
            name there is a folder.
    """
    if not str(path).strip():
        raise InvalidRequestError(f"{option} is empty; give a folder path (it is created if missing; '.' for the "
                                  "current folder)")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InvalidRequestError(f"{option} {path}: this is a file, not a folder; give a folder path (it is created "
                                  "if missing)")
    for name in outputs:
        if (p / name).is_dir():
            raise InvalidRequestError(f"{option} {path}: {p / name} is a folder, where this command writes its {name} "
                                      "file; move it away, or give another folder")
    from dflash_trt.files import make_folders, remove_empty

    created = []
    try:
        created = make_folders(p)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as exc:
        raise InvalidRequestError(f"{option} {path}: cannot write there ({exc.strerror}); give a writable folder "
                                  "path (it is created if missing)") from None
    finally:
        remove_empty(created)


# Sampling options, checked when the command line is parsed (before anything loads); the library
# checks the same ranges again, naming the SamplingParams keyword (`runtime.sampling`).


def temperature_option(ctx, param, value: float) -> float:
    """--temperature: finite and >= 0 (0 = greedy). A click callback: the error names the flag."""
    if not 0 <= value < float("inf"):  # NaN and inf included
        raise click.BadParameter(f"{value} is not a finite value >= 0; use 0 for greedy decoding or a positive value "
                                 "such as 0.7")
    return value


def top_p_option(ctx, param, value: float) -> float:
    """--top-p: in (0, 1] (1 = off)."""
    if not 0 < value <= 1:
        raise click.BadParameter(f"{value} is not in (0, 1]; use e.g. 0.9, or 1 to turn top-p off")
    return value


def top_k_option(ctx, param, value: int) -> int:
    """--top-k: >= 0 (0 = off)."""
    if value < 0:
        raise click.BadParameter(f"{value} is not >= 0; use e.g. 50, or 0 to turn top-k off")
    return value


def max_tokens_option(ctx, param, value: int) -> int:
    """--max-tokens: >= 1."""
    if value < 1:
        raise click.BadParameter(f"{value} is not >= 1; give the most completion tokens to generate per prompt")
    return value


def repetition_penalty_option(ctx, param, value: float) -> float:
    """--repetition-penalty: finite and > 0 (1 = off)."""
    if not 0 < value < float("inf"):  # NaN and inf included
        raise click.BadParameter(f"{value} is not a finite value > 0; use e.g. 1.2 (> 1 repeats less), or 1 to turn "
                                 "it off")
    return value


def penalty_option(ctx, param, value: float) -> float:
    """--presence-penalty / --frequency-penalty: in [-2, 2] (0 = off; OpenAI's range)."""
    if not -2 <= value <= 2:  # NaN included
        raise click.BadParameter(f"{value} is not in [-2, 2]; use e.g. 0.5 (> 0 repeats less), or 0 to turn it off")
    return value


def min_p_option(ctx, param, value: float) -> float:
    """--min-p: in [0, 1] (0 = off)."""
    if not 0 <= value <= 1:  # NaN included
        raise click.BadParameter(f"{value} is not in [0, 1]; use e.g. 0.05, or 0 to turn min-p off")
    return value


def min_tokens_option(ctx, param, value: int) -> int:
    """--min-tokens: >= 0 (0 = off)."""
    if value < 0:
        raise click.BadParameter(f"{value} is not >= 0; give the fewest tokens to generate before a stop token may "
                                 "end the answer, or 0 to turn it off")
    return value


def logit_bias_option(ctx, param, values: tuple[str, ...]) -> dict[int, float] | None:
    """--logit-bias ID:BIAS (repeatable): {token id: bias in [-100, 100]}, or None when not given. A token given
    twice is refused (which bias was meant?). The ids are checked against the vocabulary once the target is
    loaded (`check_logit_bias_ids`)."""
    from dflash_trt.runtime.sampling import MAX_LOGIT_BIAS

    out: dict[int, float] = {}
    for value in values:
        token, sep, bias = value.partition(":")
        token, bias = token.strip(), bias.strip()
        try:
            number = float(bias) if sep and token.isascii() and token.isdigit() else None
        except ValueError:
            number = None
        if number is None:
            raise click.BadParameter(f"{value!r} is not ID:BIAS; give a token id and a bias in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], e.g. 504:5 (more likely) or 504:-100 (never)")
        if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:  # NaN included
            raise click.BadParameter(f"{value!r}: the bias {bias} is not in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if int(token) in out:
            raise click.BadParameter(f"token {int(token)} is given twice; give each token id once")
        out[int(token)] = number
    return out or None


def logits_processing_options(command):
    """The logits processing flags of `generate` and `bench` (`SamplingParams`' fields of the same names, each
    checked when parsed): --min-p, --repetition-penalty, --presence-penalty, --frequency-penalty, --logit-bias
    ID:BIAS (repeatable; a dict, or None), --min-tokens."""
    options = [
        click.option("--min-p", default=0.0, show_default=True, type=float, callback=min_p_option,
                     help="In [0, 1]; 0 = off. Sampling keeps the tokens at least this times as likely as the top one."),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float, callback=repetition_penalty_option,
                     help="> 0; 1 = off. The logit of a token already in the prompt or the answer is divided by it (times it "
                          "when negative): > 1 repeats less (CTRL, Hugging Face's)."),
        click.option("--presence-penalty", default=0.0, show_default=True, type=float, callback=penalty_option,
                     help="In [-2, 2]; 0 = off. Subtracted once from the logit of each token the answer holds (OpenAI's)."),
        click.option("--frequency-penalty", default=0.0, show_default=True, type=float, callback=penalty_option,
                     help="In [-2, 2]; 0 = off. Subtracted from a token's logit once per time the answer holds it (OpenAI's)."),
        click.option("--logit-bias", multiple=True, callback=logit_bias_option, metavar="ID:BIAS",
                     help="Add BIAS (in [-100, 100]) to token ID's logit: -100 bans it, 100 forces it (OpenAI's logit_bias). "
                          "Repeat for several tokens."),
        click.option("--min-tokens", default=0, show_default=True, type=int, callback=min_tokens_option,
                     help="No stop token (EOS) ends an answer before this many tokens (at most --max-tokens)."),
    ]
    for option in reversed(options):  # listed in --help's order
        command = option(command)
    return command


def logits_processing(max_tokens: int, min_p: float, repetition_penalty: float, presence_penalty: float,
                      frequency_penalty: float, logit_bias: dict[int, float] | None, min_tokens: int) -> dict:
    """`logits_processing_options`' values as `SamplingParams` keyword arguments.

    Raises:
        click.BadParameter: --min-tokens above --max-tokens.
    """
    if min_tokens > max_tokens:
        raise click.BadParameter(f"{min_tokens} is more than --max-tokens {max_tokens}; give at most that",
                                 param_hint="'--min-tokens'")
    return dict(min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, logit_bias=logit_bias, min_tokens=min_tokens)


def guided_decoding_options(command):
    """The structured-output flags of `generate` and `bench` (at most one; `guided_decoding` reads them):
    --json-schema FILE|JSON, --json-object, --regex REGEX, --grammar FILE|EBNF."""
    options = [
        click.option("--json-schema", default=None, metavar="FILE|JSON",
                     help="Answers are JSON that this schema accepts (a .json file, or the schema's JSON text)."),
        click.option("--json-object", is_flag=True, default=False, help="Answers are one JSON object (JSON mode)."),
        click.option("--regex", default=None, help="Answers match this regular expression, whole."),
        click.option("--grammar", default=None, metavar="FILE|EBNF",
                     help="Answers follow this EBNF grammar (GBNF, start rule root; a file, or the grammar's text)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def check_argv_text(flag: str, text: str | None) -> None:
    """Raises click.UsageError when `text`, the command-line value of `flag`, is not UTF-8 text: Python keeps a
    byte that is not UTF-8 as a lone surrogate (`dflash_trt.text.invalid_unicode`, which names that byte), which a
    tokenizer or XGrammar would fail on with a traceback. None passes."""
    from dflash_trt.text import invalid_unicode

    why = invalid_unicode(text, from_argv=True) if text is not None else None
    if why is not None:
        raise click.UsageError(f"{flag} holds {why}; give UTF-8 text (check the terminal's or the script's encoding)")


def _looks_like_path(value: str) -> bool:
    """Whether a --json-schema value that is not JSON was meant as a file: it ends in .json or holds a path
    separator, and does not start as a JSON object or array would (broken JSON text such as {"pattern": "a/b" is
    not a path)."""
    if value.lstrip().startswith(("{", "[")):
        return False
    return value.lower().endswith(".json") or any(sep and sep in value for sep in (os.sep, os.altsep))


def guided_decoding(json_schema: str | None, json_object: bool, regex: str | None, grammar: str | None,
                    min_tokens: int = 0):
    """`guided_decoding_options`' values as a `dflash_trt.runtime.guided.GuidedDecoding`, or None when none is given.
    --json-schema and --grammar read a file when the value names one, else take the value as the text itself.

    Raises:
        click.UsageError: more than one given; one given with --min-tokens (`min_tokens` > 0: a complete answer
            leaves only the stop tokens, which --min-tokens holds back; `SamplingParams` refuses the pair too,
            in its field names, once the models are loaded); a value given as text that is not UTF-8
            (`check_argv_text`).
            click.BadParameter: a schema that is not JSON, a file that cannot be read or is not UTF-8, a
            --json-schema file (a value ending in .json or holding a path separator, not JSON) that does not
            exist, or what GuidedDecoding refuses.
    """
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.guided import GuidedDecoding

    given = [flag for flag, value in (("--json-schema", json_schema), ("--json-object", json_object or None),
                                      ("--regex", regex), ("--grammar", grammar)) if value is not None]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} exclude each other: give one of --json-schema, --json-object, "
                               "--regex, --grammar")
    if not given:
        return None
    if min_tokens:
        raise click.UsageError(f"--min-tokens and {given[0]} do not go together: once the answer is complete, the "
                               "grammar allows only the stop tokens, which --min-tokens holds back; drop --min-tokens")

    def text(flag: str, value: str) -> str:
        path = Path(value)
        if len(value) < 4096 and "\n" not in value and path.is_dir():
            raise click.BadParameter(f"{value} is a directory; give a file, or the text itself", param_hint=f"'{flag}'")
        if len(value) < 4096 and "\n" not in value and path.is_file():
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise click.BadParameter(f"cannot read {value}: {exc}", param_hint=f"'{flag}'") from None
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise click.BadParameter(f"{value}: not UTF-8 text (byte {exc.start}); save it as UTF-8",
                                         param_hint=f"'{flag}'") from None
        if flag == "--json-schema" and _looks_like_path(value):
            try:
                json.loads(value)
            except ValueError:
                raise click.BadParameter(f"no such file: {value}; give an existing JSON schema file, or the schema's "
                                         "JSON text", param_hint=f"'{flag}'") from None
        check_argv_text(flag, value)
        return value

    try:
        if json_schema is not None:
            return GuidedDecoding(json=text("--json-schema", json_schema))
        if json_object:
            return GuidedDecoding(json_object=True)
        if regex is not None:
            check_argv_text("--regex", regex)
            return GuidedDecoding(regex=regex)
        if "::=" not in grammar and not Path(grammar).exists():  # every EBNF grammar has a rule: a mistyped file
            raise click.BadParameter(f"no file {grammar}, and not a grammar either (no rule such as root ::= ...); "
                                     "give an EBNF grammar file or the grammar text", param_hint="'--grammar'")
        return GuidedDecoding(grammar=text("--grammar", grammar))
    except InvalidRequestError as exc:
        note = " (a file that does not exist is read as the text itself)" if given[0] != "--regex" else ""
        raise click.BadParameter(f"{exc}{note}", param_hint=f"'{given[0]}'") from None


#: GuidedDecoding.kind -> the flag that gives it
GUIDED_FLAGS = {"json": "--json-schema", "json_object": "--json-object", "regex": "--regex", "grammar": "--grammar"}


def compile_guided(grammars, guided) -> None:
    """Compile the structured-output flag's grammar (`guided`, a GuidedDecoding or None) with `grammars` (a
    `dflash_trt.runtime.guided.Grammars`), so that a schema, regex or grammar XGrammar refuses is a usage error
    naming the flag before any prompt runs.

    Raises:
        click.BadParameter: XGrammar's message, under the flag's name.
    """
    from dflash_trt.errors import InvalidRequestError

    if guided is None:
        return
    try:
        grammars.compile(guided)
    except InvalidRequestError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{GUIDED_FLAGS[guided.kind]}'") from None


def check_logit_bias_ids(logit_bias: dict[int, float] | None, vocab_size: int) -> None:
    """Raises click.BadParameter (--logit-bias) for a token id outside the target's vocabulary [0, vocab_size)."""
    beyond = sorted(t for t in logit_bias or () if t >= vocab_size)
    if beyond:
        raise click.BadParameter(f"token {beyond[0]} is outside the target's vocabulary [0, {vocab_size})",
                                 param_hint="'--logit-bias'")


def check_mask_token_id(mask_token_id: int, vocab_size: int, default_id: int, why: str) -> None:
    """Raises click.BadParameter (--mask-token-id) for an id outside the target's vocabulary [0, vocab_size),
    naming the default (`default_id`, chosen because `why`): init-drafter's and train-drafter's check (the
    flag, not the config field the compatibility check names; a negative id crashed the tokenizer lookup)."""
    if not 0 <= mask_token_id < vocab_size:
        raise click.BadParameter(f"{mask_token_id} is outside the target's vocabulary [0, {vocab_size}); give a "
                                 f"reserved token id of its tokenizer (default: {default_id}, {why})",
                                 param_hint="'--mask-token-id'")


#: --seed's range: what torch.Generator.manual_seed takes (a 64-bit value, signed or not).
SEED_RANGE = click.IntRange(-(2**63), 2**64 - 1)


def lower_word(ctx, param, value):
    """A click callback: a word flag's value (--device CUDA:0) in lower case, spaces stripped."""
    return value.strip().lower() if isinstance(value, str) else value


def _auto_or_number(value: str, kind: type, words: str, in_range, range_text: str, hint: str) -> float | int | str:
    """"auto", or `value` parsed as `kind` (float or int) and checked by `in_range`; else a usage error
    naming the value, the allowed range (`words`: "a number in [0, 1)"; `range_text`: "0<=x<1") and
    `hint` (examples). The word is case-insensitive: AUTO and Auto are auto."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        number = kind(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not auto or {words}; use {hint}") from None
    if number != number:
        raise click.BadParameter(f"nan is not {words}; use {hint}")
    if not in_range(number):
        raise click.BadParameter(f"{value} is not in the range {range_text}; use {hint}")
    return number


def _draft_confidence(ctx, param, value: str) -> float | str:
    """--draft-confidence: "auto" or a number in [0, 1) (click's FloatRange would let nan through)."""
    return _auto_or_number(value, float, "a number in [0, 1)", lambda x: 0.0 <= x < 1.0, "0<=x<1",
                           "e.g. 0.3, 0 to verify every draft, or auto")


def finite_float(ctx, param, value: float | None) -> float | None:
    """A click callback: nan and +-inf are usage errors (click's FloatRange lets nan through and
    accepts inf where no maximum is set); None (an unset optional flag) passes."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


#: --draft-confidence, shared by `generate` and `bench` (DFlashProposer.draft_confidence).
draft_confidence_option = click.option(
    "--draft-confidence", default="auto", show_default=True, callback=_draft_confidence, metavar="auto|P",
    help="Dynamic draft length: verify only the leading drafts whose running product of drafter top-token "
         "probabilities stays >= P, in [0, 1) (0 = verify max_draft_len every step). Pays on a CPU, where each "
         "verified position costs compute. auto = 0.2 on a CPU (0.07 for drafts sampled at temperature "
         "> 0), 0 on a GPU; a number applies to both. Greedy output is unchanged; sampling keeps the target's "
         "distribution (the sampled tokens for a given --seed change).")


def _tree_topk(ctx, param, value: str) -> int | str:
    """--tree-topk: "auto" or an integer in [1, 16]."""
    return _auto_or_number(value, int, "an integer in [1, 16]", lambda k: 1 <= k <= 16, "1<=x<=16",
                           "e.g. 4, 1 for a chain, or auto")


#: --tree-topk, shared by `generate` and `bench` (DFlashProposer.tree_topk).
tree_topk_option = click.option(
    "--tree-topk", default="auto", show_default=True, callback=_tree_topk,
    metavar="auto|K",
    help="Greedy requests verify a draft tree: the top-K drafts of each block position combine into candidate "
         "paths, and the max_draft_len likeliest (those >= the draft confidence) are verified in one target pass "
         "with a tree attention mask. K in [1, 16]; 1 = a chain of top-1 drafts (the paper's DFlash); sampling "
         "requests keep the chain. Output is unchanged. auto = 4 on a CPU, 1 on a GPU.")


def _prompt_lookup(ctx, param, value: str) -> int | str:
    """--prompt-lookup: "auto" or an integer in [0, 63] (the largest --max-draft-len; the runtime checks it
    against the actual max_draft_len)."""
    return _auto_or_number(value, int, "an integer in [0, 63]", lambda k: 0 <= k <= 63, "0<=x<=63",
                           "e.g. 8, 0 to turn it off, or auto")


#: --prompt-lookup, shared by `generate` and `bench` (DFlashProposer.prompt_lookup).
prompt_lookup_option = click.option(
    "--prompt-lookup", default="auto", show_default=True, callback=_prompt_lookup, metavar="auto|N",
    help="Also verify up to N tokens copied from each request's own context (prompt lookup: what followed the "
         "latest earlier occurrence of its last 3-4 tokens), in the same target pass: a greedy request adds them to "
         "its draft tree as one more branch; a sampling request drafts them in place of the drafter's sampled chain. "
         "0 = off (with --tree-topk 1: the paper's DFlash). Output is unchanged (greedy) or keeps its distribution "
         "(sampling). auto = 8 on a CPU, 0 on a GPU (capped at --max-draft-len); an explicit N must be <= "
         "--max-draft-len.")


def _max_concurrency(ctx, param, value: str) -> int | str | None:
    """--max-concurrency: "auto", "none" (always speculate) or an integer >= 1 (words case-insensitive)."""
    if value.strip().lower() == "none":
        return None
    return _auto_or_number(value, int, "none or an integer >= 1", lambda k: k >= 1, "x>=1",
                           "e.g. 4, none to always speculate, or auto")


#: --max-concurrency, shared by `generate` and `bench` (DFlashProposer.max_concurrency).
max_concurrency_option = click.option(
    "--max-concurrency", default="auto", show_default=True, callback=_max_concurrency, metavar="auto|none|N",
    help="Speculate only while at most N requests are active (TensorRT-LLM's max_concurrency); while more are, "
         "every active request decodes one token per step, as --mode ar does, and drafting resumes once enough "
         "have finished. Output is unchanged. auto = 1 on a CPU (where batched ar beats speculation: "
         "BENCHMARKS.md), none (always speculate) on a GPU.")


def drafter_block_size(target: str | None, drafter: str | None, bundle: str | None) -> int | None:
    """The block size of the drafter a command loads (--bundle's, --drafter's, or the default target's default
    drafter), from its config.json alone; None when it cannot be read here (the loaders then name the problem)."""
    from dflash_trt.config import DrafterConfig
    from dflash_trt.errors import DFlashError
    from dflash_trt.models.default import DEFAULT_BLOCK_SIZE, PACKAGED_DRAFTER

    try:
        if bundle is not None:
            from dflash_trt.build.manifest import bundle_folder, load_manifest

            path = bundle_folder(Path(bundle), load_manifest(bundle, verify=False), "models.drafter.path")
        elif drafter is not None:
            path = Path(drafter)
        elif target is None:  # `default_drafter_path`: the packaged drafter, else an untrained one of the default block
            if not (PACKAGED_DRAFTER / "config.json").is_file():
                return DEFAULT_BLOCK_SIZE
            path = PACKAGED_DRAFTER
        else:
            return None
        return DrafterConfig.from_pretrained(path).block_size
    except (DFlashError, OSError):
        return None


def check_draft_lengths(prompt_lookup: int | str, max_draft_len: int | None, block_size: int | None,
                        drafting: bool = False, target: str | None = None, drafter: str | None = None,
                        bundle: str | None = None) -> None:
    """Usage errors, before any model loads, when --max-draft-len exceeds the block's drafts (block size - 1),
    or an explicit --prompt-lookup exceeds the max_draft_len that --max-draft-len or the block sets. The block
    is --block-size; without it, when `drafting`, the drafter's own (`drafter_block_size` of --target,
    --drafter, --bundle: its config.json only), so --max-draft-len 16 on a block-16 drafter is a usage error
    (exit 2) as it is with --block-size 16 (it was the loader's ConfigError, exit 1)."""
    block, blocks = block_size, f"a block of --block-size {block_size} holds"
    raise_block = "raise --block-size"
    if block is None and drafting and (max_draft_len is not None or prompt_lookup != "auto"):
        block = drafter_block_size(target, drafter, bundle)
        blocks, raise_block = f"the drafter's block of {block} holds", "use a drafter of a larger block"
    if max_draft_len is not None and block is not None and max_draft_len > block - 1:
        raise click.BadParameter(f"{max_draft_len} is more than the {block - 1} drafts {blocks}; use --max-draft-len "
                                 f"{block - 1} or less, or {raise_block}", param_hint="'--max-draft-len'")
    if max_draft_len is not None:
        limit, fix = max_draft_len, "raise --max-draft-len"
    elif block is not None:
        limit, fix = block - 1, raise_block
    else:
        return
    if prompt_lookup != "auto" and prompt_lookup > limit:
        raise click.BadParameter(f"{prompt_lookup} is more than the {limit} drafts a step verifies "
                                 f"(max_draft_len); use --prompt-lookup {limit} or less, or {fix}",
                                 param_hint="'--prompt-lookup'")


def note_max_concurrency(pipe, batch_size: int, num_prompts: int) -> None:
    """One stderr line when a dflash run decodes more prompts together than the proposer speculates for
    (`DFlashProposer.max_concurrency`): those steps decode one token per step, so tau reads 1.00 there."""
    proposer = pipe.engine.proposer
    together = min(batch_size, num_prompts)
    if proposer is not None and proposer.max_concurrency is not None and together > proposer.max_concurrency:
        click.echo(f"note: {together} prompts decode together (--batch-size {batch_size}); DFlash drafts only while at "
                   f"most {proposer.max_concurrency} of them {'is' if proposer.max_concurrency == 1 else 'are'} active (--max-concurrency; auto = 1 on a CPU, where "
                   "batched ar is faster), so busy steps decode one token each. --max-concurrency none drafts always",
                   err=True)


def warn_tree_unused(tree_topk: int | str, temperature: float) -> None:
    """One stderr line when an explicit --tree-topk > 1 meets sampling (--temperature > 0): draft trees
    apply to greedy requests only, sampling requests draft a chain."""
    if tree_topk != "auto" and tree_topk > 1 and temperature > 0:
        click.echo(f"warning: --tree-topk {tree_topk} applies to greedy requests (--temperature 0) only; these "
                   "sampling requests draft a chain", err=True)


def warn_sampling_unused(temperature: float, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                         min_p: float = 0.0) -> None:
    """One stderr line when --top-p / --top-k / --seed (None: not given) / --min-p are set but decoding is greedy
    (--temperature 0): greedy decoding draws no random numbers."""
    given = [f for f, on in ((f"--top-p {top_p}", top_p < 1.0), (f"--top-k {top_k}", top_k > 0),
                             (f"--seed {seed}", seed is not None), (f"--min-p {min_p}", min_p > 0)) if on]
    if given and temperature == 0:
        names = given[0] if len(given) == 1 else ", ".join(given[:-1]) + " and " + given[-1]
        click.echo(f"warning: {names} only appl{'ies' if len(given) == 1 else 'y'} when sampling (--temperature > 0); "
                   f"greedy decoding ignores {'it' if len(given) == 1 else 'them'}", err=True)


def warn_escaped_stops(stops) -> None:
    """One stderr line per --stop string holding a backslash escape as two characters (`--stop "\\n"` is a backslash
    and an n, which an answer seldom holds): the shell does not turn it into a newline or tab; bash's $'\\n' does."""
    import re

    names = {"n": "newline", "t": "tab", "r": "carriage return"}
    for stop in stops:
        escape = re.search(r"\\([ntr])", stop)
        if escape is not None:
            name = names[escape.group(1)]
            click.echo(f"warning: --stop \"{stop}\" holds a backslash and \"{escape.group(1)}\" (two characters), "
                       f"not a {name}: the shell passes them as typed; for a {name} use bash's $'{escape.group()}'",
                       err=True)


def warn_float16_on_cpu(dtype: str, device: str) -> None:
    """One stderr line for --dtype float16 on the CPU, where torch has no fast float16 matmul (the default model
    ran at ~1 token/s that way in session 9, 12-26 tokens/s in session 45, against ~40-70 in float32 with the packed
    kernels)."""
    if dtype == "float16" and device == "cpu":
        click.echo("warning: --dtype float16 is slow on a CPU (no fast float16 matmul: several times slower than "
                   "float32 with the default model); use float32 (the default, with the packed CPU kernels) or "
                   "bfloat16", err=True)


def set_threads(threads: int | None) -> None:
    """Apply --threads: torch's intra-op CPU threads for the whole command; None keeps torch's default
    (one per core). On a machine busy with other work, fewer threads than cores is often much faster."""
    if threads is not None:
        import os

        import torch

        cores = os.cpu_count() or 1
        if threads > cores:
            click.echo(f"warning: --threads {threads} is more than this machine's {cores} CPU cores; expect it to be "
                       f"slower than --threads {cores}", err=True)
        torch.set_num_threads(threads)


#: --cpu-kernels, shared by `generate` and `bench` (`dflash_trt.ops.packed_linear.resolve_cpu_kernels`).
cpu_kernels_option = click.option(
    "--cpu-kernels", type=click.Choice(["auto", "on", "off"], case_sensitive=False), default="auto", show_default=True,
    help="Run the linears through dflash-trt's packed CPU float32 kernel (built once on first use, ~15 s): each "
         "weight held in the smallest exact format (GGUF Q4_1 / Q8_0 blocks, bf16, else float32), read once for "
         "the 1-16 tokens of a decode or verify step; the same results bit for bit whatever the format or number of "
         "tokens. auto = on for --device cpu with float32 on an AVX-512 or AVX2 (FMA, F16C) CPU where it builds.")

#: --cuda-kernels, shared by `generate`, `serve` and `bench` (`dflash_trt.ops.cuda.resolve_cuda_kernels`).
cuda_kernels_option = click.option(
    "--cuda-kernels", type=click.Choice(["on", "off"], case_sensitive=False), default="off", show_default=True,
    help="--device cuda: inject the drafter's context K/V with dflash-trt's fused CUDA kernel (k_norm, RoPE and the "
         "cache write of every drafter layer in one launch; built with nvcc on first use, ~10 s). Off by default "
         "until measured on a GPU.")

def tp_size_option(command: str, who_answers: str):
    """--tp-size of `generate` and `serve` (`load_models`: > 1 joins the process group torchrun describes);
    `who_answers` ends its help (e.g. "rank 0 prints")."""
    return click.option(
        "--tp-size", default=1, show_default=True, type=click.IntRange(1, 64),
        help=f"Tensor parallelism: the target split over this many processes, launched by torchrun (`torchrun "
             f"--nproc-per-node N $(which dflash-trt) {command} --tp-size N ...`; gloo on a CPU, NCCL on GPUs); "
             f"{who_answers}.")


def prefix_cache_gb_option(ctx, param, value: float) -> float:
    """--prefix-cache-gb: finite (`finite_float`) and at least MIN_PREFIX_CACHE_GB."""
    from dflash_trt.runtime.prefix_cache import MIN_PREFIX_CACHE_GB

    value = finite_float(ctx, param, value)
    if not value >= MIN_PREFIX_CACHE_GB:
        raise click.BadParameter(f"{value:g} is less than {MIN_PREFIX_CACHE_GB:g} GiB (about 1 MiB), too little to hold "
                                 "a prefix worth reusing; give e.g. 1 (GiB)")
    return value


def prefix_cache_options(command):
    """--enable-prefix-caching / --prefix-cache-gb of `generate` and `serve` (applied with `use_prefix_cache`)."""
    command = click.option(
        "--prefix-cache-gb", default=1.0, show_default=True, type=float, callback=prefix_cache_gb_option,
        help="Memory the prefix cache keeps at most, in GiB (on the model's device), least recently used sequences "
             "dropped first; at least 0.001 (about 1 MiB).")(command)  # prefix_cache.MIN_PREFIX_CACHE_GB
    return click.option(
        "--enable-prefix-caching", is_flag=True, default=False,
        help="Automatic prefix caching (vLLM's --enable-prefix-caching, TensorRT-LLM's KV cache block reuse): the "
             "target's K/V and the drafter's context of every sequence read are kept, and a prompt starting with one "
             "(the next turn of a chat, a shared system or few-shot prompt) is prefilled from where they differ. "
             "Default: off.")(command)


def use_prefix_cache(pipe, enable: bool, gb: float) -> None:
    """Give `pipe`'s engine a `PrefixCache` of `gb` GiB when `enable` (every rank under tensor parallelism: each
    keeps its shard of the K/V, taking the same decisions); with --prefix-cache-gb given alone, one stderr line
    that it has no effect."""
    from click.core import ParameterSource

    if enable:
        from dflash_trt.runtime.prefix_cache import PrefixCache

        pipe.engine.prefix_cache = PrefixCache(max(1, int(gb * 2**30)))
    elif click.get_current_context().get_parameter_source("prefix_cache_gb") is ParameterSource.COMMANDLINE:
        click.echo("warning: --prefix-cache-gb has no effect without --enable-prefix-caching", err=True)


#: the most CPU threads --threads takes: far past any core count worth using, below what OpenMP can start (20,000
#: threads failed to start and 100,000 crashed the process on a 2-core VM)
MAX_THREADS = 1024

#: --threads, shared by `generate` and `bench` (applied with `set_threads`).
threads_option = click.option(
    "--threads", default=None, type=click.IntRange(1, MAX_THREADS),
    help="torch CPU threads (default: torch's, one per core). On a busy machine fewer can be much faster "
         "(2 vCPUs, one held by another process: 0.6-0.8 tokens/s with 2 threads, 16.5 with 1).")



def model_options(command):
    """The options that choose and load the models, shared by `generate` and `serve` (their values go to
    `load_models`): --target, --drafter, --bundle, --fp8-matmul, --block-size, --max-draft-len, the draft
    options (--draft-confidence, --tree-topk, --prompt-lookup, --max-concurrency), --mode, --dtype,
    --device, --threads, --cpu-kernels, --cuda-kernels."""
    options = [
        click.option("--target", type=click.Path(), default=None,
                     help="HF target folder (default: embedded SmolLM2-135M-Instruct)."),
        click.option("--drafter", type=click.Path(), default=None,
                     help="DFlash drafter folder (default: the project's drafter)."),
        click.option("--bundle", type=click.Path(), default=None,
                     help="A `dflash-trt build` bundle folder (verified); replaces --target/--drafter."),
        click.option("--fp8-matmul", type=click.Choice(["auto", "on", "off"], case_sensitive=False), default="auto",
                     show_default=True,
                     help="FP8 target: W8A8 FP8 matmuls (on; auto = on a CUDA GPU of compute capability >= 8.9) or "
                          "weights dequantized on load (off; NVFP4 always is)."),
        click.option("--block-size", default=None, type=click.IntRange(2, 64),
                     help="Draft block size (default: the drafter's)."),
        click.option("--max-draft-len", default=None, type=click.IntRange(1, 63),
                     help="Drafts verified per step, <= block size - 1 (TensorRT-LLM's max_draft_len; default block "
                          "size - 1). Fewer cost less to verify when late drafts are rarely accepted."),
        draft_confidence_option, tree_topk_option, prompt_lookup_option, max_concurrency_option,
        click.option("--mode", type=click.Choice(["dflash", "ar"], case_sensitive=False), default="dflash",
                     show_default=True,
                     help="dflash: speculative decoding with the drafter; ar: the target alone, one token per step "
                          "(the baseline)."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"], case_sensitive=False),
                     default="float32", show_default=True, help="The dtype the target and drafter compute in."),
        click.option("--device", default="cpu", show_default=True, callback=lower_word,
                     help="Where the target and drafter run: cpu, cuda or cuda:N."),
        threads_option, cpu_kernels_option, cuda_kernels_option,
    ]
    for option in reversed(options):
        command = option(command)
    return command

def warn_draft_flags_unused(drafting: bool, block_size: int | None, max_draft_len: int | None,
                            draft_confidence: float | str = "auto", tree_topk: int | str = "auto",
                            prompt_lookup: int | str = "auto", max_concurrency: int | str | None = "auto") -> None:
    """One stderr line when --block-size / --max-draft-len / --draft-confidence / --tree-topk /
    --prompt-lookup / --max-concurrency are given
    but nothing drafts (only ar / HF modes): they shape the drafter's block, so they have no effect there."""
    confidence = None if draft_confidence == "auto" else draft_confidence or None  # auto is the default
    given = [name for name, value in (("--block-size", block_size), ("--max-draft-len", max_draft_len),
                                      ("--draft-confidence", confidence),
                                      ("--tree-topk", None if tree_topk == "auto" else tree_topk),
                                      ("--prompt-lookup", None if prompt_lookup == "auto" else prompt_lookup),
                                      ("--max-concurrency", None if max_concurrency == "auto" else max_concurrency or "none"))
             if value is not None]
    if given and not drafting:
        click.echo(f"warning: {' and '.join(given)} only affect{'s' if len(given) == 1 else ''} DFlash drafting; "
                   "ignored here (no dflash mode runs)", err=True)


def warn_untrained_drafter(pipe) -> None:
    """One stderr line when the drafter's config.json marks it untrained (`dflash-trt init-drafter`
    writes `dflash_trt.untrained`), as `dflash-trt check` and `build` warn: output stays exact, but the
    target accepts almost none of its drafts, so DFlash runs slower than --mode ar."""
    proposer = pipe.engine.proposer
    if proposer is not None and not proposer.drafter.config.trained:
        click.echo(f"warning: the drafter at {pipe.drafter_path} is untrained (its config.json says so, as "
                   "init-drafter writes it): almost no draft will be accepted (tau ~1.0, slower than --mode ar); "
                   "train it with dflash-trt train-drafter --init DIR, or use a trained drafter", err=True)


def warn_training_target(pipe) -> None:
    """One stderr line when the drafter's training.json names another target than the one loaded, the
    warning `dflash-trt check` and `build` give (`dflash_trt.compat.training_target_problem`: output stays
    exact, but a drafter made for another model has its drafts rarely accepted)."""
    from dflash_trt.compat import training_target_problem

    if pipe.drafter_path is None:  # mode ar: no drafter loaded
        return
    problem = training_target_problem(pipe.drafter_path, pipe.target_path)
    if problem is not None:
        click.echo(f"warning: {problem}", err=True)


def warn_block_size(pipe) -> None:
    """One stderr line when the draft block is larger than the block the drafter was trained with.

    The runtime serves any block size >= 2 and output stays exact (every draft is verified), but
    positions past the trained block are out of distribution: their drafts are rarely accepted.
    """
    proposer = pipe.engine.proposer
    if proposer is None:
        return
    trained = proposer.drafter.config.block_size
    if proposer.block_size > trained:
        click.echo(f"warning: --block-size {proposer.block_size} is larger than the drafter's trained block size "
                   f"{trained}; the extra draft positions are rarely accepted (output stays exact); use "
                   f"--block-size {trained} or less", err=True)


def prompt_file_lines(path: str | Path) -> list[int]:
    """The line number (1-based) of each prompt that `load_prompts_jsonl(path)` returns, in its order:
    it skips blank lines only and takes one prompt from every other line (or raises)."""
    from dflash_trt.training.prompts import jsonl_lines, read_prompts_text

    return [n for n, line in jsonl_lines(read_prompts_text(path)) if line.strip()]


def check_prompt_lengths(prompts: list[list[int]], ctx: int, where: list[str] | None = None,
                         fix: str | None = None, name: str | None = None) -> None:
    """Every prompt must leave room for a token in the target's context of `ctx` tokens.

    `where` labels each prompt at the start of the message, e.g. "prompts.jsonl:3" (its file and line);
    without it, `name` (e.g. "mt-bench") leads the message. `fix` replaces the default fix ("shorten it
    to at most ctx - 1 tokens").

    Raises:
        PromptTooLongError: naming the first prompt that fills the context (of how many, how many fill
            it, the next few of them), its length, the context and the fix.
    """
    from dflash_trt.errors import PromptTooLongError

    too_long = [i for i, p in enumerate(prompts) if len(p) >= ctx]
    if not too_long:
        return
    i = too_long[0]
    lead = f"{where[i]}: " if where is not None else f"{name}: " if name else ""
    if len(prompts) == 1:
        which = "the prompt"
    else:
        others = [where[j] if where is not None else str(j + 1) for j in too_long[1:]]
        also = f"; also {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}" if others else ""
        which = f"prompt {i + 1} of {len(prompts)} ({len(too_long)} too long{also})"
    raise PromptTooLongError(f"{lead}{which} is {len(prompts[i])} tokens and leaves no room in the target's context "
                             f"of {ctx} tokens; {fix or f'shorten it to at most {ctx - 1} tokens'}")


def warn_context_room(prompts: list[list[int]], ctx: int, max_tokens: int, what: str = "") -> None:
    """One stderr line when --max-tokens does not fit in the context of `ctx` tokens after some of
    `prompts` (those requests stop when the context is full, finish_reason "length" with fewer tokens).
    `what` names the prompts' source at the start of the line's detail (e.g. "mt-bench: ")."""
    room = [ctx - len(p) for p in prompts if ctx - len(p) < max_tokens]
    if not room:
        return
    if len(prompts) == 1:
        detail = f"the prompt takes {ctx - room[0]}, so at most {count(room[0], 'token')} {'is' if room[0] == 1 else 'are'} generated"
    else:
        span = f"{min(room)}" + (f" to {max(room)}" if max(room) > min(room) else "")
        detail = (f"{len(room)} of the {len(prompts)} prompts {'leaves' if len(room) == 1 else 'leave'} room for only "
                  f"{span} {'token' if max(room) == 1 else 'tokens'}")
    click.echo(f"warning: --max-tokens {max_tokens} does not fit in the target's context of {ctx} tokens: {what}{detail} "
               '(those stop there, finish_reason "length"); lower --max-tokens or shorten the prompt', err=True)


def check_context(pipe, prompts: list[list[int]], max_tokens: int, where: list[str] | None = None,
                  fix: str | None = None) -> None:
    """Every prompt must leave room in the target's context (`check_prompt_lengths`, `where` and `fix` as
    there); one stderr line when --max-tokens does not fit after some of them (`warn_context_room`).

    Raises:
        PromptTooLongError: a prompt fills the context by itself (checked before anything is generated).
    """
    ctx = pipe.engine.context_len
    check_prompt_lengths(prompts, ctx, where, fix)
    warn_context_room(prompts, ctx, max_tokens)
