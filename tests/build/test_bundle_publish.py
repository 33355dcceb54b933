"""Publishing a bundle: modes another user can read, `--force` over a path that is not a bundle (a file),
and the drafter TensorRT-LLM gets: the full-vocabulary (z-lab) variant of a reduced-vocabulary drafter,
while `dflash-trt generate --bundle` keeps running the reduced one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from build_helpers import assert_greedy_dflash_equals_ar, build_bundle, write_tiny_drafter

from dflash_trt.build.manifest import load_manifest, sha256_file
from dflash_trt.models.loading import read_tensors
from tests.conftest import run_main
from tests.models.test_publish import assert_shareable

SCRIPTS = ("trtllm/launch.sh", "trtllm_checkpoint/build_engine.sh")
DRAFT_VOCAB = 1024


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture(scope="module")
def reduced_drafter(tmp_path_factory, tiny_pair):
    """The tiny pair's target with an untrained drafter over a reduced draft vocabulary (d2t, draft_vocab_size)."""
    target, _ = tiny_pair
    return write_tiny_drafter(tmp_path_factory.mktemp("reduced") / "drafter", target, draft_vocab_size=DRAFT_VOCAB)


def in_bf16(tensors: dict) -> tuple:
    """(the dtype of the floating tensors of `tensors`, `tensors` with those cast to bfloat16): trtllm/drafter holds the
    drafter in the target's serving dtype (`trtllm.drafter_in_serving_dtype`)."""
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return (dtypes.pop() if len(dtypes) == 1 else dtypes,
            {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()})


def test_reduced_vocab_drafter_bundle(tmp_path, tiny_pair, reduced_drafter, umask022, monkeypatch, capsys):
    """trtllm/drafter (what serve.yaml and llm_api_example.py load) is the full-vocabulary variant: no d2t,
    no draft_vocab_size, the same weights; runtime/drafter is the drafter as given and what `generate
    --bundle` runs, so its output equals the bundle's target with the original drafter, token for token
    and in accepted drafts. Every folder 0755, every file 0644 (scripts 0755) under umask 022."""
    from dflash_trt.api import load_bundle, load_pipeline
    from dflash_trt.compat import ERROR, check_checkpoints
    from dflash_trt.runtime.sampling import SamplingParams

    target, _ = tiny_pair
    given = tmp_path / "given"  # the drafter with the files an export carries beside its weights
    shutil.copytree(reduced_drafter, given)
    (given / "README.md").write_text("# notes on this drafter\n")
    (given / "training.json").write_text('{"steps": 3}\n')
    reduced_drafter = given
    out = tmp_path / "reduced"
    report = build_bundle(target, reduced_drafter, out, quant="none", tp_size=3)
    assert_shareable(out, scripts=SCRIPTS)

    trt, runtime = out / "trtllm/drafter", out / "runtime/drafter"
    source = read_tensors(reduced_drafter)
    full = read_tensors(trt)
    assert "d2t" in source and "d2t" not in full and set(full) == set(source) - {"d2t"}
    assert all(full[k].dtype == torch.bfloat16 for k in full) and in_bf16(source)[0] == torch.float32
    assert all(torch.equal(full[k], in_bf16(source)[1][k]) for k in full)  # the target's serving dtype
    trt_cfg = json.loads((trt / "config.json").read_text())
    src_cfg = json.loads((reduced_drafter / "config.json").read_text())
    assert src_cfg["draft_vocab_size"] == DRAFT_VOCAB and "draft_vocab_size" not in trt_cfg
    assert trt_cfg == {**{k: v for k, v in src_cfg.items() if k not in ("draft_vocab_size", "torch_dtype")},
                       "dtype": "bfloat16"}
    assert sha256_file(runtime / "model.safetensors") == sha256_file(reduced_drafter / "model.safetensors")
    assert json.loads((runtime / "config.json").read_text()) == src_cfg
    assert (runtime / "training.json").read_text() == (given / "training.json").read_text()
    # as given (trtllm/drafter writes its own README), then the build's quantization section
    assert (runtime / "README.md").read_text().startswith((given / "README.md").read_text())
    assert "## Quantization in this bundle" in (runtime / "README.md").read_text()
    # the given README's "run the export" advice is answered: the copy is in the bundle already
    assert "full-vocabulary copy that TensorRT-LLM, vLLM and SGLang load is already at `trtllm/drafter`" in \
        (runtime / "README.md").read_text()
    assert "UNTRAINED" in (trt / "README.md").read_text()

    m = load_manifest(out)
    assert m["models"]["drafter"]["path"] == "runtime/drafter" and m["models"]["drafter"]["trtllm_path"] == "trtllm/drafter"
    assert m["models"]["drafter"]["draft_vocab_size"] == DRAFT_VOCAB
    assert "full_vocab_copy" in m["models"]["drafter"]["trtllm_vocabulary"]
    assert {"trtllm/drafter/model.safetensors", "runtime/drafter/model.safetensors"} <= set(m["files"])
    assert yaml.safe_load((out / "trtllm/serve.yaml").read_text())["speculative_config"]["speculative_model"] == "./drafter"
    assert report.sizes["trtllm/drafter"] > 0 and report.sizes["runtime/drafter"] > 0
    assert "full vocabulary, no d2t" in report.steps[4].detail  # steps[0] is the check

    assert [f.message for f in check_checkpoints(out / "trtllm/target", trt) if f.level == ERROR] == []
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(out / "trtllm/target"), "--drafter", str(trt))
    assert code == 0, err

    chain = dict(draft_confidence=0.0, tree_topk=1, prompt_lookup=0, max_concurrency=None)
    pipe = load_bundle(out, **chain)
    assert pipe.engine.proposer.drafter.config.draft_vocab_size == DRAFT_VOCAB
    direct = load_pipeline(str(out / "trtllm/target"), str(reduced_drafter), **chain)
    prompts = [pipe.encode("def fibonacci(n):"), pipe.encode("The history of")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got, want = pipe.generate(prompts, params, "dflash"), direct.generate(prompts, params, "dflash")
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.metrics.accepted_tokens for r in got] == [r.metrics.accepted_tokens for r in want]
    assert_greedy_dflash_equals_ar(pipe, max_tokens=16)

    code, stdout, err = run_main(monkeypatch, capsys, "generate", "--bundle", str(out), "--prompt", "The history of",
                                 "--max-tokens", "12", "--json")
    assert code == 0, err
    ar = pipe.generate([pipe.encode("The history of")], SamplingParams(max_tokens=12), "ar")[0]
    assert json.loads(stdout.strip().splitlines()[-1])["token_ids"] == ar.token_ids


