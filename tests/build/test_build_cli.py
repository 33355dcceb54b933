"""`dflash-trt build` as a command: calibration count, --out checks in the dry run (an existing --out refused before
the first step), Ctrl-C, the step numbering of the progress lines and of the plan, llm_api_example.py against
serve.yaml, already-quantized inputs, an --out that changes during the build, SIGTERM and unfinished build folders.

One tiny build (module fixture `calib_bundle`) serves the calibration, numbering and example tests;
the Ctrl-C tests stop tiny builds part way."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from build_helpers import build_bundle

from dflash_trt.build.pipeline import BuildOptions, numbered, step_titles
from tests.conftest import run_main

N_STEPS = 8


def write_prompts(path, n):
    path.write_text("".join(json.dumps({"prompt": f"def add_{i}(a, b):\n    return a + b + {i}"}) + "\n"
                            for i in range(n)))
    return path


def build_args(pair, out, *extra):
    return ("build", "--target", str(pair[0]), "--drafter", str(pair[1]), "--out", str(out), *extra)


def error_line(err):
    """The `error: ...` part of stderr, whitespace-normalized (progress lines and warnings come before it)."""
    return " ".join(err[err.index("error: "):].split())


def leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def calib_bundle(tmp_path_factory, tiny_pair):
    """fp8 + FP8 KV cache, tp 3, batch 5, --calib-size 512 on a file of 3 prompts; (bundle, options, log lines)."""
    root = tmp_path_factory.mktemp("calib")
    prompts = write_prompts(root / "prompts.jsonl", 3)
    opts = dict(quant="fp8", kv_cache_dtype="fp8", tp_size=3, max_batch_size=5, calib_prompts=prompts, calib_size=512)
    lines = []
    from dflash_trt.build.pipeline import run_build

    run_build(BuildOptions(target=tiny_pair[0], drafter=tiny_pair[1], out=root / "b", **opts), log=lines.append)
    return root / "b", BuildOptions(target=tiny_pair[0], drafter=tiny_pair[1], out=root / "b", **opts), lines


# --- 1. --calib-size larger than the file -------------------------------------------------------------

def test_calib_size_above_the_file_warns_once_and_the_manifest_records_the_real_count(calib_bundle):
    out, opts, lines = calib_bundle
    want = f"warning: --calib-size 512 but {opts.calib_prompts} has 3 prompts: calibrating on all 3"
    assert [line for line in lines if line.startswith("warning: --calib-size")] == [want]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["calibration"] == {"source": str(opts.calib_prompts), "num_prompts": 3,
                                                       "requested": 512}
    assert f"ModelOpt max calibration on 3 prompts ({opts.calib_prompts})" in (out / "README.md").read_text()


def test_calib_size_above_the_file_dry_run(tmp_path, tiny_pair, monkeypatch, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", "--quant", "fp8",
                                                                  "--calib-prompts", str(prompts), "--calib-size",
                                                                  "512", "--dry-run"))
    assert code == 0, err
    want = f"warning: --calib-size 512 but {prompts} has 40 prompts: calibrating on all 40"
    assert [line for line in err.splitlines() if "--calib-size" in line] == [want]
    assert f"40 prompts from {prompts}" in stdout
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", "--quant", "fp8",
                                                                  "--calib-prompts", str(prompts), "--calib-size",
                                                                  "40", "--dry-run"))
    assert code == 0 and "--calib-size" not in err and f"40 prompts from {prompts}" in stdout, err
    assert not (tmp_path / "b").exists()


def test_calib_size_above_the_builtin_corpus_is_refused_by_the_dry_run_and_before_the_target_loads(
        tmp_path, tiny_pair, monkeypatch, capsys):
    """--calib-size over the built-in corpus (no --calib-prompts): refused in the check step, by --dry-run too (it
    printed a plan and the build failed after loading the target); nothing written."""
    import transformers

    from dflash_trt.build.quantize import calibration_texts
    from dflash_trt.errors import ConfigError

    with pytest.raises(ConfigError) as err:  # the corpus size, as its own error gives it
        calibration_texts(10**4)
    size = int(str(err.value).split("corpus has ")[1].split()[0])

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before --calib-size was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    want = (f"error: --calib-size {size + 1}: the built-in calibration corpus has {size} texts; give --calib-size "
            f"{size} or less, or --calib-prompts FILE (a JSONL of your own prompts)")
    for extra in (("--dry-run",), ()):
        code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", "--quant", "fp8",
                                                                      "--calib-size", str(size + 1), *extra))
        assert code != 0 and error_line(err) == want and "plan for" not in stdout, err
    assert not (tmp_path / "b").exists() and leftovers(tmp_path, "b") == []


def test_a_bad_calib_prompts_file_fails_in_the_check_step_before_the_target_is_loaded(tmp_path, tiny_pair, monkeypatch,
                                                                                       capsys):
    """A malformed --calib-prompts file is refused in step 1 (check), as --dry-run refuses it, not after step 2 has
    loaded the target (minutes for a large model): the target is never loaded, nothing is written."""
    import transformers

    bad = tmp_path / "calib.jsonl"
    bad.write_text('{"prompt": "def f(x):"}\nnot json\n')

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before --calib-prompts was read")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", "--quant", "fp8",
                                                             "--calib-prompts", str(bad)))
    assert code != 0 and error_line(err) == f"error: {bad}:2: not valid JSON (Expecting value); each line must be one " \
                                            "JSON object", err
    assert f"[1/{N_STEPS}] check ..." in err and f"[2/{N_STEPS}]" not in err and "Traceback" not in err
    assert not (tmp_path / "b").exists() and leftovers(tmp_path, "b") == []


def test_calib_prompts_with_nothing_to_calibrate_warns_and_records_no_source(tmp_path, tiny_pair, monkeypatch, capsys):
    """--calib-prompts with --quant none (no FP8 KV cache or drafter): the dry run and the build give the same one
    warning, and the manifest records no calibration source (it said the file, with 0 prompts)."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    want = (f"warning: --calib-prompts {prompts} is not used: nothing is quantized (give --quant, --kv-cache-dtype "
            "fp8 or --drafter-quant fp8 to calibrate)")
    for extra in (("--dry-run",), ()):
        code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", "--calib-prompts",
                                                                 str(prompts), *extra))
        assert code == 0 and [line for line in err.splitlines() if "--calib-prompts" in line] == [want], err
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["quantization"]["calibration"] == {"source": None, "num_prompts": 0, "requested": None}
    assert "Calibration" not in (tmp_path / "b" / "README.md").read_text()


