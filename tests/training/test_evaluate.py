"""`dflash_trt.training.evaluate.evaluate`: tau + greedy parity per set, a cache that skips repeated
decodes, and one progress line per decode."""

import pytest
import torch

from tests.training.conftest import EOS, MASK, word_tokenizer
from dflash_trt.models.checkpoints import new_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.training.evaluate import evaluate


def test_evaluate_reports_parity_caches_and_prints_progress(tmp_path, tiny_target, capsys):
    torch.manual_seed(0)
    drafter = DFlashDrafter(new_drafter_config(tiny_target.config, 1, 4, MASK, [0, 1])).eval()
    sets = {"tiny": ["w5 w6 w7 w9", "w8 w9 w10", "w11 w4 w30 w31 w7"]}
    cache = tmp_path / "cache.json"
    args = (tiny_target, word_tokenizer(), (EOS,), {"d": drafter}, sets, 12, None, cache)
    first = evaluate(*args, drafter_keys={"d": "k1"}, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("evaluate: tiny: autoregressive reference, 3 prompts, ")
    entry = first["sets"]["tiny"]["drafters"]["d"]
    assert err[1].startswith(f"evaluate: tiny: d: tau {entry['tau']:.3f}, parity 3/3, ")
    assert entry["parity"] and entry["tau"] >= 1.0 and first["sets"]["tiny"]["prompts"] == 3
    again = evaluate(*args, drafter_keys={"d": "k1"}, progress=True)  # everything cached: no decode
    assert capsys.readouterr().err == "" and again["sets"]["tiny"]["drafters"]["d"] == entry


def test_the_cache_is_written_atomically_and_a_file_that_is_not_one_is_kept(tmp_path, tiny_target, capsys, monkeypatch):
    """A Ctrl-C while the cache is written leaves the previous cache whole (it was truncated, and every later
    run failed on it until deleted by hand); a file that is not an evaluate cache (not JSON, another JSON file)
    is refused, naming it and the fix, and kept as it was (it was replaced, with a warning)."""
    from dflash_trt.errors import ConfigError

    import json

    torch.manual_seed(0)
    drafter = DFlashDrafter(new_drafter_config(tiny_target.config, 1, 4, MASK, [0, 1])).eval()
    sets = {"tiny": ["w5 w6 w7 w9", "w8 w9 w10"]}
    cache = tmp_path / "cache.json"
    args = (tiny_target, word_tokenizer(), (EOS,), {"d": drafter}, sets, 6, None, cache)
    first = evaluate(*args, drafter_keys={"d": "k1"})
    whole = cache.read_text()
    assert len(json.loads(whole)) == 2  # the AR outputs and the drafter's results

    import dflash_trt.files

    def interrupted(fd):  # the temporary file is written, then Ctrl-C before it replaces the cache
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash_trt.files.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate(*args, drafter_keys={"d": "k2"})  # new weights key: decodes, then writes the cache
    monkeypatch.undo()
    assert cache.read_text() == whole and sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]
    capsys.readouterr()
    for damaged, problem in (('{"tiny:2:6:', "not valid JSON ("), ("[1, 2]", "not a JSON object)"),
                             ('{"name": "my notes"}', "a JSON object without evaluate's entries)")):
        cache.write_text(damaged)
        with pytest.raises(ConfigError) as e:
            evaluate(*args, drafter_keys={"d": "k1"})
        assert str(e.value).startswith(f"the cache {cache} is not an evaluate cache ({problem}"), str(e.value)
        assert str(e.value).endswith("so it is not replaced; give another --cache file (or --out folder), or remove "
                                     "that file if it is a cache you no longer need")
        assert cache.read_text() == damaged and capsys.readouterr().err == ""
    cache.write_text("{}")  # an empty cache is one
    again = evaluate(*args, drafter_keys={"d": "k1"})
    d, d0 = again["sets"]["tiny"]["drafters"]["d"], first["sets"]["tiny"]["drafters"]["d"]
    assert (d["tau"], d["parity_count"]) == (d0["tau"], d0["parity_count"]) and len(json.loads(cache.read_text())) == 2


