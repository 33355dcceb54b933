"""`dflash-trt bench` end to end on the real default model (a few prompts, few tokens)."""

from __future__ import annotations

import json
import sys

import pytest

from dflash_trt.cli import main


@pytest.mark.slow
def test_bench_writes_results_and_checks_identity(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Name a color."}]}\n{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "out"
    # --num-prompts 3 of a file of 2: the run and its header say 2
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--dataset", str(prompts), "--num-prompts", "3",
                                      "--max-tokens", "8", "--modes", "dflash,ar,hf", "--profile", "--out", str(out)])
    main()
    assert f"warning: {prompts} holds 2 prompts, fewer than --num-prompts 3" in capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    entry = res["datasets"][str(prompts)]
    assert entry["prompts"] == 2 and "max tokens 8, 2 prompts per dataset, batch size 1" in (out / "results.md").read_text()
    modes = entry["modes"]
    assert set(modes) == {"dflash", "ar", "hf"}
    for mode in modes:  # temperature 0: every mode gives the target's greedy tokens
        assert modes[mode]["identical_to_ar"] == 2 and modes[mode]["prompts"] == 2
    assert entry["speedup_vs_ar"]["ar"] == 1.0
    d = modes["dflash"]
    assert 1.0 <= d["acceptance_length"] <= 16 and 0.0 <= d["acceptance_rate"] <= 1.0
    assert len(d["acceptance_by_position"]) == res["config"]["block_size"] - 1
    # --draft-confidence / --tree-topk auto on the CPU: 0.2 and top-4 trees of at most 15
    # (max_draft_len) drafts verified per step
    assert res["config"]["draft_confidence"] == 0.2 and res["config"]["tree_topk"] == 4
    assert res["config"]["sampled_draft_confidence"] == 0.07
    assert 0 <= d["drafts_per_step"] <= 15
    from dflash_trt.ops import cpu_kernels_unavailable

    # float32 on the CPU: auto runs the packed kernels wherever they can run
    assert res["config"]["cpu_kernels"] == "auto" and res["config"]["cpu_kernels_used"] is (cpu_kernels_unavailable() is None)
    from dflash_trt.ops import cpu_isa, cpu_model_name

    assert res["machine"]["kernel_isa"] == cpu_isa() and res["machine"]["cpu_model"] == cpu_model_name()
    assert modes["hf"]["acceptance_length"] is None
    # --profile: our modes' time by phase adds up to their measured time (HF's loop is not ours to time)
    assert "time_breakdown" not in modes["hf"] and res["config"]["profile"] is True
    for mode in ("dflash", "ar"):
        b = modes[mode]["time_breakdown"]
        assert 0.5 * modes[mode]["seconds"] <= sum(b["seconds"].values()) <= modes[mode]["seconds"] + 1e-3
        assert b["calls"] == 2 and b["steps"] == modes[mode]["verify_steps"] > 0  # batch 1: the request's steps
    assert modes["ar"]["time_breakdown"]["seconds"]["draft"] == 0.0 < modes["dflash"]["time_breakdown"]["seconds"]["draft"]
    for name in ("results.md", "tau_histogram.png", "acceptance_by_position.png", "speedup.png"):
        assert (out / name).stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "| dataset | mode | tau | acceptance rate | drafts / step |" in md
    assert "| dataset | mode | batch steps | prefill | draft | target forward | logits and accept | inject | other | total |" in md
    assert md.count(f"| {prompts} | dflash | ") == 2 and md.count(f"| {prompts} | hf | ") == 1


def test_bench_rejects_unknown_mode_and_dataset(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "dflash,eagle"])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err  # a bad --modes value is a usage error (exit 2), like any bad flag value
    assert exc.value.code == 2 and "Invalid value for '--modes': unknown mode(s) ['eagle']" in err
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--threads", "0", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err and not (tmp_path / "o").exists()
    for modes, message in ((" , ", "'--modes': ' , ' names no mode"), ("ar,dflash,ar", "'--modes': ar listed more than once")):
        monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", modes, "--out", str(tmp_path / "o")])
        with pytest.raises(SystemExit) as exc:
            main()
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and "Traceback" not in err and not (tmp_path / "o").exists()