def test_fp8_reduced_vocab_drafter_bundle(tmp_path, tiny_pair, reduced_drafter, umask022):
    """--drafter-quant fp8: runtime/drafter (what dflash-trt loads) is FP8 with its d2t; trtllm/drafter is
    TensorRT-LLM's copy, NOT quantized (its DFlash loader makes `fc` a plain Linear in the checkpoint's dtype and
    reads no FP8 scales): the given drafter's weights, without d2t. Both readable (their weights used to be 0600);
    the bundle stays lossless."""
    from dflash_trt.api import load_bundle
    from dflash_trt.models.dequant import quant_algo

    target, _ = tiny_pair
    given = tmp_path / "given"
    shutil.copytree(reduced_drafter, given)
    (given / "training.json").write_text('{"steps": 3}\n')
    out = tmp_path / "fp8-drafter"
    report = build_bundle(target, given, out, quant="none", drafter_quant="fp8")
    assert_shareable(out, scripts=SCRIPTS)
    trt, runtime = out / "trtllm/drafter", out / "runtime/drafter"
    assert quant_algo(trt) is None and quant_algo(runtime) == "FP8"
    full, reduced, source = read_tensors(trt), read_tensors(runtime), read_tensors(given)
    assert "d2t" in reduced and set(full) == set(source) - {"d2t"}
    assert reduced["fc.weight"].dtype == torch.float8_e4m3fn and all(torch.equal(full[k], in_bf16(source)[1][k])
                                                                     for k in full)
    assert not (trt / "hf_quant_config.json").exists() and (runtime / "hf_quant_config.json").is_file()
    assert "draft_vocab_size" not in json.loads((trt / "config.json").read_text())
    for folder in (trt, runtime):  # how the drafter was made survives quantization (its README said "elsewhere")
        assert (folder / "training.json").read_text() == '{"steps": 3}\n'
    m = load_manifest(out)["models"]["drafter"]
    assert m["as_given"] == f"draft vocabulary {DRAFT_VOCAB}, FP8" and m["trtllm_quantization"] == "none"
    assert "full vocabulary, no d2t, in bfloat16, not quantized" in report.steps[4].detail
    assert "- Drafter: not quantized: TensorRT-LLM's DFlash loader" in (trt / "README.md").read_text()
    assert "- Drafter: **FP8**" in (runtime / "README.md").read_text()
    assert_greedy_dflash_equals_ar(load_bundle(out), max_tokens=16)