def test_teacher_forced_figures_match_the_decoded_tau(tmp_path, tiny_target, tiny_samples):
    """--teacher-forced: the trainer's validation metric on the AR outputs equals the decoded tau
    (float32 features from the target, as decoding has them), cached drafter results included; the
    anchor mean is larger; acceptance.md gets both columns."""
    from dflash_trt.training.evaluate import write_report
    from dflash_trt.training.pipeline import make_train_data
    from dflash_trt.training.trainer import TrainConfig, train

    from tests.training.conftest import DATA_LAYERS

    torch.manual_seed(0)
    drafter = DFlashDrafter(new_drafter_config(tiny_target.config, 1, 4, MASK, [0, 1]))
    cfg = TrainConfig(block_size=4, anchors_per_seq=8, seqs_per_step=4, epochs=20, lr=1e-2, checkpoint_every=1000)
    train(drafter, make_train_data(tiny_samples, DATA_LAYERS, (0, 1), tiny_target, None), cfg, tmp_path / "run",
          progress=False)
    drafter.eval()
    sets = {"tiny": [" ".join(f"w{t}" for t in s["tokens"][: s["prompt_len"]].tolist()) for s in tiny_samples[:12]]}
    args = (tiny_target, word_tokenizer(), (EOS,), {"d": drafter}, sets, 40, None, tmp_path / "cache.json")
    for _ in range(2):  # decoded, then from the cache
        report = evaluate(*args, drafter_keys={"d": "k"}, with_teacher_forced=True)
        d = report["sets"]["tiny"]["drafters"]["d"]
        assert d["tau"] > 1.15 and d["teacher_forced"]["tau"] == d["tau"], d
        assert d["teacher_forced"]["anchor_mean"] > d["tau"] and d["teacher_forced"]["blocks"] > 100
    assert "teacher_forced" not in evaluate(*args, drafter_keys={"d": "k"})["sets"]["tiny"]["drafters"]["d"]
    report["block_size"] = 4
    write_report(report, tmp_path / "out")
    md = (tmp_path / "out" / "acceptance.md").read_text()
    assert "| teacher-forced tau | anchor mean |" in md and f"| {d['tau']:.3f} | {d['teacher_forced']['anchor_mean']:.3f} |" in md
    assert "Measured by: `python -m dflash_trt.training.evaluate --drafter D [--drafter D2] --num-prompts 12" in md
    report["command"] = "python -m dflash_trt.training.evaluate --drafter /x/d --max-tokens 40 --teacher-forced"
    write_report(report, tmp_path / "out")  # main() records the exact command it ran
    md = (tmp_path / "out" / "acceptance.md").read_text()
    assert f"Measured by: `{report['command']}`." in md


@pytest.mark.parametrize("text,msg", [
    (None, "no such file"),
    ('{"a": ["x",\n', "not valid JSON"),
    ('["a", "b"]', "expected a non-empty JSON object"),
    ("{}", "expected a non-empty JSON object"),
    ('{"mine": []}', "set 'mine' must be a non-empty list"),
    ('{"mine": "just a string"}', "set 'mine' must be a non-empty list"),
    ('{"mine": ["ok", 5]}', "set 'mine' item 1 is not a non-empty string: 5"),
    ('{"mine": ["ok", "  "]}', "set 'mine' item 1 is not a non-empty string"),
])
def test_bad_sets_files_are_one_line_usage_errors(tmp_path, capsys, text, msg):
    """A bad --sets-file stops before any model loads, exit 2, naming the file and the problem."""
    from dflash_trt.training.evaluate import main

    f = tmp_path / "sets.json"
    if text is not None:
        f.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["--sets-file", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and str(f) in err and "Traceback" not in err


def test_num_prompts_must_be_positive(capsys):
    from dflash_trt.training.evaluate import main

    with pytest.raises(SystemExit) as e:
        main(["--num-prompts", "0"])
    assert e.value.code == 2 and "--num-prompts must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--max-tokens", "-4"], "--max-tokens must be >= 1, got -4"),
    (["--block-size", "1"], "--block-size must be >= 2, got 1"),
    (["--block-size", "100"], "--block-size must be <= 64 (as generate and bench take it), got 100"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
])
def test_out_of_range_values_are_usage_errors(capsys, args, msg):
    """Checked before anything loads: exit 2 with argparse's usage and one error line."""
    from dflash_trt.training.evaluate import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1] == f"python -m dflash_trt.training.evaluate: error: {msg}"
    assert "Traceback" not in err


def test_bad_paths_and_devices_are_one_line_errors(tmp_path, capsys, target_with_tokenizer):
    """What the package refuses prints `error: ...` (exit 1), no traceback; the paths fail before any model loads."""
    from dflash_trt.training.evaluate import main

    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    cases = [
        (["--drafter", "nope"], "error: --drafter nope: no such folder; give the drafter folder"),
        (["--drafter", str(target_with_tokenizer)],
         f"error: --drafter {target_with_tokenizer}: this config.json is a LlamaForCausalLM model's, not a DFlash drafter's"),
        (["--device", "tpu"], "error: --device tpu: not a device dflash-trt runs on; use cpu, cuda or cuda:N"),
        (["--target", str(tmp_path / "none")], f"error: --target {tmp_path / 'none'}: no such folder"),
        (["--out", str(notes)], f"error: --out {notes}: this is a file, not a folder"),
        (["--cache", str(notes)], f"error: the cache {notes} is not an evaluate cache (not valid JSON ("),
    ]
    for args, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(args)
        out = capsys.readouterr()
        assert e.value.code == 1 and out.out == "" and out.err.startswith(msg) and out.err.count("\n") == 1, out.err
    assert notes.read_text() == "x"