def test_identical_to_ar_and_the_drafter_are_blank_without_their_modes():
    from dflash_trt.bench.report import markdown_table
    from dflash_trt.bench.runner import ModeSummary

    m = ModeSummary("hf", prompts=2, completion_tokens=8, seconds=1.0).to_dict()
    assert m["identical_to_ar"] is None
    config = {"target": "t", "drafter": None, "block_size": None, "max_draft_len": None, "draft_confidence": None}
    table = markdown_table({"datasets": {"humaneval": {"modes": {"hf": m}}}, "config": config})
    assert table.splitlines()[-1].endswith("| 8.0 | - | - | - | - |")
    assert table.startswith("Target `t`, no drafter (no dflash mode), temperature") and "block size None" not in table


def test_plots_of_an_ar_only_run_say_why_they_are_empty(tmp_path):
    import warnings

    from dflash_trt.bench.report import plots

    results = {"datasets": {"humaneval": {"modes": {"ar": {"tau_per_prompt": None}}, "speedup_vs_ar": {"ar": 1.0}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found" was printed 3 times
        paths = plots(results, tmp_path)
    assert [p.name for p in paths] == ["tau_histogram.png", "acceptance_by_position.png", "speedup.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_speedup_plot_of_a_run_without_ar_says_so_and_draws_no_bars(tmp_path, monkeypatch):
    import dflash_trt.bench.report as report

    seen = {}
    save = report._save

    def record(fig, path):
        ax = fig.axes[0]
        seen[path.name] = ([t.get_text() for t in ax.texts], len(ax.patches))
        return save(fig, path)

    monkeypatch.setattr(report, "_save", record)
    results = {"datasets": {"humaneval": {"modes": {"dflash": {"tau_per_prompt": [2.0],
                                                               "acceptance_by_position": [0.5]}}}}}
    report.plots(results, tmp_path)
    assert seen["speedup.png"] == (["no ar mode in this run: no speedup to plot (add ar to --modes)"], 0)
    results["datasets"]["humaneval"]["modes"]["ar"] = {}
    results["datasets"]["humaneval"]["speedup_vs_ar"] = {"dflash": 1.5, "ar": 1.0}
    report.plots(results, tmp_path)
    assert seen["speedup.png"] == ([], 1)  # one bar: dflash over ar


def test_bench_checks_out_and_dataset_files_before_loading_models(tmp_path, monkeypatch, capsys):
    """A bench can run for hours: an unwritable --out (or one whose results.json is a folder), an empty
    --dataset or a malformed --dataset file fails before any model loads (it used to fail after the run,
    with a raw OS error, losing the results)."""
    import dflash_trt.api

    def no_loading(*args, **kwargs):
        raise AssertionError("the models were loaded before the arguments were checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_loading)
    afile = tmp_path / "afile"
    afile.write_text("x")
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "def add(a, b):"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [([str(good), "--out", str(afile)], f"--out {afile}: this is a file, not a folder"),
             ([str(good), "--out", str(afile / "sub")], f"--out {afile / 'sub'}: cannot write there (Not a directory)"),
             ([str(bad), "--out", str(tmp_path / "o")], f"{bad}:2: not valid JSON"),
             ([str(empty), "--out", str(tmp_path / "o")], str(empty)),
             ([str(good), "--out", ""], "--out is empty; give a folder path"),  # not the current folder, silently
             (["", "--out", str(tmp_path / "o")], "--dataset is empty; give mt-bench, humaneval or the path of a JSONL "
                                                  "file"),  # was "--dataset  is a directory"
             ([str(good), "--out", str(tmp_path / "r")], f"--out {tmp_path / 'r'}: {tmp_path / 'r' / 'results.json'} is "
              "a folder, where this command writes its results.json file; move it away, or give another folder")]
    (tmp_path / "r" / "results.json").mkdir(parents=True)  # the run completed, then failed renaming over it
    for args, message in cases:
        monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--dataset", *args])
        with pytest.raises(SystemExit) as exc:
            main()
        err = capsys.readouterr().err
        assert exc.value.code == 1 and message in err and "Traceback" not in err, err
    assert afile.read_text() == "x" and not (tmp_path / "o").exists()
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["results.json"]
    # a good --out is checked the same way and left as it was: nothing is created before the run
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--dataset", str(good), "--out", str(tmp_path / "n" / "o")])
    with pytest.raises(AssertionError, match="models were loaded"):
        main()
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_during_a_bench_writes_nothing_and_exits_130_or_143(tmp_path, monkeypatch, capsys,
                                                                               signal_name):
    """Interrupted while running (Ctrl-C, or SIGTERM as `terminate_as_interrupt` raises it): one line, exit 130 /
    143, an earlier run's files in --out untouched."""
    import dflash_trt.bench.runner
    from dflash_trt.interrupts import Terminated

    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"earlier": true}\n')

    def interrupted(*args, **kwargs):
        raise Terminated if signal_name == "SIGTERM" else KeyboardInterrupt

    monkeypatch.setattr(dflash_trt.bench.runner, "run_benchmark", interrupted)
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--dataset", "humaneval", "--num-prompts", "1",
                                      "--max-tokens", "2", "--modes", "ar", "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    how, code = ("terminated (SIGTERM)", 143) if signal_name == "SIGTERM" else ("interrupted (Ctrl-C)", 130)
    assert exc.value.code == code and "Traceback" not in err
    assert err.splitlines()[-1] == (f"bench {how}; no results were written to {out} (an earlier run's "
                                    "files there are unchanged)")
    assert sorted(p.name for p in out.iterdir()) == ["results.json"] and json.loads((out / "results.json").read_text()) == {
        "earlier": True}


def test_results_header_says_thread_or_threads():
    from dflash_trt.bench.report import markdown_table

    for n, word in ((1, "1 thread."), (2, "2 threads.")):
        assert word in markdown_table({"config": {}, "machine": {"threads": n, "dtype": "float32"}, "datasets": {}})


def test_results_header_names_the_cpu_and_its_kernels():
    from dflash_trt.bench.report import markdown_table

    def header(machine: dict, used) -> str:
        return markdown_table({"config": {"cpu_kernels_used": used},
                               "machine": {"threads": 1, "dtype": "float32", **machine}, "datasets": {}})

    assert "MB. CPU: AMD EPYC, AVX2 kernels." in header({"cpu_model": "AMD EPYC", "kernel_isa": "avx2"}, True)
    assert "MB. CPU: Intel Xeon, torch's linears." in header({"cpu_model": "Intel Xeon", "kernel_isa": "avx512"}, False)
    assert "CPU:" not in header({}, True)  # a results.json written before the record had a model name


def test_results_header_counts_the_prompts_each_dataset_ran():
    """The header gives the prompts that ran (a JSONL may hold fewer than --num-prompts), per dataset
    when they differ."""
    from dflash_trt.bench.report import markdown_table

    base = {"config": {"num_prompts": 10}, "machine": {"threads": 1, "dtype": "float32"}}
    same = markdown_table({**base, "datasets": {"humaneval": {"prompts": 10, "modes": {}},
                                                  "mt-bench": {"prompts": 10, "modes": {}}}})
    assert ", 10 prompts per dataset, " in same
    differ = markdown_table({**base, "datasets": {"humaneval": {"prompts": 10, "modes": {}},
                                                    "p.jsonl": {"prompts": 3, "modes": {}}}})
    assert ", prompts per dataset: humaneval 10, p.jsonl 3, " in differ


def test_bench_refuses_an_out_inside_a_bundle_before_loading_models(tmp_path, monkeypatch, capsys):
    """--out in a built bundle (its folder, or any folder under it, existing or not) would mix results into a
    deployable artifact: one line, exit 1, before any model loads, and nothing is written there. A folder
    whose manifest.json is not a bundle's is an ordinary --out; an earlier run's results.json there is
    overwritten, which bench says before it starts."""
    import dflash_trt.api
    from dflash_trt.build.manifest import write_manifest

    def no_loading(*args, **kwargs):
        raise AssertionError("the models were loaded before the arguments were checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_loading)
    bundle = tmp_path / "engines" / "b"
    (bundle / "trtllm").mkdir(parents=True)
    write_manifest(bundle, {"name": "b"})
    before = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    for out in (bundle, bundle / "bench", bundle / "trtllm" / "x" / "y"):
        monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "ar", "--out", str(out)])
        with pytest.raises(SystemExit) as exc:
            main()
        err = capsys.readouterr().err
        assert exc.value.code == 1 and "Traceback" not in err, err
        assert err.strip() == (f"error: --out {out} is inside the dflash-trt bundle {bundle.resolve()}; choose an "
                               "--out outside the bundle (e.g. --out bench_out)"), err
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == before
    model = tmp_path / "models" / "m"  # a target's folder, and a drafter folder (the packaged one's layout)
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}\n')
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}\n')
    for out, where in ((drafter, "is"), (drafter / "b" / "c", "is inside")):
        monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "ar", "--out", str(out)])
        with pytest.raises(SystemExit) as exc:
            main()
        err = capsys.readouterr().err
        assert exc.value.code == 1 and err.strip() == (f"error: --out {out} {where} the DFlash drafter folder "
                                                       f"{drafter.resolve()}; give a path outside it (a drafter folder "
                                                       "holds only what dflash-trt writes there)"), err
    assert not (drafter / "b").exists()
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "ar", "--out", str(model / "bench")])
    with pytest.raises(AssertionError, match="models were loaded"):  # a target's folder: warned, then it runs
        main()
    assert f"warning: --out {model / 'bench'} is inside the model folder {model.resolve()}" in capsys.readouterr().err

    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"kind": "something else"}\n')
    (other / "results.json").write_text("{}\n")
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "ar", "--out", str(other)])
    with pytest.raises(AssertionError, match="models were loaded"):
        main()
    assert (f"warning: --out {other} holds an earlier run's results.json; this run replaces it, results.md and the plots "
            "when it ends: to keep them, stop now and rerun with another --out (or move them away)") in capsys.readouterr().err