def test_fp8_drafter_bundle_keeps_trtllms_drafter_as_given(tmp_path, tiny_pair):
    """A full-vocabulary z-lab drafter with --drafter-quant fp8: trtllm/drafter is a copy of it as given (what
    serve.yaml names), runtime/drafter its FP8 variant, which `generate --bundle` loads (lossless)."""
    from dflash_trt.api import load_bundle
    from dflash_trt.models.dequant import quant_algo

    target, drafter = tiny_pair
    out = tmp_path / "b"
    report = build_bundle(target, drafter, out, quant="none", drafter_quant="fp8")
    trt, runtime = out / "trtllm/drafter", out / "runtime/drafter"
    got, want = read_tensors(trt), in_bf16(read_tensors(drafter))[1]  # as given, in the target's serving dtype
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)
    assert quant_algo(trt) is None and quant_algo(runtime) == "FP8"
    m = load_manifest(out)["models"]["drafter"]
    assert (m["path"], m["trtllm_path"], m["as_given"]) == ("runtime/drafter", "trtllm/drafter", "FP8")
    assert m["trtllm_vocabulary"] == "full (as given)"
    assert "(FP8 in runtime/drafter/ for dflash-trt; trtllm/drafter/: the drafter as given, in bfloat16, not quantized)" in \
        report.steps[4].detail
    assert yaml.safe_load((out / "trtllm/serve.yaml").read_text())["speculative_config"]["speculative_model"] == "./drafter"
    pipe = load_bundle(out)
    assert Path(pipe.drafter_path).resolve() == runtime.resolve()
    assert_greedy_dflash_equals_ar(pipe, max_tokens=16)


def test_force_replaces_only_a_bundle_or_an_empty_folder(tmp_path, tiny_pair, umask022, monkeypatch, capsys):
    """`build --out X --force` with X a FILE or a non-empty folder that is not a bundle: refused (dry run
    or not) with one line, X untouched, nothing left beside it. An empty folder is replaced, and a bundle
    built there is then replaced by the next --force build."""
    target, drafter = tiny_pair
    victim = tmp_path / "victim.jsonl"
    victim.write_text('{"prompt": "def add(a, b):"}\n')
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("x")
    base = ("build", "--target", str(target), "--drafter", str(drafter))
    for out, what in ((victim, "a file, not a dflash-trt bundle"),
                      (notes, "a folder that is not a dflash-trt bundle (no bundle manifest.json)")):
        for dry in ((), ("--dry-run",)):
            code, stdout, err = run_main(monkeypatch, capsys, *base, "--out", str(out), "--force", *dry)
            assert code == 1 and "Traceback" not in err, err
            assert f"--out {out} is {what}; --force replaces only a dflash-trt bundle or an empty folder" in " ".join(
                err.split())  # rich wraps
    assert victim.read_text() == '{"prompt": "def add(a, b):"}\n' and (notes / "a.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "victim.jsonl"]

    empty = tmp_path / "empty"
    empty.mkdir()
    code, stdout, err = run_main(monkeypatch, capsys, *base, "--out", str(empty), "--force", "--dry-run")
    assert code == 0 and "which is a folder that is not a dflash-trt bundle (no bundle manifest.json)" in stdout
    code, _, err = run_main(monkeypatch, capsys, *base, "--out", str(empty), "--force")
    assert code == 0, err
    assert load_manifest(empty)["tp_size"] == 1 and assert_shareable(empty, scripts=SCRIPTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "notes", "victim.jsonl"]
    code, stdout, err = run_main(monkeypatch, capsys, *base, "--out", str(empty), "--force", "--dry-run")  # now a bundle
    assert code == 0 and f"replace the existing bundle at {empty} (--force) with the new one" in stdout
    shutil.rmtree(notes)
    code, stdout, err = run_main(monkeypatch, capsys, *base, "--out", str(notes), "--dry-run")
    assert code == 0 and f"move the bundle to {notes}" in stdout


def test_out_overlapping_an_input_is_refused(tmp_path, tiny_pair, monkeypatch, capsys):
    """An --out that is, is inside or holds the --target or --drafter folder (given or default) is refused
    with one line naming both paths, even with --force, dry run or not, before anything is written."""
    from dflash_trt.models.default import default_drafter_path, default_target_path

    root = tmp_path / "pair"
    shutil.copytree(tiny_pair[0], root / "target")
    shutil.copytree(tiny_pair[1], root / "drafter")
    target, drafter = root / "target", root / "drafter"
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    cases = [(drafter, "is", "--drafter", drafter), (target, "is", "--target", target),
             (drafter / "bundle", "is inside", "--drafter", drafter), (root, "holds", "--target", target),
             (tmp_path / "link", "is", "--drafter", drafter)]
    (tmp_path / "link").symlink_to(drafter)
    for out, where, flag, folder in cases:
        for extra in (("--dry-run",), ()):
            code, stdout, err = run_main(monkeypatch, capsys, "build", "--target", str(target), "--drafter",
                                         str(drafter), "--out", str(out), "--force", *extra)
            assert code == 1, (out, extra, err)
            assert f"--out {out} {where} the {flag} folder {folder}" in " ".join(err.split()), err
            assert "--force does not change this" in " ".join(err.split()) and "plan for" not in stdout
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert not (drafter / "bundle").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "pair"]

    for out, flag, folder in ((default_target_path(), "--target", default_target_path()),
                              (default_drafter_path(), "--drafter", default_drafter_path())):
        code, stdout, err = run_main(monkeypatch, capsys, "build", "--out", str(out), "--force", "--dry-run")
        assert code == 1 and f"--out {out} is the {flag} folder {folder}" in " ".join(err.split()), err