# --- 2. the dry run checks --out as the build does -------------------------------------------------------

def test_dry_run_checks_out_as_the_build_does(tmp_path, tiny_pair, monkeypatch, capsys):
    """An empty --out (an unset $OUT), an --out under a file, an --out that exists (no --force), an --out in a
    folder this user may not write to: the dry run fails with the build's error line, exit 1, and neither writes anything."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(locked) else real_access(p, mode, **kw))
    cases = [("", "error: --out is empty; give a folder path (e.g. --out engines/my-bundle)"),  # was 'the current
             (" ", "error: --out is empty; give a folder path"),                             # folder' ('' is '.')
             (afile / "b", f"error: --out {afile / 'b'}: {afile} is a file, not a folder"),
             (afile / "x" / "b", f"error: --out {afile / 'x' / 'b'}: {afile} is a file, not a folder"),
             (afile, f"error: --out {afile} is a file, not a dflash-trt bundle; --force replaces only a dflash-trt "
                     "bundle or an empty folder"),  # not "pass --force", which then refused the file
             (locked / "b", f"error: --out {locked / 'b'}: cannot write in {locked} (permission denied)"),
             (locked / "new" / "b", f"error: --out {locked / 'new' / 'b'}: cannot write in {locked} (permission denied)")]
    for out, want in cases:
        got = []
        for extra in (("--dry-run",), ()):
            code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, *extra))
            assert code == 1 and "plan for" not in stdout, (out, extra, err)
            got.append(error_line(err))
        assert got[0] == got[1] and got[0].startswith(want), (out, got)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "locked"] and not any(locked.iterdir())
    assert afile.read_text() == "x"


def test_an_existing_out_is_refused_before_the_first_step(tmp_path, tiny_pair, calib_bundle, monkeypatch, capsys):
    """An existing --out without --force (a bundle, a folder) is refused before any work: no "[1/8] check" line, no
    `dflash-trt check`, no ModelOpt import (~10 s in all); --force still replaces the bundle, and still refuses a
    folder that is not one."""
    from dflash_trt.build import pipeline

    def no_checks(*_a, **_k):
        raise AssertionError("the build's checks ran before --out was refused")

    out = tmp_path / "old"
    shutil.copytree(calib_bundle[0], out)  # fp8, tp 3
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with monkeypatch.context() as m:
        m.setattr(pipeline, "preflight", no_checks)
        for where in (out, tmp_path / "notes"):
            code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, where))
            assert code == 1 and stdout == "" and err == (
                f"error: {where} already exists; remove it, pick another --out, or pass --force to replace it (--force "
                "replaces a dflash-trt bundle or an empty folder only)\n"), err
        code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "notes", "--force"))
        assert code == 1 and err == (
            f"error: --out {tmp_path / 'notes'} is a folder that is not a dflash-trt bundle (no bundle manifest.json); "
            "--force replaces only a dflash-trt bundle or an empty folder, so nothing else is lost: pick another --out, "
            "or move it away yourself\n"), err
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, "--force"))
    assert code == 0 and f"bundle written to {out}" in stdout and err.startswith("[1/8] check ..."), err
    assert json.loads((out / "manifest.json").read_text())["quantization"]["target"] == "none"
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"


def test_dry_run_says_it_creates_a_missing_parent(tmp_path, tiny_pair, monkeypatch, capsys):
    """The build creates missing parent folders of --out; the dry run accepts them too, says so, creates nothing."""
    out = tmp_path / "engines" / "nested" / "b"
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, "--dry-run"))
    assert code == 0, err
    assert f"move the bundle to {out} (creating the folder {out.parent})" in stdout
    assert list(tmp_path.iterdir()) == []


# --- 3. Ctrl-C ----------------------------------------------------------------------------------------

def interrupt(*_args, **_kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_exits_130_with_one_line_and_writes_nothing(tmp_path, tiny_pair, monkeypatch, capsys):
    from dflash_trt.build import trtllm

    monkeypatch.setattr(trtllm, "export_target_hf", interrupt)  # step 4
    out = tmp_path / "newp" / "a" / "b" / "x"
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out))
    assert code == 130, err
    assert err.splitlines()[-1] == (f"build interrupted (Ctrl-C) in step 4/8 'export unified HF target checkpoint'; "
                                    f"nothing was written to {out}")
    assert "Traceback" not in err and "bundle written" not in stdout
    assert list(tmp_path.iterdir()) == []  # nor the parent folders newp/a/b the build created
    (tmp_path / "newp").mkdir()  # an existing parent stays, the ones below it go
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out))
    assert code == 130 and list(tmp_path.iterdir()) == [tmp_path / "newp"] and not any((tmp_path / "newp").iterdir())

    empty = tmp_path / "empty"  # --force over an empty folder: it stays as it was
    empty.mkdir()
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, empty, "--force"))
    assert code == 130 and err.splitlines()[-1] == (
        f"build interrupted (Ctrl-C) in step 4/8 'export unified HF target checkpoint'; nothing was written to "
        f"{empty} (what was there, a folder that is not a dflash-trt bundle (no bundle manifest.json), is unchanged)"), err
    assert empty.is_dir() and not any(empty.iterdir()) and leftovers(tmp_path, "empty") == []


def test_a_full_disk_in_a_step_is_one_line_naming_the_step_and_writes_nothing(tmp_path, tiny_pair, monkeypatch,
                                                                              capsys):
    """ENOSPC while a step writes into the bundle's temporary folder: one line naming the step, the bundle's --out
    and the fix, exit 1, no traceback; the temporary folder and the parents the build created are removed."""
    import errno

    from dflash_trt.build import trtllm

    def full(*args, **kwargs):  # as a write inside the temporary bundle fails (its file under the temporary folder)
        tmp = next(p for p in (tmp_path / "new").iterdir() if p.name.startswith(".x.building-"))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "target" / "model.safetensors"))

    monkeypatch.setattr(trtllm, "export_target_hf", full)  # step 4
    out = tmp_path / "new" / "x"
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out))
    assert code == 1 and "Traceback" not in err and "bundle written" not in stdout, err
    assert error_line(err) == (f"error: build failed in step 'export unified HF target checkpoint': cannot write the "
                               f"bundle to --out {out} ({os.strerror(errno.ENOSPC)}); free space there, or give "
                               f"another --out; nothing was written to {out}"), err
    assert list(tmp_path.iterdir()) == []  # neither the temporary bundle nor the folder new/ the build created


def test_ctrl_c_in_the_checks_and_after_the_move(tmp_path, tiny_pair, monkeypatch, capsys):
    import dflash_trt.build.pipeline as pipeline
    import dflash_trt.models.loading as loading

    out = tmp_path / "y"
    with monkeypatch.context() as m:
        m.setattr(pipeline, "check_unquantized", interrupt)
        code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out))
    assert code == 130 and err.splitlines()[-1] == (f"build interrupted (Ctrl-C) in step 1/8 'check'; nothing was "
                                                    f"written to {out}"), err
    assert list(tmp_path.iterdir()) == []
    with monkeypatch.context() as m:  # in the --out checks that run before the first step (`check_paths`)
        m.setattr(pipeline, "check_out", interrupt)
        code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out))
    assert code == 130 and err == f"build interrupted (Ctrl-C); nothing was written to {out}\n", err
    assert list(tmp_path.iterdir()) == []

    publish = loading.publish_folder

    def publish_then_interrupt(tmp, dst):
        publish(tmp, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "publish_folder", publish_then_interrupt)
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out))
    assert code == 130 and err.splitlines()[-1] == (
        f"build interrupted (Ctrl-C) in step 8/8 'write manifest.json and move the bundle to --out', after the "
        f"complete bundle was moved to {out}"), err
    assert (out / "manifest.json").is_file() and leftovers(tmp_path, "y") == []


def test_ctrl_c_through_run_build_is_a_keyboard_interrupt(tmp_path, tiny_pair, monkeypatch):
    """Library callers get a KeyboardInterrupt (BuildInterrupted) with the same message, not a BuildError."""
    from dflash_trt.build import trtllm
    from dflash_trt.build.pipeline import BuildInterrupted

    monkeypatch.setattr(trtllm, "copy_drafter", interrupt)  # step 5
    with pytest.raises(KeyboardInterrupt) as exc:
        build_bundle(*tiny_pair, tmp_path / "z")
    assert isinstance(exc.value, BuildInterrupted) and str(exc.value).startswith(
        "build interrupted (Ctrl-C) in step 5/8 'drafter (copied, not quantized)'; nothing was written to")
    assert list(tmp_path.iterdir()) == []


# --- 4. step numbering --------------------------------------------------------------------------------

@pytest.mark.parametrize("quant,tp,kv,drafter_quant", [
    ("none", 1, "auto", "none"), ("none", 3, "fp8", "none"), ("none", 1, "auto", "fp8"), ("fp8", 1, "auto", "none"),
    ("fp8", 3, "fp8", "fp8"), ("nvfp4", 1, "auto", "none"), ("nvfp4", 3, "fp8", "none")])
def test_dry_run_numbers_every_step_as_the_build_does(tmp_path, tiny_pair, monkeypatch, capsys, quant, tp, kv,
                                                      drafter_quant):
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(
        tiny_pair, tmp_path / "b", "--quant", quant, "--tp-size", str(tp), "--kv-cache-dtype", kv, "--drafter-quant",
        drafter_quant, "--dry-run"))
    assert code == 0, err
    plan = [line.strip() for line in stdout.splitlines()[1:]]
    assert [line.split(" ", 1)[0] for line in plan] == [f"[{i}/{N_STEPS}]" for i in range(1, N_STEPS + 1)]
    opts = BuildOptions(target=tiny_pair[0], drafter=tiny_pair[1], out=tmp_path / "b", quant=quant, tp_size=tp,
                        kv_cache_dtype=kv, drafter_quant=drafter_quant)
    assert len(step_titles(opts)) == N_STEPS
    assert plan[1].startswith(f"[2/{N_STEPS}] calibrate + quantize target" if opts.calibrates
                              else f"[2/{N_STEPS}] load target on cpu")
    assert plan[-1].startswith(f"[{N_STEPS}/{N_STEPS}] write manifest.json")


def test_build_progress_lines_are_numbered_as_the_plan(calib_bundle):
    _, opts, lines = calib_bundle
    starts = [line.removesuffix(" ...") for line in lines if line.endswith(" ...")]
    assert starts == numbered(step_titles(opts))
    assert [line.split(":", 1)[0] for line in lines if ": done in " in line] == numbered(step_titles(opts))


def test_stdout_is_the_result_line_only(tmp_path, tiny_pair, monkeypatch, capsys):
    """ModelOpt prints to stdout while it quantizes and exports ("Inserted N quantizers", "current rank:
    ..."): those lines go to stderr with the progress, so stdout is the one result line a script reads. Its
    commands quote the path (a space in it broke them on copy-paste)."""
    out = tmp_path / "my bundles" / "b"
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, "--quant", "fp8", "--calib-size", "2"))
    assert code == 0, err
    r = out.resolve()
    assert stdout.splitlines() == [f"bundle written to {r}; run it with: dflash-trt generate --bundle '{r}' --chat "
                                   f"'...'; serve it with: '{r}/trtllm/launch.sh'"]
    assert "quantizers" in err and "[1/8] check" in err


# --- 5. llm_api_example.py passes serve.yaml's settings ------------------------------------------------

def example_settings(source: str) -> dict:
    """serve.yaml's dict as llm_api_example.py passes it: LLM(...)'s keywords, with kv_cache_config and
    speculative_config the keywords of KvCacheConfig(...) and DFlashDecodingConfig(...) (decoding_type DFlash);
    `str(here / P)` is the path P relative to the script's folder, as serve.yaml writes it."""
    calls = {n.func.id: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in ("LLM", "KvCacheConfig", "DFlashDecodingConfig")}
    assigned = {n.targets[0].id: n.value.func.id for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)}

    def value(node):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "str":  # str(here / 'P')
            assert isinstance(node.args[0], ast.BinOp) and ast.unparse(node.args[0].left) == "here"
            return ast.literal_eval(node.args[0].right)
        if isinstance(node, ast.Name):  # kv_cache / spec: the call assigned to that name
            return kwargs(calls[assigned[node.id]])
        return ast.literal_eval(node)

    def kwargs(call):
        return {k.arg: value(k.value) for k in call.keywords}

    settings = kwargs(calls["LLM"])
    settings["speculative_config"] = {"decoding_type": "DFlash", **settings["speculative_config"]}
    assert ast.unparse(calls["LLM"].args[0]) == "str(here / 'target')"
    return settings