def short_context_target(folder, smollm2_path, context: int, weights: bool = False):
    """SmolLM2's config (max_position_embeddings = `context`) and tokenizer in `folder`; its weights
    (a link) only when `weights`."""
    folder.mkdir()
    cfg = json.loads((smollm2_path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": context}))
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]
    for name in names + (["model.safetensors"] if weights else []):
        if (smollm2_path / name).exists():
            (folder / name).symlink_to(smollm2_path / name)
    return folder


def test_bench_checks_prompt_lengths_before_loading_weights(tmp_path, monkeypatch, capsys, smollm2_path):
    """A prompt too long for the target's context (max_position_embeddings, with its tokenizer) fails before
    any weights load (the target here has none), naming the file and line (blank lines counted), the
    context and the fix; a built-in set names the set and prompt. --max-tokens past the room is a warning."""
    import dflash_trt.api

    def no_loading(*args, **kwargs):
        raise AssertionError("the models were loaded before the prompts were checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_loading)
    target = short_context_target(tmp_path / "t", smollm2_path, 32)
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "hi"}\n\n' + json.dumps({"prompt": "word " * 40}) + "\n"
                    + json.dumps({"prompt": "word " * 50}) + "\n")
    base = ["dflash-trt", "bench", "--target", str(target), "--modes", "ar", "--out", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", [*base, "--dataset", str(long)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "Traceback" not in err and "bench:" not in err, err  # no progress bar yet
    assert err.strip() == (f"error: {long}:3: prompt 2 of 3 (2 too long; also {long}:4) is 41 tokens and leaves no room "
                           "in the target's context of 32 tokens; shorten it to at most 31 tokens or remove that line")
    monkeypatch.setattr(sys, "argv", [*base, "--dataset", "MT-Bench"])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 1 and err.startswith("error: mt-bench: prompt 1 of 20 (20 too long; also 2, 3, 4, 5, 6, "
                                                  "...) is "), err
    assert "context of 32 tokens" in err and err.strip().endswith(
        "; drop --dataset mt-bench or use a target with a longer context")
    assert not (tmp_path / "o").exists()

    short = tmp_path / "short.jsonl"
    short.write_text('{"prompt": "hi"}\n')
    monkeypatch.setattr(sys, "argv", [*base, "--dataset", str(short), "--max-tokens", "31", "--num-prompts", "2"])
    with pytest.raises(AssertionError, match="models were loaded"):
        main()
    err = capsys.readouterr().err
    assert "does not fit" not in err  # the 1-token prompt leaves room for 31
    assert f"warning: {short} holds 1 prompt, fewer than --num-prompts 2; its rows are over that one" in err
    monkeypatch.setattr(sys, "argv", [*base, "--dataset", str(short), "--max-tokens", "40"])
    with pytest.raises(AssertionError, match="models were loaded"):
        main()
    assert (f"warning: --max-tokens 40 does not fit in the target's context of 32 tokens: {short}: the prompt takes "
            "1, so at most 31 tokens are generated") in capsys.readouterr().err


def test_bench_runs_each_dataset_once_and_counts_the_prompts_that_run(tmp_path, monkeypatch, capsys):
    """good.jsonl, ./good.jsonl and its absolute path are one dataset: it runs once, with one warning per
    dropped repeat; the progress bar counts the prompts that run (2 of --num-prompts 12, per mode); an
    explicit --seed with greedy decoding is named as ignored (the default seed is not)."""
    import types

    import dflash_trt.api
    import dflash_trt.bench.runner

    seen = {}

    def fake_run(pipe, datasets, modes, num_prompts, params, dtype, batch_size=1, progress=None, profile=False,
                 prompts=None):
        seen.update(datasets=datasets, prompts=prompts, total=progress.__self__.total)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: types.SimpleNamespace(
        engine=types.SimpleNamespace(proposer=None)))
    monkeypatch.setattr(dflash_trt.bench.runner, "run_benchmark", fake_run)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.jsonl").write_text('{"prompt": "def add(a, b):"}\n{"prompt": "Name a color."}\n')
    args = ["dflash-trt", "bench", "--modes", "ar,hf", "--num-prompts", "12", "--out", "o"]
    for ds in ("good.jsonl", "./good.jsonl", "good.jsonl", str(tmp_path / "good.jsonl")):
        args += ["--dataset", ds]
    monkeypatch.setattr(sys, "argv", [*args, "--seed", "3"])
    with pytest.raises(RuntimeError, match="stop here"):
        main()
    err = capsys.readouterr().err
    assert seen["datasets"] == ["good.jsonl"] and list(seen["prompts"]) == ["good.jsonl"]
    assert len(seen["prompts"]["good.jsonl"]) == 2 and seen["total"] == 2 * 2  # 2 prompts x 2 modes
    assert "warning: --dataset ./good.jsonl is the same file as --dataset good.jsonl; it runs once" in err
    assert "warning: --dataset good.jsonl is given twice; it runs once" in err
    assert f"warning: --dataset {tmp_path / 'good.jsonl'} is the same file as --dataset good.jsonl" in err
    assert ("warning: --seed 3 only applies when sampling (--temperature > 0); greedy decoding ignores it" in err)
    assert "warning: good.jsonl holds 2 prompts, fewer than --num-prompts 12; its rows are over those 2" in err
    monkeypatch.setattr(sys, "argv", args)
    with pytest.raises(RuntimeError, match="stop here"):
        main()
    assert "--seed" not in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", [*args, "--seed", "3", "--temperature", "0.7"])
    with pytest.raises(RuntimeError, match="stop here"):
        main()
    assert "--seed" not in capsys.readouterr().err