def test_a_drafter_that_does_not_fit_the_target_is_refused_before_decoding(tmp_path, capsys, target_with_tokenizer):
    """The packaged SmolLM2 drafter against the tiny target: the compatibility problems, exit 1."""
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.training.evaluate import main

    sets = tmp_path / "sets.json"
    sets.write_text('{"tiny": ["w5 w6 w7"]}')
    with pytest.raises(SystemExit) as e:
        main(["--target", str(target_with_tokenizer), "--sets-file", str(sets)])
    out = capsys.readouterr()
    assert e.value.code == 1 and out.out == "" and "Traceback" not in out.err
    assert out.err.startswith(f"error: --drafter {default_drafter_path()}: drafter does not fit the target:")
    assert "evaluate: " not in out.err  # nothing was decoded


def test_help_names_the_module_and_shows_defaults(capsys, monkeypatch):
    from dflash_trt.training.evaluate import main

    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps to the terminal, and may break --sets-file at its hyphen

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert e.value.code == 0 and out.startswith("usage: python -m dflash_trt.training.evaluate [-h]")
    for text in ("--num-prompts NUM_PROMPTS prompts per set of the HumanEval / MT-Bench subsets (not used with "
                 "--sets-file; default: 40)",
                 "--max-tokens MAX_TOKENS most new tokens per prompt, >= 1 (default: 128)",
                 "--block-size BLOCK_SIZE draft block size, 2 to 64: block_size - 1 drafts per verify step (default: "
                 "each drafter's own)",
                 "--threads THREADS torch CPU threads (default: 1)",
                 "--device DEVICE cpu, cuda or cuda:N (float32 either way; TF32 stays off; default: cpu)"):
        assert text in out, text


def test_drafters_with_the_same_folder_name_keep_apart_and_a_repeat_runs_once(tmp_path, capsys, monkeypatch,
                                                                              target_with_tokenizer):
    """a/drafter and b/drafter are two drafters ("a/drafter", "b/drafter"; keyed by folder name, the second
    replaced the first and the paths were paired wrongly); ./a/drafter after a/drafter is measured once."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter
    from dflash_trt.training.evaluate import drafter_labels, main

    cfg = new_drafter_config(TargetConfig.from_pretrained(target_with_tokenizer), 1, 4, MASK, [0, 1])
    for i, name in enumerate("ab"):
        init_drafter(cfg, tmp_path / name / "drafter", seed=i)
    (tmp_path / "sets.json").write_text('{"tiny": ["w5 w6 w7", "w8 w9"]}')
    monkeypatch.chdir(tmp_path)
    report = main(["--target", str(target_with_tokenizer), "--drafter", "a/drafter", "--drafter", "b/drafter",
                   "--drafter", "./a/drafter", "--sets-file", "sets.json", "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert "warning: --drafter ./a/drafter is the same folder as --drafter a/drafter; it is measured once" in err
    assert report["drafters"] == {"a/drafter": "a/drafter", "b/drafter": "b/drafter"}
    assert list(report["sets"]["tiny"]["drafters"]) == ["a/drafter", "b/drafter"]
    assert err.count(": tiny: a/drafter: tau ") == 1 and err.count(": tiny: b/drafter: tau ") == 1
    assert drafter_labels(["x/d", "y/d", "y/e"]) == ["x/d", "y/d", "e"] and drafter_labels(["/p/a/d", "/a/d"]) == [
        "p/a/d", "/a/d"]


def test_a_target_without_a_chat_template_is_measured_on_plain_text_and_the_report_says_so(tmp_path, capsys,
                                                                                           target_with_tokenizer):
    """acceptance.md said "Prompts (chat template)" for a target without one, whose prompts were fed as plain
    text without a word; now a warning says so and the report names the format used."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter
    from dflash_trt.training.evaluate import main

    init_drafter(new_drafter_config(TargetConfig.from_pretrained(target_with_tokenizer), 1, 4, MASK, [0, 1]),
                 tmp_path / "d")
    (tmp_path / "sets.json").write_text('{"tiny": ["w5 w6 w7"]}')
    report = main(["--target", str(target_with_tokenizer), "--drafter", str(tmp_path / "d"), "--sets-file",
                   str(tmp_path / "sets.json"), "--max-tokens", "4", "--out", str(tmp_path / "out"), "--untrained"])
    err = capsys.readouterr().err
    # every drafter measured is listed, --untrained's without a folder (it was missing from the map)
    assert report["drafters"] == {"d": str(tmp_path / "d"), "untrained (random, seed 0)": None}
    assert list(report["sets"]["tiny"]["drafters"]) == list(report["drafters"])
    assert (f"warning: the target at {target_with_tokenizer} has no chat template: the prompts are fed as plain text "
            "(as train-drafter feeds them to such a target); the report says so\n") in err, err
    assert report["prompt_format"] == "plain text: the target has no chat template"
    md = (tmp_path / "out" / "acceptance.md").read_text()
    assert "Prompts (plain text: the target has no chat template): the sets of `sets.json` (tiny)." in md, md
    assert "chat template)" not in md.replace("no chat template)", "")