def test_llm_api_example_passes_every_serve_yaml_setting(calib_bundle):
    from dflash_trt.build.schema import DFLASH_FIELDS, KV_CACHE_FIELDS, LLM_ARGS_FIELDS

    out, _, _ = calib_bundle
    serve = yaml.safe_load((out / "trtllm/serve.yaml").read_text())
    example = example_settings((out / "trtllm/llm_api_example.py").read_text())
    assert example == serve
    assert serve["kv_cache_config"] == {"dtype": "fp8", "free_gpu_memory_fraction": 0.85, "enable_block_reuse": False}
    assert serve["speculative_config"]["attention_backend"] == "VANILLA" and serve["max_batch_size"] == 5
    assert set(example) <= set(LLM_ARGS_FIELDS) and set(example["kv_cache_config"]) <= set(KV_CACHE_FIELDS)
    assert set(example["speculative_config"]) <= set(DFLASH_FIELDS)


@pytest.mark.parametrize("tp,kv,seq", [(1, "auto", None), (8, "fp8", 131072)])
def test_llm_api_example_follows_the_serve_config(tp, kv, seq):
    """The example is made from the serve config itself: a field added to it shows up in both."""
    from dflash_trt.build.trtllm import llm_api_example, serve_config

    cfg = serve_config(tp, 16, 151669, [1, 9, 17], kv, max_batch_size=64, max_seq_len=seq)
    assert example_settings(llm_api_example(cfg)) == cfg
    cfg["kv_cache_config"]["tokens_per_block"] = 32
    cfg["enable_chunked_prefill"] = True
    got = example_settings(llm_api_example(cfg))
    assert got["kv_cache_config"]["tokens_per_block"] == 32 and got["enable_chunked_prefill"] is True