def test_results_header_says_token_or_tokens_of_prompt_lookup():
    from dflash_trt.bench.report import markdown_table

    cfg = {"block_size": 16, "max_draft_len": 15, "draft_confidence": 0.2}
    for n, words in ((1, "prompt lookup 1 token,"), (8, "prompt lookup 8 tokens,")):
        head = markdown_table({"config": {**cfg, "prompt_lookup": n, "max_concurrency": 1}, "datasets": {},
                               "machine": {"threads": 1, "dtype": "float32"}}).splitlines()[0]
        assert words in head, head


def test_encode_dataset_matches_the_pipeline_encoding(smollm2_path):
    """encode_dataset (the tokenizer alone, before any model loads) gives the token ids the pipeline's
    encode / encode_chat give, and where each prompt comes from."""
    from dflash_trt.api import load_tokenizer
    from dflash_trt.bench.runner import encode_dataset
    from dflash_trt.training.evalsets import humaneval_subset
    from dflash_trt.training.prompts import encode_prompt

    tok = load_tokenizer(smollm2_path)
    ids, where = encode_dataset(tok, "humaneval", 3)
    assert where == ["humaneval prompt 1", "humaneval prompt 2", "humaneval prompt 3"]
    assert ids == [encode_prompt(tok, [{"role": "user", "content": q}]) for q in humaneval_subset(3)]


