"""Bundles: layout, manifest verification errors, atomic builds, and lossless DFlash on quantized bundles."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from build_helpers import assert_greedy_dflash_equals_ar, build_bundle

from dflash_trt.build.manifest import SCHEMA_VERSION, load_manifest, sha256_file
from dflash_trt.errors import BuildError, BundleError, ConfigError, IncompatibleModelsError


@pytest.fixture
def bundle(tmp_path, tiny_bundle_fp8_tp3):
    dst = tmp_path / "b"
    shutil.copytree(tiny_bundle_fp8_tp3, dst)
    return dst


def test_layout_and_manifest(tiny_bundle_fp8_tp3):
    b = tiny_bundle_fp8_tp3
    m = load_manifest(b)
    assert m["schema_version"] == SCHEMA_VERSION and m["tp_size"] == 3 and m["block_size"] == 4
    assert m["max_draft_len"] == 3 and m["target_layer_ids"] == [1, 2] and m["mask_token_id"] == 16
    assert m["quantization"]["target"] == "fp8" and m["quantization"]["trtllm_checkpoint"]["quant_algo"] == "FP8"
    assert m["tools"]["nvidia-modelopt"] == "0.47.0" and m["tools"]["tensorrt_llm"] is None
    files = set(m["files"])
    assert {"trtllm/target/config.json", "trtllm/target/hf_quant_config.json", "trtllm/target/tokenizer.json",
            "trtllm/drafter/model.safetensors", "trtllm/serve.yaml", "trtllm/launch.sh", "trtllm/llm_api_example.py",
            "trtllm_checkpoint/config.json", "trtllm_checkpoint/build_engine.sh"} <= files
    assert {f"trtllm_checkpoint/rank{r}.safetensors" for r in range(3)} <= files
    for rel, entry in m["files"].items():
        assert sha256_file(b / rel) == entry["sha256"]
    serve = yaml.safe_load((b / "trtllm/serve.yaml").read_text())
    assert serve["speculative_config"] == {"decoding_type": "DFlash", "max_draft_len": 3, "speculative_model": "./drafter",
                                           "mask_token_id": 16, "target_layer_ids": [1, 2], "attention_backend": "VANILLA"}
    ckpt = json.loads((b / "trtllm_checkpoint/config.json").read_text())
    assert ckpt["mapping"] == {"world_size": 3, "tp_size": 3, "pp_size": 1}
    assert ckpt["architecture"] == "LlamaForCausalLM" and ckpt["rotary_base"] == 10000.0 and "qwen_type" not in ckpt
    assert ckpt["quantization"]["quant_algo"] == "FP8"
    assert "--max_draft_len 3" in (b / "trtllm_checkpoint/build_engine.sh").read_text()


def test_emitted_scripts_parse_and_use_known_fields(tiny_bundle_fp8_tp3):
    import ast

    from dflash_trt.build.schema import DFLASH_FIELDS, KV_CACHE_FIELDS, LLM_ARGS_FIELDS

    b = tiny_bundle_fp8_tp3
    for script in ("trtllm/launch.sh", "trtllm_checkpoint/build_engine.sh"):
        assert subprocess.run(["bash", "-n", str(b / script)], capture_output=True).returncode == 0, script
    tree = ast.parse((b / "trtllm/llm_api_example.py").read_text())
    calls = {n.func.id: {k.arg for k in n.keywords} for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert calls["DFlashDecodingConfig"] == {"max_draft_len", "speculative_model", "mask_token_id", "target_layer_ids",
                                           "attention_backend"}  # every speculative_config field of serve.yaml
    assert calls["DFlashDecodingConfig"] <= set(DFLASH_FIELDS) and calls["KvCacheConfig"] <= set(KV_CACHE_FIELDS)
    assert calls["LLM"] <= set(LLM_ARGS_FIELDS)


def test_build_engine_sh_writes_the_engine_outside_the_bundle(tiny_bundle_fp8_tp3, tmp_path):
    """trtllm-build (TensorRT-LLM, not installable here) is replaced on PATH by a script that records its
    arguments: build_engine.sh passes the checkpoint folder and an engine folder outside the bundle
    (BUNDLE.engine by default; a relative OUTPUT_DIR is taken from the caller's folder, not the script's)."""
    b = tiny_bundle_fp8_tp3
    fake = tmp_path / "bin" / "trtllm-build"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "ARGS_FILE": str(tmp_path / "args")}

    def run(*args):
        r = subprocess.run(["bash", str(b / "trtllm_checkpoint/build_engine.sh"), *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        argv = (tmp_path / "args").read_text().splitlines()
        return argv[argv.index("--checkpoint_dir") + 1], argv[argv.index("--output_dir") + 1], argv

    ckpt, out, argv = run()
    assert ckpt == str((b / "trtllm_checkpoint").resolve()) and out == f"{b.resolve()}.engine"
    assert argv[argv.index("--workers") + 1] == "3" and argv[argv.index("--max_draft_len") + 1] == "3"
    assert run("engines/x")[1] == "engines/x"  # as given, resolved by trtllm-build from the caller's folder
    load_manifest(b)  # the bundle is unchanged
    script = str(b / "trtllm_checkpoint/build_engine.sh")
    inside = str(b / "engines")  # inside the bundle: its next build --force would refuse it
    for args, code in ((["--help"], 0), (["-o", "x"], 2), (["a", "b"], 2), ([inside], 2)):  # never --output_dir --help
        r = subprocess.run(["bash", script, *args], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == code and ("usage: " in r.stdout + r.stderr or "is inside the bundle" in r.stderr), (args, r)
    r = subprocess.run(["bash", script], cwd=tmp_path, env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True,
                       text=True)
    assert r.returncode == 127 and r.stderr.startswith("trtllm-build not found: install TensorRT-LLM 1.2.x - "), r


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed here")
def test_serving_files_name_the_install_when_tensorrt_llm_is_missing(tiny_bundle_fp8_tp3, tmp_path):
    """launch.sh without trtllm-serve on PATH, llm_api_example.py without tensorrt_llm: one line naming the install
    (and our runtime), not `exec: trtllm-serve: not found` or a ModuleNotFoundError traceback."""
    b = tiny_bundle_fp8_tp3.resolve()
    r = subprocess.run(["bash", str(b / "trtllm/launch.sh")], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 127 and r.stderr == (
        "trtllm-serve not found: install TensorRT-LLM >= 1.3.0rc (pip install tensorrt_llm; DFlash needs its PyTorch "
        f"backend), or serve this bundle with dflash-trt serve --bundle {b}\n"), r
    r = subprocess.run([sys.executable, str(b / "trtllm/llm_api_example.py")], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stderr == (
        "llm_api_example.py: cannot import TensorRT-LLM (No module named 'tensorrt_llm'); install TensorRT-LLM >= "
        "1.3.0rc (pip install tensorrt_llm; DFlash needs its PyTorch backend), or run this bundle with dflash-trt "
        f"generate --bundle {b}\n"), r


def test_missing_file(bundle):
    (bundle / "trtllm_checkpoint/rank2.safetensors").unlink()
    with pytest.raises(BundleError, match="missing file trtllm_checkpoint/rank2.safetensors") as exc:
        load_manifest(bundle)
    assert str(exc.value).endswith(". Restore the files, or rebuild: `dflash-trt build --out NEW_FOLDER`")


def test_altered_file(bundle):
    f = bundle / "trtllm/target/model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="altered file trtllm/target/model.safetensors") as exc:
        load_manifest(bundle)
    # it said "Rebuild it with `dflash-trt build`", and build --force then refused the edited bundle
    assert str(exc.value).endswith(". Restore the files, or rebuild: `dflash-trt build --out NEW_FOLDER` (`build "
                                   "--force` over this bundle keeps edited files: move them away first)")


def test_newer_schema(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    m["schema_version"] = SCHEMA_VERSION + 1
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=f"manifest schema {SCHEMA_VERSION + 1} is newer .* upgrade dflash-trt"):
        load_manifest(bundle)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="no such bundle folder"):
        load_manifest(tmp_path / "nope")
    with pytest.raises(BundleError, match="no manifest.json"):
        load_manifest(tmp_path)
    for kind, cfg in (("drafter", {"architectures": ["DFlashDraftModel"], "dflash_config": {}}),
                      ("target", {"architectures": ["LlamaForCausalLM"]})):  # it said "rebuild it"
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(BundleError) as exc:
            load_manifest(tmp_path / kind)
        assert str(exc.value) == (f"{tmp_path / kind} is a model folder (a {kind}), not a dflash-trt bundle: give it "
                                  f"as --{kind} (a bundle is the folder `dflash-trt build --out` wrote)")
    # a file: not "no such bundle folder; build one with --out FILE" (a build there is refused); "": not '.'
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    with pytest.raises(BundleError) as exc:
        load_manifest(tmp_path / "prompts.jsonl")
    assert str(exc.value) == (f"{tmp_path / 'prompts.jsonl'} is a file, not a bundle folder; give the folder "
                              "`dflash-trt build --out` wrote")
    with pytest.raises(BundleError) as exc:
        load_manifest("")
    assert str(exc.value) == ("the bundle path is empty; give the folder `dflash-trt build --out` wrote (e.g. "
                              "engines/my-bundle)")


def edit_manifest(bundle, edit):
    m = json.loads((bundle / "manifest.json").read_text())
    m = edit(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def test_a_hand_edited_manifest_is_a_bundle_error(bundle, monkeypatch, capsys):
    """A manifest.json that is JSON but not what the build writes: one BundleError naming the entry and saying
    to rebuild (they were a KeyError, AttributeError or TypeError traceback in generate / serve --bundle)."""
    from dflash_trt.api import load_bundle
    from tests.conftest import run_main

    original = (bundle / "manifest.json").read_text()
    where = bundle / "manifest.json"
    fix = "; rebuild the bundle (dflash-trt build --out NEW_FOLDER)"
    cases = [(lambda m: {k: v for k, v in m.items() if k != "models"}, "models.target.path is missing, not a folder "
              "path inside the bundle"),
             (lambda m: {**m, "files": []}, "files is a JSON array, not a table of {path: {sha256, bytes}}"),
             (lambda m: [1, 2], "a JSON array, not an object"),
             (lambda m: {**m, "models": {**m["models"], "target": {**m["models"]["target"], "path": 123}}},
              "models.target.path is 123, not a folder path inside the bundle"),
             (lambda m: {**m, "tokenizer": {"path": "../../elsewhere"}},
              'tokenizer.path is "../../elsewhere", not a folder path inside the bundle')]
    for edit, what in cases:
        where.write_text(original)
        edit_manifest(bundle, edit)
        with pytest.raises(BundleError) as exc:
            load_bundle(bundle)
        assert str(exc.value) == f"{where}: {what}{fix}"
        code, _, err = run_main(monkeypatch, capsys, "generate", "--bundle", str(bundle), "--prompt", "hi")
        assert code == 1 and err.strip() == f"error: {where}: {what}{fix}" and "Traceback" not in err


def test_incompatible_models_inside_a_rehashed_bundle(bundle):
    from dflash_trt.api import load_bundle

    cfg_file = bundle / "trtllm/drafter/config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 7]
    cfg_file.write_text(json.dumps(cfg))
    m = json.loads((bundle / "manifest.json").read_text())
    m["files"]["trtllm/drafter/config.json"]["sha256"] = sha256_file(cfg_file)
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IncompatibleModelsError, match=r"\[7\] outside \[0, 3\]"):
        load_bundle(bundle)


def test_cli_reports_a_broken_bundle_without_traceback(bundle):
    cfg = bundle / "trtllm/target/generation_config.json"
    cfg.write_text(cfg.read_text().replace("}", ', "temperature": 0.5}', 1))
    r = subprocess.run([sys.executable, "-c", "from dflash_trt.cli import main; main()", "generate", "--bundle",
                        str(bundle), "--prompt", "hi"], capture_output=True, text=True)
    assert r.returncode == 1 and "error: bundle" in r.stderr
    assert "altered file trtllm/target/generation_config.json" in r.stderr and "Traceback" not in r.stderr


def test_files_the_runtime_does_not_load_may_change(bundle, monkeypatch, capsys):
    """A tuned trtllm/serve.yaml (free_gpu_memory_fraction), a deleted Triton config: generate --bundle runs the
    verified models and warns in one line naming those files; a loaded file altered still fails."""
    from dflash_trt.api import load_bundle
    from tests.conftest import run_main

    serve = bundle / "trtllm/serve.yaml"
    serve.write_text(serve.read_text().replace("free_gpu_memory_fraction: 0.85", "free_gpu_memory_fraction: 0.6"))
    assert "0.6" in serve.read_text()
    (bundle / "triton/dflash/config.pbtxt").unlink()
    want = (f"bundle {bundle}: missing triton/dflash/config.pbtxt, altered trtllm/serve.yaml since the build; dflash-trt "
            "does not load these files, and what it loads is verified")
    assert load_bundle(bundle, load_drafter_model=False).warnings == [want]
    code, stdout, err = run_main(monkeypatch, capsys, "generate", "--bundle", str(bundle), "--prompt", "hi",
                                 "--max-tokens", "2")
    assert code == 0 and f"warning: {want}" in err.splitlines() and stdout.strip(), err
    with pytest.raises(BundleError, match="failed verification: missing file triton/dflash/config.pbtxt"):
        load_manifest(bundle)  # the manifest itself still checks every file
    weights = bundle / "runtime/drafter/model.safetensors"
    if not weights.is_file():
        weights = bundle / "trtllm/drafter/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(BundleError, match=f"failed verification: altered file {weights.relative_to(bundle)}"):
        load_bundle(bundle)



def test_a_file_added_to_a_loaded_folder_is_refused(bundle):
    """The loaders read every file of the target, drafter and tokenizer folders: a `*.safetensors` added there
    (e.g. an "updated" layer) silently replaced the verified weights, and generate --bundle ran it. Such a file,
    unlisted in the manifest, fails verification by name; one added elsewhere (notes beside serve.yaml) does not."""
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_trt.api import load_bundle

    key = "model.layers.0.mlp.down_proj.weight"
    weights = load_file(bundle / "trtllm/target/model.safetensors")
    save_file({key: torch.zeros_like(weights[key])}, bundle / "trtllm/target/.zz-update.safetensors")  # glob reads it
    (bundle / "trtllm/drafter/added_tokens.json").write_text('{"<extra>": 49152}')
    with pytest.raises(BundleError) as exc:
        load_bundle(bundle, load_drafter_model=False)
    drafter = load_manifest(bundle, verify=False)["models"]["drafter"]["path"]
    unlisted = ["trtllm/target/.zz-update.safetensors"] + (["trtllm/drafter/added_tokens.json"]
                                                          if drafter == "trtllm/drafter" else [])
    assert str(exc.value) == (f"bundle {bundle} failed verification: "
                              + "; ".join(f"unlisted file {f} (added since the build; dflash-trt would load it)"
                                          for f in unlisted)
                              + ". Remove the unlisted files, or rebuild: `dflash-trt build --out NEW_FOLDER` "
                              "(`build --force` over this bundle keeps added files: move them away first)")
    (bundle / "trtllm/target/.zz-update.safetensors").unlink()
    (bundle / "trtllm/drafter/added_tokens.json").unlink()
    (bundle / "trtllm/notes.txt").write_text("tuned on node 7\n")  # not in a folder dflash-trt loads
    (bundle / "trtllm/target/.DS_Store").write_bytes(b"")  # hidden, read by no loader
    assert load_bundle(bundle, load_drafter_model=False).warnings == []

def leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_failed_build_leaves_nothing(tmp_path, tiny_pair, monkeypatch):
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"prompt": "def add(a, b):"}\n{"prompt": broken\n')
    out = tmp_path / "engines" / "x"
    # a malformed --calib-prompts is refused in the check step, before the target is loaded or anything written
    with pytest.raises(ConfigError, match=r"calib.jsonl:2: not valid JSON"):
        build_bundle(*tiny_pair, out, quant="fp8", calib_prompts=calib)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl"]

    def broken(*args, **kwargs):
        raise ValueError("calibration diverged")

    monkeypatch.setattr("dflash_trt.build.quantize.quantize_model", broken)  # step 2, after the build folder is made
    with pytest.raises(BuildError, match=r"(?s)calibration diverged.*nothing was written to"):
        build_bundle(*tiny_pair, out, quant="fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl"]  # engines/, which the build made, too


def test_failed_build_names_the_step_that_failed(tmp_path, tiny_pair, monkeypatch):
    from dflash_trt.build import trtllm

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(trtllm, "copy_drafter", broken)  # step 4: a failure that is not ours
    out = tmp_path / "engines" / "y"
    with pytest.raises(BuildError, match=r"build failed in step 'drafter \(copied, not quantized\)': OSError: disk full; nothing was "
                                         r"written to"):
        build_bundle(*tiny_pair, out, quant="none")
    assert list(tmp_path.iterdir()) == []  # nor engines/, which the build made


def test_failed_rebuild_with_force_keeps_the_old_bundle(tmp_path, tiny_pair, tiny_bundle_fp8_tp3, monkeypatch):
    out = tmp_path / "old"
    shutil.copytree(tiny_bundle_fp8_tp3, out)
    from dflash_trt.build import trtllm

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(trtllm, "copy_drafter", broken)  # step 5: the new bundle is half written
    with pytest.raises(BuildError, match="disk full"):
        build_bundle(*tiny_pair, out, quant="nvfp4", force=True)
    assert load_manifest(out)["quantization"]["target"] == "fp8" and leftovers(tmp_path, "old") == []


def test_refusals_before_writing(tmp_path, tiny_pair, tiny_bundle_fp8_tp3):
    target, drafter = tiny_pair
    with pytest.raises(ConfigError, match="already exists"):
        build_bundle(target, drafter, tiny_bundle_fp8_tp3)
    with pytest.raises(ConfigError, match="6 attention heads are not divisible by tp 4"):
        build_bundle(target, drafter, tmp_path / "tp4", tp_size=4)
    evalset = tmp_path / "mt_bench_question.jsonl"
    evalset.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ConfigError, match="looks like an evaluation set"):
        build_bundle(target, drafter, tmp_path / "ev", quant="fp8", calib_prompts=evalset)
    from dflash_trt.datasets import mt_bench_first_turns

    sneaky = tmp_path / "prompts.jsonl"
    sneaky.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt": mt_bench_first_turns(1)[0]}))
    with pytest.raises(ConfigError, match="prompt 2 is an MT-Bench / HumanEval item"):
        build_bundle(target, drafter, tmp_path / "ev2", quant="fp8", calib_prompts=sneaky)
    bad = tmp_path / "bad-drafter"
    shutil.copytree(drafter, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = 32000
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(IncompatibleModelsError, match="check failed, nothing was built"):
        build_bundle(target, bad, tmp_path / "inc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad-drafter", "mt_bench_question.jsonl", "prompts.jsonl"]


def test_dry_run_writes_nothing(tmp_path, tiny_pair):
    target, drafter = tiny_pair
    out = tmp_path / "dry"
    r = subprocess.run([sys.executable, "-c", "from dflash_trt.cli import main; main()", "build", "--target", str(target),
                        "--drafter", str(drafter), "--out", str(out), "--quant", "nvfp4", "--tp-size", "3", "--dry-run"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "calibrate + quantize target with ModelOpt on cpu: nvfp4" in r.stdout and "tp 3 (2 heads, 1 KV head per rank)" in r.stdout
    assert not out.exists()


CONFIGS = [("none", 1, "none", "auto"), ("fp8", 3, "fp8", "fp8"), ("nvfp4", 1, "none", "auto"), ("nvfp4", 3, "fp8", "auto")]


@pytest.mark.parametrize("quant,tp,drafter_quant,kv", CONFIGS)
def test_quantized_bundle_dflash_equals_ar_of_the_same_quantized_target(tmp_path, tiny_pair, quant, tp, drafter_quant, kv):
    from dflash_trt.api import load_bundle
    from dflash_trt.models.dequant import quant_algo

    out = tmp_path / f"{quant}-{tp}"
    report = build_bundle(*tiny_pair, out, quant=quant, tp_size=tp, drafter_quant=drafter_quant, kv_cache_dtype=kv)
    assert quant_algo(out / "trtllm/target") == {"none": None, "fp8": "FP8", "nvfp4": "NVFP4"}[quant]
    assert quant_algo(out / "trtllm/drafter") is None  # TensorRT-LLM's DFlash loader reads no FP8 drafter
    assert (out / "runtime/drafter").is_dir() == (drafter_quant == "fp8")  # dflash-trt's FP8 drafter
    if drafter_quant == "fp8":
        assert quant_algo(out / "runtime/drafter") == "FP8"
    assert report.sizes["total"] > 0 and len(report.steps) == 8  # step_titles: the same 8 for every option
    if kv == "fp8":
        assert json.loads((out / "trtllm/target/hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
        assert json.loads((out / "trtllm_checkpoint/config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
        assert yaml.safe_load((out / "trtllm/serve.yaml").read_text())["kv_cache_config"]["dtype"] == "fp8"
    pipe = load_bundle(out)
    assert_greedy_dflash_equals_ar(pipe)


def test_qwen3_bundle_has_the_per_rank_checkpoint(tmp_path, tiny_qwen3_pair):
    """Qwen3 (the family of the released DFlash drafters): trtllm/ and trtllm_checkpoint/ at tp 2, FP8."""
    from dflash_trt.api import load_bundle
    from dflash_trt.build.sharding import ShardSpec, merge_state_dicts
    from dflash_trt.build.trtllm import read_trtllm_ranks
    from dflash_trt.runtime.sampling import SamplingParams

    out = tmp_path / "qwen3-fp8"
    report = build_bundle(*tiny_qwen3_pair, out, quant="fp8", tp_size=2)
    m = load_manifest(out)
    assert m["trtllm_checkpoint"] == "trtllm_checkpoint" and {"trtllm_checkpoint/rank0.safetensors",
                                                              "trtllm_checkpoint/rank1.safetensors"} <= set(m["files"])
    assert m["models"]["target"]["trtllm_checkpoint_architecture"] == "Qwen3ForCausalLM"
    assert m["quantization"]["trtllm_checkpoint"]["quant_algo"] == "FP8" and "Qwen3ForCausalLM" in report.steps[2].detail
    config, ranks = read_trtllm_ranks(out / "trtllm_checkpoint")
    assert config["qwen_type"] == "qwen3" and config["mapping"]["tp_size"] == 2 and config["rotary_base"] == 1e6
    merged = merge_state_dicts(ranks, ShardSpec.from_trtllm_config(config, 2))
    assert merged["transformer.layers.0.attention.qkv.weight"].shape == ((4 + 2 + 2) * 32, 96)
    assert "--workers 2" in (out / "trtllm_checkpoint/build_engine.sh").read_text()
    assert yaml.safe_load((out / "trtllm/serve.yaml").read_text())["tensor_parallel_size"] == 2
    assert json.loads((out / "trtllm/target/config.json").read_text())["quantization_config"]["quant_algo"] == "FP8"
    pipe = load_bundle(out)
    prompts = [pipe.encode("def fibonacci(n):"), pipe.encode("The history of")]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    assert [r.token_ids for r in pipe.generate(prompts, params, "dflash")] == \
        [r.token_ids for r in pipe.generate(prompts, params, "ar")]


def test_calibration_texts_are_the_same_in_every_process():
    """The built-in calibration corpus holds no memory address (a signature default like
    `<function IS_CHARACTER_JUNK at 0x7f...>` differed per process, and with it the FP8 scales of every build)."""
    import subprocess
    import sys

    code = "from dflash_trt.build.quantize import calibration_texts; import json; print(json.dumps(calibration_texts(64)))"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1]
    texts = json.loads(runs[0])
    assert len(texts) == 64 and not any(" at 0x" in t for t in texts)
    assert sum("def ndiff(a, b, linejunk=None, charjunk=<function IS_CHARACTER_JUNK>)" in t for t in
               json.loads(subprocess.run([sys.executable, "-c", code.replace("(64)", "(4)")], capture_output=True,
                                         text=True, check=True).stdout)) == 1  # kept, without its address


def test_kv_fp8_only_bundle_loads_like_the_unquantized_one(tmp_path, tiny_pair):
    """`--kv-cache-dtype fp8` without --quant: trtllm/target keeps its weights but gains ModelOpt's KV-cache
    scales (k_proj.k_scale, v_proj.v_scale); the loader ignores them (the config says the KV cache is
    FP8), `check` agrees, and the bundle's greedy output equals the unquantized bundle's. A scale key
    without that config, or any other extra key, is still refused."""
    import torch

    from dflash_trt.api import load_bundle
    from dflash_trt.compat import ERROR, check_checkpoints
    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.checkpoints import kv_cache_fp8, load_target
    from dflash_trt.models.dequant import quant_algo
    from dflash_trt.models.loading import read_tensors, save_checkpoint
    from dflash_trt.runtime.sampling import SamplingParams

    plain, kv = tmp_path / "plain", tmp_path / "kv"
    build_bundle(*tiny_pair, plain, quant="none")
    build_bundle(*tiny_pair, kv, quant="none", kv_cache_dtype="fp8")
    target = kv / "trtllm/target"
    assert quant_algo(target) is None and kv_cache_fp8(target) and not kv_cache_fp8(plain / "trtllm/target")
    scales = [k for k in read_tensors(target) if k.endswith(("k_scale", "v_scale"))]
    assert "model.layers.0.self_attn.k_proj.k_scale" in scales and "model.layers.0.self_attn.v_proj.v_scale" in scales
    assert not [f for f in check_checkpoints(target, kv / "trtllm/drafter") if f.level == ERROR]
    a, b = load_target(plain / "trtllm/target"), load_target(target)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    pipes = [load_bundle(plain), load_bundle(kv)]
    prompts = [pipes[0].encode("def fibonacci(n):"), pipes[0].encode_chat("Name three colours.")]
    outs = [[r.token_ids for r in p.generate(prompts, params, mode)] for p in pipes for mode in ("ar", "dflash")]
    assert outs[0] == outs[1] == outs[2] == outs[3]

    tensors = read_tensors(target)
    config = json.loads((target / "config.json").read_text())
    extra = tmp_path / "extra"  # FP8 KV cache, plus a key no config explains
    save_checkpoint(extra, config, {**tensors, "model.layers.0.self_attn.k_proj.bias": torch.zeros(4)})
    with pytest.raises(CheckpointError, match="unexpected key.*k_proj.bias"):
        load_target(extra)
    no_kv = tmp_path / "no-kv"  # the KV scales, but no FP8 KV cache in the config
    save_checkpoint(no_kv, {k: v for k, v in config.items() if k != "quantization_config"}, tensors)
    with pytest.raises(CheckpointError, match="unexpected key.*k_proj.k_scale"):
        load_target(no_kv)


def test_calib_prompts_formats_in_help_and_docs_match_the_loader(tmp_path, monkeypatch, capsys):
    """--calib-prompts takes {"prompt"} / {"messages"} lines (the train-drafter format); a {"text"} line
    is refused, and neither `build --help` nor docs/build.md offers it."""
    from pathlib import Path

    from dflash_trt.build.quantize import read_calibration_jsonl
    from tests.conftest import run_main

    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"prompt": "def add(a, b):"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    assert read_calibration_jsonl(calib, 8) == ["def add(a, b):", [{"role": "user", "content": "Hi"}]]
    calib.write_text('{"text": "def add(a, b):"}\n')
    with pytest.raises(ConfigError):
        read_calibration_jsonl(calib, 8)
    code, stdout, _ = run_main(monkeypatch, capsys, "build", "--help")
    help_text = " ".join(stdout.split())
    assert code == 0 and '{"prompt": ...} or {"messages": [...]}' in help_text and '"text"' not in help_text
    docs = (Path(__file__).resolve().parents[2] / "docs/build.md").read_text()
    assert '{"text"}' not in docs and '`{"prompt": text}` or chat `{"messages": [...]}`' in docs


def test_a_bundle_given_as_target_or_drafter_names_its_model_folders(tiny_bundle_fp8_tp3, monkeypatch, capsys):
    """`check --drafter BUNDLE` (or --target): one line naming the bundle's model folders and generate --bundle
    (it said 'is it a Hugging Face checkpoint?'); the folders it names pass the check."""
    from tests.conftest import run_main

    b = tiny_bundle_fp8_tp3
    for option in ("--target", "--drafter"):
        code, out, err = run_main(monkeypatch, capsys, "check", option, str(b))
        assert (code, out) == (1, "") and err == (
            f"error: {option} {b} is a dflash-trt bundle, not a {'model' if option == '--target' else 'drafter'} folder: "
            f"give its {b}/trtllm/target (--target) and {b}/trtllm/drafter (--drafter) folders, or run it with "
            f"dflash-trt generate --bundle {b}\n"), err
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(b / "trtllm/target"),
                              "--drafter", str(b / "trtllm/drafter"))
    assert code == 0 and out.splitlines()[-1].startswith("ok: the drafter fits the target"), err


def test_check_takes_a_bundle_verifies_it_and_checks_its_models(bundle, monkeypatch, capsys):
    """`check --bundle`: the bundle's target and drafter checked (ok, naming their folders in it); a loaded file
    altered since the build fails as generate --bundle does; --target beside --bundle is a usage error."""
    from tests.conftest import run_main

    code, out, err = run_main(monkeypatch, capsys, "check", "--bundle", str(bundle))
    assert code == 0, err
    assert out.startswith("ok: the drafter fits the target") and f"target {bundle}/trtllm/target" in out
    assert f"drafter {bundle}/" in out
    assert out.endswith(f"; bundle {bundle}: its target, drafter and tokenizer files match its manifest (sha256)\n")
    code, _, err = run_main(monkeypatch, capsys, "check", "--bundle", str(bundle), "--target", str(bundle))
    assert code == 2 and "--bundle already holds the target and drafter" in err
    config = bundle / "trtllm" / "target" / "config.json"
    config.write_text(config.read_text().replace("{", "{ ", 1))  # altered since the build
    code, _, err = run_main(monkeypatch, capsys, "check", "--bundle", str(bundle))
    assert code == 1 and "config.json" in err and "Traceback" not in err