def test_sources_are_recorded_as_absolute_paths(tmp_path, tiny_pair, monkeypatch):
    """--target/--drafter/--calib-prompts given relative to the build's folder: manifest.json and README.md
    record them absolute ('../w/d1' pointed nowhere from the bundle's folder or another machine)."""
    shutil.copytree(tiny_pair[1], tmp_path / "d1")
    (tmp_path / "calib.jsonl").write_text('{"prompt": "Write a haiku about rain."}\n')
    work = tmp_path / "w"
    work.mkdir()
    monkeypatch.chdir(work)
    rel_target = os.path.relpath(tiny_pair[0], work)
    build_bundle(rel_target, "../d1", tmp_path / "b", quant="fp8", calib_prompts="../calib.jsonl", calib_size=1)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["models"]["target"]["source"] == str(Path(tiny_pair[0]).resolve())
    assert manifest["models"]["drafter"]["source"] == str((tmp_path / "d1").resolve())
    assert manifest["quantization"]["calibration"]["source"] == str((tmp_path / "calib.jsonl").resolve())
    readme = (tmp_path / "b" / "README.md").read_text()
    assert f"with the DFlash drafter `{(tmp_path / 'd1').resolve()}`" in readme and "`../d1`" not in readme


def test_a_symlinked_out_names_the_folder_it_points_to(tmp_path, tiny_pair):
    """`build --out linkb --force` with linkb -> b-none: the bundle is written into b-none (the link stays a link
    to it), and manifest.json and README.md name it b-none, not linkb."""
    real = tmp_path / "b-none"
    build_bundle(*tiny_pair, real)
    (tmp_path / "linkb").symlink_to("b-none")
    report = build_bundle(*tiny_pair, tmp_path / "linkb", force=True)
    assert report.out == real and (tmp_path / "linkb").is_symlink() and (tmp_path / "linkb").resolve() == real
    assert load_manifest(real)["name"] == "b-none"
    assert (real / "README.md").read_text().startswith("# dflash-trt bundle b-none\n")