def test_bench_refuses_logits_processing_with_hf_modes_before_loading(tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    for flags, named in ((["--repetition-penalty", "1.2"], "--repetition-penalty applies"),
                         (["--logit-bias", "5:1", "--min-tokens", "2"], "--logit-bias, --min-tokens apply"),
                         (["--regex", "a+"], "--regex applies")):
        monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "dflash,ar,hf", *flags, "--out", str(out)])
        with pytest.raises(SystemExit) as exc:
            main()
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"--modes hf: {named} to our modes only" in err and not out.exists()
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "ar", "--min-tokens", "9", "--max-tokens", "8",
                                      "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and "'--min-tokens': 9 is more than --max-tokens 8" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_with_a_logit_bias_checks_identity_and_records_it(tmp_path, monkeypatch):
    """A +100 bias makes the target repeat one token, which the drafts follow: long acceptance, outputs still
    identical to ar's; results.json records the processing."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Name a color."}]}\n')
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--dataset", str(prompts), "--num-prompts", "1",
                                      "--max-tokens", "24", "--modes", "dflash,ar", "--logit-bias", "504:100",
                                      "--repetition-penalty", "1.1", "--out", str(out)])
    main()
    res = json.loads((out / "results.json").read_text())
    modes = res["datasets"][str(prompts)]["modes"]
    assert modes["dflash"]["identical_to_ar"] == 1 and modes["dflash"]["acceptance_length"] >= 8  # auto draft length too
    assert res["config"]["logit_bias"] == {"504": 100.0} and res["config"]["repetition_penalty"] == 1.1
    assert res["config"]["min_tokens"] == 0 and res["config"]["presence_penalty"] == 0.0


@pytest.mark.slow
def test_bench_with_a_json_schema_checks_identity_and_records_it(tmp_path, monkeypatch):
    """Structured output in the bench: DFlash's answers under the schema equal ar's, and results.json records
    the schema."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Describe Paris as JSON."}]}\n')
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}')
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--dataset", str(prompts), "--num-prompts", "1",
                                      "--max-tokens", "24", "--modes", "dflash,ar", "--json-schema", str(schema),
                                      "--out", str(out)])
    main()
    res = json.loads((out / "results.json").read_text())
    assert res["datasets"][str(prompts)]["modes"]["dflash"]["identical_to_ar"] == 1
    assert res["config"]["guided"] == {"kind": "json", "json": schema.read_text()}


@pytest.mark.parametrize("flags, message", [
    (["--logit-bias", "49152:1"], "'--logit-bias': token 49152 is outside the target's vocabulary [0, 49152)"),
    (["--grammar", "root ::= missing"], "Invalid value for '--grammar': guided decoding: the grammar does not compile"),
])
def test_bench_checks_token_ids_and_grammars_before_loading_weights(tmp_path, monkeypatch, capsys, flags, message):
    import dflash_trt.api

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: pytest.fail("weights loaded"))
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--modes", "ar", *flags, "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err