def test_interrupted_build_leaves_an_existing_bundle(tmp_path, tiny_pair, calib_bundle, monkeypatch, capsys):
    """--force over a bundle, Ctrl-C in the middle: the old bundle is still there, complete."""
    from dflash_trt.build import trtllm
    from dflash_trt.build.manifest import load_manifest

    out = tmp_path / "old"
    shutil.copytree(calib_bundle[0], out)
    monkeypatch.setattr(trtllm, "write_serving_files", interrupt)  # step 6
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, "--force"))
    assert code == 130 and err.splitlines()[-1].endswith(
        f"nothing was written to {out} (what was there, a dflash-trt bundle, is unchanged)"), err
    assert load_manifest(out)["quantization"]["target"] == "fp8" and leftovers(tmp_path, "old") == []


# --- 6. inputs that are quantized already --------------------------------------------------------------

def test_an_already_quantized_target_or_drafter_is_refused(tmp_path, tiny_pair, tiny_bundle_fp8_tp3, monkeypatch,
                                                           capsys):
    """A bundle's own trtllm/target (ModelOpt FP8: quantization_config + hf_quant_config.json) as --target, or a
    drafter with an hf_quant_config.json: transformers would load the float8 weights without their scales, so the
    build (dry run or not) refuses it with one line naming the folder and the fix, and writes nothing."""
    fp8_target = tiny_bundle_fp8_tp3 / "trtllm" / "target"
    quant_drafter = tmp_path / "drafter-q"
    shutil.copytree(tiny_pair[1], quant_drafter)
    (quant_drafter / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}\n')
    cases = [((fp8_target, tiny_pair[1]), "--target", fp8_target, "config.json quantization_config and hf_quant_config.json"),
             ((tiny_pair[0], quant_drafter), "--drafter", quant_drafter, "hf_quant_config.json")]
    for pair, flag, folder, markers in cases:
        for extra in (("--dry-run",), ()):
            code, stdout, err = run_main(monkeypatch, capsys, *build_args(pair, tmp_path / "out", "--quant", "nvfp4",
                                                                          "--calib-size", "2", *extra))
            assert code == 1 and "Traceback" not in err and "plan for" not in stdout, err
            assert error_line(err) == (f"error: {flag} {folder} is an already-quantized checkpoint ({markers}); build "
                                       f"needs the original unquantized checkpoint: give that as {flag} (a bundle's "
                                       "trtllm/ folders are quantized already and cannot be quantized again)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter-q"]
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(fp8_target), "--drafter", str(tiny_pair[1]))
    assert code == 0, err  # the runtime dequantizes it on load: `check` accepts it