def test_the_cache_keeps_each_targets_results_apart(tmp_path, capsys, target_with_tokenizer):
    """Another target with the same tokenizer (a fine-tuned copy) and the same --out: its AR references and
    the drafter's tau were read from the first target's cache, nothing decoded, the first target's figures
    reported as its own; now each target decodes its own, and a rerun on either reads its own from the cache."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter
    from dflash_trt.models.loading import safetensors_files
    from dflash_trt.training.evaluate import main

    other = tmp_path / "tuned"
    shutil.copytree(target_with_tokenizer, other)
    weights = safetensors_files(other)[0]
    state = load_file(weights)
    state = {k: v * 1.5 if ".mlp." in k else v for k, v in state.items()}  # same shapes and header, other values
    save_file(state, weights, metadata={"format": "pt"})
    init_drafter(new_drafter_config(TargetConfig.from_pretrained(target_with_tokenizer), 1, 4, MASK, [0, 1]),
                 tmp_path / "d")
    (tmp_path / "sets.json").write_text('{"tiny": ["w5 w6 w7", "w8 w9"]}')
    common = ["--drafter", str(tmp_path / "d"), "--sets-file", str(tmp_path / "sets.json"), "--max-tokens", "6",
              "--out", str(tmp_path / "out")]
    decoded = {}
    for target in (target_with_tokenizer, other, target_with_tokenizer, other):
        report = main(["--target", str(target), *common])
        err = capsys.readouterr().err
        first = str(target) not in decoded
        assert ("evaluate: tiny: autoregressive reference, 2 prompts" in err) == first, err
        ar = report["sets"]["tiny"]["ar_tokens"], report["sets"]["tiny"]["drafters"]["d"]
        assert decoded.setdefault(str(target), ar) == ar  # a rerun: the same figures, from the cache
    cache = __import__("json").loads((tmp_path / "out" / "eval_cache.json").read_text())
    assert len(cache) == 4  # per target: its AR references and the drafter's results


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_is_one_line_and_exits_130_or_143(tmp_path, capsys, monkeypatch, target_with_tokenizer,
                                                            signal_name):
    """SIGTERM (kill, timeout, Slurm) ended evaluate at once, without a word (exit 143 from the signal itself);
    now it stops as Ctrl-C does: one line saying how, where the finished decodes are cached, exit 143 / 130."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.interrupts import Terminated
    from dflash_trt.models.checkpoints import init_drafter
    from dflash_trt.training import evaluate as ev

    init_drafter(new_drafter_config(TargetConfig.from_pretrained(target_with_tokenizer), 1, 4, MASK, [0, 1]),
                 tmp_path / "d")
    (tmp_path / "sets.json").write_text('{"tiny": ["w5 w6 w7"]}')

    def stopped(*args, **kwargs):
        raise Terminated if signal_name == "SIGTERM" else KeyboardInterrupt

    monkeypatch.setattr(ev, "evaluate", stopped)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        ev.main(["--target", str(target_with_tokenizer), "--drafter", str(tmp_path / "d"), "--sets-file",
                 str(tmp_path / "sets.json"), "--max-tokens", "4", "--out", str(out)])
    err = capsys.readouterr().err
    how, code = ("terminated (SIGTERM)", 143) if signal_name == "SIGTERM" else ("interrupted (Ctrl-C)", 130)
    assert e.value.code == code and "Traceback" not in err
    assert err.splitlines()[-1] == (f"evaluate {how}; decodes finished so far are cached in {out / 'eval_cache.json'}; "
                                    f"an earlier report in {out} is unchanged")


def test_dump_sets_says_what_it_wrote_and_when_the_sets_run_short(tmp_path, capsys):
    """--dump-sets names the file and the prompts it wrote; --num-prompts above a set's size is noted (HumanEval
    has 164, MT-Bench 80: all of them are used), not silently capped."""
    import json

    from dflash_trt.training.evaluate import main

    out = tmp_path / "sets.json"
    assert main(["--dump-sets", str(out), "--num-prompts", "100"]) == {}
    sets = json.loads(out.read_text())
    assert (len(sets["humaneval"]), len(sets["mtbench"])) == (100, 80)
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: --num-prompts 100: mtbench has 80 prompts, all of them used",
                   f"wrote 100 humaneval, 80 mtbench prompts to {out}"]