@pytest.mark.parametrize("reduced", [True, False], ids=["reduced-vocab", "full-vocab"])
def test_speculators_drafter_bundle(tmp_path, tiny_pair, reduced_drafter, reduced, monkeypatch, capsys):
    """A drafter in the vLLM speculators format: runtime/drafter keeps it as given (what `generate --bundle`
    runs, the same drafts as the z-lab original), trtllm/drafter is its z-lab full-vocabulary copy (the
    original's weights and config), and the READMEs and manifest say which is which."""
    from dflash_trt.api import load_bundle, load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams
    from dflash_trt.training.export import full_vocab_copy, speculators_copy

    target, plain = tiny_pair
    zlab = reduced_drafter if reduced else plain
    spec = speculators_copy(zlab, tmp_path / "spec", target)
    out = tmp_path / "bundle"
    report = build_bundle(target, spec, out, quant="none", tp_size=1)
    runtime, trt = out / "runtime/drafter", out / "trtllm/drafter"
    assert sha256_file(runtime / "model.safetensors") == sha256_file(spec / "model.safetensors")
    assert json.loads((runtime / "config.json").read_text())["speculators_model_type"] == "dflash"
    want = full_vocab_copy(zlab, tmp_path / "zlab-full")
    got_t, want_t = read_tensors(trt), read_tensors(want)
    assert set(got_t) == set(want_t) and all(torch.equal(got_t[k], in_bf16(want_t)[1][k]) for k in got_t)
    trt_cfg = json.loads((trt / "config.json").read_text())
    assert trt_cfg["architectures"] == ["DFlashDraftModel"] and "speculators_model_type" not in trt_cfg
    assert trt_cfg["dflash_config"] == json.loads((want / "config.json").read_text())["dflash_config"]
    m = load_manifest(out)["models"]["drafter"]
    given = (f"draft vocabulary {DRAFT_VOCAB}, " if reduced else "") + "speculators format"
    assert m["path"] == "runtime/drafter" and m["as_given"] == given
    assert given in report.steps[4].detail and "z-lab format, full vocabulary" in report.steps[4].detail
    assert f"- runtime/drafter/: the drafter dflash-trt loads ({given})" in (out / "README.md").read_text()
    assert "vLLM `speculators` format" in (runtime / "README.md").read_text()
    assert "z-lab / ModelOpt format" in (trt / "README.md").read_text()

    chain = dict(draft_confidence=0.0, tree_topk=1, prompt_lookup=0, max_concurrency=None)
    pipe, direct = load_bundle(out, **chain), load_pipeline(str(out / "trtllm/target"), str(zlab), **chain)
    prompts = [pipe.encode("def fibonacci(n):"), pipe.encode("The history of")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got, want_r = pipe.generate(prompts, params, "dflash"), direct.generate(prompts, params, "dflash")
    assert [r.token_ids for r in got] == [r.token_ids for r in want_r]
    assert [r.metrics.accepted_per_position for r in got] == [r.metrics.accepted_per_position for r in want_r]


def test_speculators_drafter_of_another_target_is_not_built(tmp_path, tiny_pair, smollm2_path):
    """The build's check compares a speculators drafter's copy of its target's lm_head rows with --target: a
    drafter made for another target is refused before anything is written (it built a bundle that could not run)."""
    from build_helpers import write_tiny_target

    from dflash_trt.errors import IncompatibleModelsError
    from dflash_trt.training.export import speculators_copy

    target, plain = tiny_pair
    other = write_tiny_target(tmp_path / "other", smollm2_path, seed=5)
    from dflash_trt.models.loading import save_checkpoint

    spec = speculators_copy(plain, tmp_path / "spec", other)  # full vocabulary: no copy stored, so add other's head
    tensors = read_tensors(spec)
    tensors["lm_head.weight"] = read_tensors(other, keys=("lm_head.weight",))["lm_head.weight"]
    save_checkpoint(spec, json.loads((spec / "config.json").read_text()), tensors)
    with pytest.raises(IncompatibleModelsError, match="(?s)dflash-trt check failed, nothing was built:.*is not this target's"):
        build_bundle(target, spec, tmp_path / "b", quant="none", tp_size=1)
    assert not (tmp_path / "b").exists()


def test_fp8_bundle_of_a_speculators_drafter_says_what_each_folder_holds(tmp_path, tiny_pair):
    """--drafter-quant fp8 on a speculators-format drafter: runtime/drafter is FP8 in the z-lab format (the manifest
    and README say "FP8", not "speculators format"); trtllm/drafter is its z-lab conversion, not quantized."""
    from dflash_trt.models.dequant import quant_algo
    from dflash_trt.training.export import speculators_copy

    target, plain = tiny_pair
    spec = speculators_copy(plain, tmp_path / "spec", target)
    out = tmp_path / "b"
    report = build_bundle(target, spec, out, quant="none", drafter_quant="fp8")
    runtime, trt = out / "runtime/drafter", out / "trtllm/drafter"
    assert quant_algo(runtime) == "FP8" and quant_algo(trt) is None
    for folder in (runtime, trt):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"] and "speculators_model_type" not in cfg
    m = load_manifest(out)["models"]["drafter"]
    assert m["as_given"] == "FP8" and "full_vocab_copy" in m["trtllm_vocabulary"]
    assert "- runtime/drafter/: the drafter dflash-trt loads (FP8)." in (out / "README.md").read_text()
    assert "trtllm/drafter/: z-lab format, full vocabulary, no d2t, in bfloat16, not quantized" in report.steps[4].detail