# --- 7. --out changed while the build ran ----------------------------------------------------------------

def test_a_folder_that_appears_at_out_during_the_build_is_kept(tmp_path, tiny_pair, monkeypatch, capsys):
    """--out is checked again before the move: a folder with a file created there while the build ran (no
    --force; then with --force, which replaces only a bundle or an empty folder) stays as it is, and the
    complete bundle goes to OUT.new (then OUT.new-2), named by the one error line."""
    from dflash_trt.build import trtllm
    from dflash_trt.build.manifest import load_manifest

    out = tmp_path / "b"
    write_serving_files = trtllm.write_serving_files

    def user_writes_at_out(*args, **kwargs):  # step 6: someone creates --out with a file in it
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        return write_serving_files(*args, **kwargs)

    monkeypatch.setattr(trtllm, "write_serving_files", user_writes_at_out)
    code, stdout, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out))
    assert code == 1 and "Traceback" not in err and "bundle written" not in stdout, err
    assert error_line(err) == (
        f"error: --out {out} changed while the build ran: it is now a folder that is not a dflash-trt bundle (no bundle "
        f"manifest.json), which is not replaced without --force; it is left as it is, and the complete bundle is at "
        f"{tmp_path / 'b.new'} (move it where you want it)")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert load_manifest(tmp_path / "b.new")["name"] == "b"  # complete: every file verified

    shutil.rmtree(out)
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, out, "--force"))
    assert code == 1 and error_line(err) == (
        f"error: --out {out} changed while the build ran: it is now a folder that is not a dflash-trt bundle (no bundle "
        f"manifest.json), which --force does not replace (only a dflash-trt bundle of its own files, or an empty "
        f"folder); it is left as it is, and the complete bundle is at {tmp_path / 'b.new-2'} (move it where you want "
        "it)"), err
    assert (out / "notes.txt").read_text() == "mine" and load_manifest(tmp_path / "b.new-2")["tp_size"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "b.new", "b.new-2"]  # no .b.building-* left


# --- 8. SIGTERM, and the folders of builds that did not finish --------------------------------------------

def test_sigterm_exits_143_with_one_line_and_removes_the_temporary_folder(tmp_path, tiny_pair):
    """A real `dflash-trt build` process sent SIGTERM (kill, timeout, docker stop) once its step 2 starts:
    exit 143, one last line saying so and that nothing was written, no `.NAME.building-*` left, no --out."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-c", "from dflash_trt.cli import main; main()",
                             *build_args(tiny_pair, out, "--quant", "fp8", "--calib-size", "8")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("[2/8] "):
            proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=120)
    lines = (''.join(seen) + rest).splitlines()
    assert proc.returncode == 143, lines
    assert re.fullmatch(rf"build terminated \(SIGTERM\) (in|after) step \d/8.*; nothing was written to {re.escape(str(out))}",
                        lines[-1]), lines
    assert "Traceback" not in rest and list(tmp_path.iterdir()) == []


def test_unfinished_build_folders_beside_out_are_named_not_removed(tmp_path, tiny_pair, monkeypatch, capsys):
    """`.NAME.building-*` beside --out (a build killed with SIGKILL, or one still running): the dry run and the
    build warn, naming them; neither removes them (another build's is not touched)."""
    stale = tmp_path / ".b.building-abc123"
    stale.mkdir()
    (stale / "rank0.safetensors").write_text("partial")
    (tmp_path / ".other.building-x").mkdir()  # another --out's: not named
    want = (f"warning: 1 unfinished build folder beside --out ({stale}): left by a build that was killed, or in use "
            f"by one still running; if no build of {tmp_path / 'b'} is running, remove it")
    for extra in (("--dry-run",), ()):
        code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", *extra))
        assert code == 0, err
        assert [line for line in err.splitlines() if "unfinished build folder" in line] == [want], err
    assert (stale / "rank0.safetensors").read_text() == "partial" and (tmp_path / ".other.building-x").is_dir()
    assert (tmp_path / "b" / "manifest.json").is_file()


def test_the_manifest_names_a_calibration_pipe_as_given(tmp_path):
    """--calib-prompts <(...) is read once; the manifest records the path given and what it was, not the
    /proc/PID/fd/pipe:[N] it resolves to. A file is recorded by its absolute path."""
    from dflash_trt.build.pipeline import calibration_source

    f = tmp_path / "calib.jsonl"
    f.write_text('{"prompt": "x"}\n')
    assert calibration_source(f) == str(f.resolve())
    assert calibration_source(Path("/dev/null")) == "/dev/null (a pipe or device, read once at build time)"


def test_too_little_free_space_for_the_bundle_is_warned_before_anything_is_loaded(tmp_path, tiny_pair, monkeypatch,
                                                                                  capsys):
    """A build that runs out of disk space fails only when it writes (after calibration, hours for a large model):
    the check step warns when --out's file system has less free space than the build's peak estimate
    (`bundle_bytes_estimate`), in the dry run too; with room enough, nothing is said."""
    import collections

    from dflash_trt.build import pipeline

    opts = BuildOptions(target=tiny_pair[0], drafter=tiny_pair[1], out=tmp_path / "b", quant="fp8")
    need = pipeline.bundle_bytes_estimate(opts)
    usage = collections.namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: usage(10 * need, 10 * need - need // 2, need // 2))
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", "--quant", "fp8", "--dry-run"))
    assert code == 0, err
    warning = " ".join(line for line in err.split("warning: ") if line.startswith("the file system of --out"))
    assert f"the file system of --out ({tmp_path}) has" in " ".join(warning.split())
    assert "it will likely fail with 'No space left on device'" in " ".join(warning.split())
    monkeypatch.setattr(pipeline.shutil, "disk_usage", real)
    code, _, err = run_main(monkeypatch, capsys, *build_args(tiny_pair, tmp_path / "b", "--quant", "fp8", "--dry-run"))
    assert code == 0 and "the file system of --out" not in err, err


@pytest.mark.parametrize("quant", ["fp8", "none"])
def test_the_disk_space_estimate_covers_the_bundle(tmp_path, tiny_pair, quant):
    """The estimate is at least what the build leaves on disk (its peak is the checkpoint's unsharded export beside
    its rank files) and not wildly over it."""
    from dflash_trt.build.pipeline import bundle_bytes_estimate, folder_bytes

    opts = BuildOptions(target=tiny_pair[0], drafter=tiny_pair[1], out=tmp_path / "b", quant=quant, tp_size=3)
    build_bundle(*tiny_pair, opts.out, quant=quant, tp_size=3)
    written = folder_bytes(opts.out)
    assert written <= bundle_bytes_estimate(opts) <= 1.6 * written, (written, bundle_bytes_estimate(opts))
