"""`dflash-trt train-drafter` end to end on a tiny target, and its errors on bad inputs."""

import json

import pytest
import torch
from click.testing import CliRunner

from tests.training.conftest import EOS, MASK, VOCAB
from dflash_trt.cli import cli
from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.models.checkpoints import load_drafter


def _prompts(tmp_path, n=16):
    gen = torch.Generator().manual_seed(3)
    f = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": " ".join(f"w{int(t)}" for t in torch.randint(4, VOCAB, (6,), generator=gen))})
             for _ in range(n)]
    f.write_text("\n".join(lines) + "\n")
    return f


def _run(args):
    return CliRunner().invoke(cli, ["train-drafter", *args], catch_exceptions=True)


def test_train_drafter_end_to_end(tmp_path, target_with_tokenizer):
    out = tmp_path / "drafter"
    args = ["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(_prompts(tmp_path)),
            "--num-layers", "1", "--block-size", "4", "--epochs", "2", "--target-layer-ids", "0,1",
            "--max-new-tokens", "16", "--draft-vocab-size", "32", "--mask-token-id", str(MASK), "--anchors", "4",
            "--init", "random", "--gen-batch-size", "8"]
    res = _run(args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "loss.png", "model.safetensors",
                                                     "training.json"]
    info = json.loads((out / "training.json").read_text())
    assert info["data"]["samples"] == 16 and info["steps"] == 8 and info["draft_vocab"]["size"] == 32
    assert "(8 steps on 16 target-written samples;" in (out / "README.md").read_text()
    drafter = load_drafter(out)
    assert drafter.config.draft_vocab_size == 32 and drafter.config.trained
    assert not list(tmp_path.glob(".drafter.tmp-*"))
    # rerun: the data cache is reused, the finished run needs --resume and then exports again
    for extra in ([], ["--force"]):  # its --out exists, and so does the finished run's checkpoint: named first (it
        res = _run(args + extra)     # offered --force, which then failed on the checkpoint)
        assert isinstance(res.exception, ConfigError) and str(res.exception).startswith(
            f"{tmp_path / 'drafter.work' / 'run'} already holds a training checkpoint; pass --resume to continue it"), \
            repr(res.exception)
    res = _run(args + ["--resume"])
    assert res.exit_code == 0, repr(res.exception)
    assert load_drafter(out).state_dict()["fc.weight"].equal(drafter.state_dict()["fc.weight"])


def test_resume_needs_a_checkpoint_and_the_data_cache_is_reused_without_it(tmp_path, target_with_tokenizer):
    out, work = tmp_path / "drafter", tmp_path / "work"
    args = ["--target", str(target_with_tokenizer), "--out", str(out), "--work-dir", str(work), "--prompts",
            str(_prompts(tmp_path, 8)), "--num-layers", "1", "--block-size", "4", "--epochs", "1",
            "--target-layer-ids", "0,1", "--max-new-tokens", "8", "--mask-token-id", str(MASK), "--init", "random"]
    res = _run(args + ["--data-only", "--resume"])  # --resume is about training: no effect here
    assert res.exit_code == 0, repr(res.exception)
    shards = {p.name: p.stat().st_mtime_ns for p in (work / "data").glob("shard-*.pt")}
    res = _run(args + ["--resume"])
    assert isinstance(res.exception, ConfigError) and "nothing to resume" in str(res.exception)
    assert not (work / "run").exists() and not out.exists()
    res = _run(args)
    assert res.exit_code == 0, repr(res.exception)
    assert {p.name: p.stat().st_mtime_ns for p in (work / "data").glob("shard-*.pt")} == shards  # not regenerated
    assert json.loads((out / "training.json").read_text())["data"]["samples"] == 8


def test_max_samples_is_exact(tmp_path, target_with_tokenizer):
    args = ["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
            str(_prompts(tmp_path, 8)), "--target-layer-ids", "0,1", "--max-new-tokens", "4", "--mask-token-id",
            str(MASK), "--gen-batch-size", "4", "--data-only"]
    res = _run(args + ["--max-samples", "7"])
    assert res.exit_code == 0 and "data: 7 samples" in res.stdout, res.output + repr(res.exception)
    res = _run(args + ["--max-samples", "9"])
    assert res.exit_code == 0 and "data: 8 samples" in res.stdout, res.output + repr(res.exception)
    assert "warning: --max-samples 9 is more than the 8 prompts; using all 8" in res.stderr
    assert "--draft-vocab-size" not in res.stderr  # the default 8192 > this target's 64 tokens: no word
    (tmp_path / "one").mkdir()
    one = ["--prompts", str(_prompts(tmp_path / "one", 1)), "--work-dir", str(tmp_path / "work1")]
    res = _run(args + one + ["--max-samples", "3"])  # one prompt (the last --prompts counts): singular words
    assert res.exit_code == 0 and "data: 1 sample, " in res.stdout, res.output + repr(res.exception)
    assert "warning: --max-samples 3 is more than the 1 prompt; using it\n" in res.stderr, res.stderr
    res = _run(args + ["--draft-vocab-size", "64"])
    assert res.exit_code == 0 and ("warning: --draft-vocab-size 64 is not below the target's vocabulary (64 tokens); "
                                   "the drafter predicts over the full vocabulary") in res.stderr, res.output


def test_max_samples_is_a_nested_subset_that_seed_does_not_change(tmp_path, target_with_tokenizer):
    """--max-samples takes whole similar-length batches in a fixed shuffled order (not the file's first
    N prompts), whatever --seed: a larger N keeps a smaller N's prompts in the same order and reuses
    their cached responses, and the same N with another seed rewrites nothing; --help says so."""
    from dflash_trt.training.datagen import load_shards

    work = tmp_path / "work"
    args = ["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--work-dir", str(work),
            "--prompts", str(_prompts(tmp_path, 16)), "--target-layer-ids", "0,1", "--max-new-tokens", "4",
            "--mask-token-id", str(MASK), "--gen-batch-size", "4", "--data-only"]

    def data(n, seed):
        res = _run(args + ["--max-samples", str(n), "--seed", str(seed)])
        assert res.exit_code == 0 and f"data: {n} samples" in res.stdout, res.output + repr(res.exception)
        shards = {p.name: p.stat().st_mtime_ns for p in (work / "data").glob("shard-*.pt")}
        return [s["index"] for s in load_shards(work / "data")], shards

    six, shards6 = data(6, 0)
    assert sorted(six) != list(range(6)) and len(set(six)) == 6  # not the first 6 lines
    ten, shards10 = data(10, 7)
    assert ten[:6] == six and len(set(ten)) == 10
    assert sorted(shards10) == ["shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    assert shards10["shard-00000.pt"] == shards6["shard-00000.pt"]  # a full batch: its responses reused
    assert data(6, 3) == (six, shards10)  # another seed: the same prompts, nothing regenerated
    assert data(10, 0) == (ten, shards10)
    res = CliRunner().invoke(cli, ["train-drafter", "--help"])
    text = " ".join(res.output.split())
    assert ("in a fixed shuffled order, the last one cut to fit. The order does not depend on --seed, and a larger N "
            "keeps every prompt of a smaller one, so the data cache's responses are reused.") in text, text
    assert "split (not of the --max-samples prompts)" in text


@pytest.mark.parametrize("content,extra,err,msg", [
    ("", [], DFlashError, "empty"),
    ("{not json\n", [], ConfigError, "not valid JSON"),
    ('{"messages": [{"role": "user", "content": "w5 w6"}]}\n', [], ConfigError, "no chat template"),
    ('{"prompt": "w5 w6"}\n\n{"messages": [{"role": "user", "content": "w5"}]}\n', [], ConfigError,
     'p.jsonl:3: the target at '),  # the first conversation's line, before any generation
    ('{"prompt": "w5 w6"}\n', ["--target-layer-ids", "0,4"], ConfigError, "outside [0, 3]"),
    ('{"prompt": "w5 w6"}\n', ["--target-layer-ids", "a,b"], ConfigError, "comma-separated integers"),
    ('{"prompt": "w5 w6"}\n', ["--target-layer-ids", "1,0,1"], ConfigError, "[1] given more than once"),
    ('{"prompt": "w5 w6"}\n', ["--target-layer-ids", "2,0"], ConfigError, "give them in increasing order (0,2)"),
    ('{"prompt": "w5 w6"}\n', ["--target-layer-ids", ""], ConfigError, "--target-layer-ids is empty"),
    ('{"prompt": "w5 w6"}\n', ["--target-layer-ids", "0,,2"], ConfigError, "'0,,2' has an empty entry"),
    ('{"prompt": "w5 w6"}\n', ["--target-layer-ids", "3,"], ConfigError, "'3,' has an empty entry"),
])
def test_bad_inputs_fail_cleanly(tmp_path, target_with_tokenizer, content, extra, err, msg):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    out = tmp_path / "drafter"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(f),
                "--mask-token-id", str(MASK), "--work-dir", str(tmp_path / "work"), *extra])
    assert isinstance(res.exception, err) and msg in str(res.exception), repr(res.exception)
    assert not out.exists()
    assert not (tmp_path / "work" / "run").exists()


@pytest.mark.parametrize("max_steps, checkpoint_every, inf_update, what", [
    ("3", "100", False, "its loss is nan"),  # --lr 1e30 makes the weights huge: the next step's loss is NaN
    ("1", "1", True, "its update left non-finite values in hidden_norm.weight"),  # an overflowing update, at a checkpoint
])
def test_a_diverging_run_stops_with_an_error_and_exports_nothing(tmp_path, target_with_tokenizer, monkeypatch,
                                                                   max_steps, checkpoint_every, inf_update, what):
    """A loss or weights that stop being finite (a far too high --lr) end the run with the error naming the step and
    --lr: no drafter exported (one was written with NaN weights, exit 0, that generate then refused), no checkpoint
    of those weights."""
    from dflash_trt.errors import DFlashError

    lr = "1e30"
    if inf_update:  # float32 overflow in an update whose loss was finite (caught before the checkpoint is saved)
        step = torch.optim.AdamW.step

        def overflowing(self, *a, **k):
            out = step(self, *a, **k)
            with torch.no_grad():
                self.param_groups[0]["params"][1].fill_(float("inf"))
            return out

        monkeypatch.setattr(torch.optim.AdamW, "step", overflowing)

    out, work = tmp_path / "drafter", tmp_path / "work"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(_prompts(tmp_path, 8)),
                "--num-layers", "1", "--block-size", "4", "--epochs", "4", "--target-layer-ids", "0,1",
                "--max-new-tokens", "12", "--mask-token-id", str(MASK), "--init", "random", "--lr", lr,
                "--max-steps", max_steps, "--checkpoint-every", checkpoint_every, "--work-dir", str(work)])
    assert isinstance(res.exception, DFlashError), res.output + repr(res.exception)
    message = str(res.exception)
    assert message.startswith("training diverged at step ") and what in message, message
    assert f"(--lr {float(lr):g} is likely too high for this data); nothing of that step was saved and no drafter " \
           "was exported (no checkpoint was written); rerun with a lower --lr" in message
    assert not out.exists() and not (work / "run" / "checkpoint.pt").exists()


def test_max_steps_exports_a_stopped_run(tmp_path, target_with_tokenizer):
    out = tmp_path / "drafter"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(_prompts(tmp_path, 8)),
                "--num-layers", "1", "--block-size", "4", "--epochs", "4", "--target-layer-ids", "0,1",
                "--max-new-tokens", "12", "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "3",
                "--attention", "sdpa"])
    assert res.exit_code == 0, repr(res.exception)
    info = json.loads((out / "training.json").read_text())
    assert (info["steps"], info["total_steps"], info["finished"]) == (3, 8, False)
    assert info["train_config"]["attention"] == "sdpa"
    assert oct((out).stat().st_mode & 0o777) == "0o755"


@pytest.mark.parametrize("flag,value,msg", [
    ("--gamma", "nan", "nan is not a finite number"), ("--soft-weight", "nan", "nan is not a finite number"),
    ("--epochs", "nan", "nan is not a finite number"), ("--epochs", "inf", "inf is not a finite number"),
    ("--lr", "nan", "nan is not a finite number"), ("--lr", "-1", "not in the range 0<=x<=3.4028234663852886e+38"),
    ("--lr", "1e39", "1e+39 is not in the range 0<=x<=3.4028234663852886e+38"),
    ("--time-limit-min", "-1", "not in the range x>0"), ("--time-limit-min", "0", "not in the range x>0"),
    ("--time-limit-min", "nan", "nan is not a finite number"), ("--time-limit-min", "inf", "inf is not a finite number"),
    ("--train-minutes", "inf", "inf is not a finite number"), ("--train-minutes", "nan", "nan is not a finite number"),
])
def test_non_finite_or_out_of_range_numbers_are_usage_errors(tmp_path, target_with_tokenizer, flag, value, msg):
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
                str(_prompts(tmp_path, 4)), "--work-dir", str(tmp_path / "work"), flag, value])
    assert res.exit_code == 2 and msg in res.output, res.output
    assert not (tmp_path / "work").exists() and not (tmp_path / "d").exists()


@pytest.mark.parametrize("flag,value,msg", [
    ("--mask-token-id", "-1", "Invalid value for '--mask-token-id': -1 is outside the target's vocabulary [0, 64); give "
     "a reserved token id of its tokenizer (default: 63, the last vocab row)"),  # it crashed in the tokenizer
    ("--mask-token-id", "64", "Invalid value for '--mask-token-id': 64 is outside the target's vocabulary [0, 64)"),
    ("--draft-vocab-size", "1", "Invalid value for '--draft-vocab-size': 1 is too small: the draft vocabulary always "
     f"holds the target's 1 stop token ({EOS}) and at least one other token; give 2 or more, or 0 for the full "
     "vocabulary"),  # a ValueError traceback once the data was generated
])
def test_a_mask_id_or_draft_vocabulary_that_cannot_work_is_refused_before_any_data(tmp_path, target_with_tokenizer,
                                                                                  flag, value, msg):
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
                str(_prompts(tmp_path, 4)), "--work-dir", str(tmp_path / "work"), "--target-layer-ids", "0,1",
                *(["--mask-token-id", str(MASK)] if flag != "--mask-token-id" else []), flag, value])
    assert res.exit_code == 2 and msg in " ".join(res.output.split()), res.output
    assert not (tmp_path / "work" / "data").exists() and not (tmp_path / "d").exists()


def test_val_samples_are_checked_before_any_data_is_written(tmp_path, target_with_tokenizer):
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
                str(_prompts(tmp_path, 6)), "--work-dir", str(tmp_path / "work"), "--mask-token-id", str(MASK),
                "--val-samples", "6"])
    assert res.exit_code == 2 and "--val-samples 6 leaves nothing to train on (6 prompts)" in res.output, res.output
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
                str(_prompts(tmp_path, 6)), "--work-dir", str(tmp_path / "work"), "--mask-token-id", str(MASK),
                "--max-samples", "1", "--val-samples", "1"])
    assert res.exit_code == 2 and "--val-samples 1 leaves nothing to train on (1 prompt);" in res.output, res.output
    assert not (tmp_path / "work").exists() and not (tmp_path / "d").exists()


def test_gamma_sets_the_loss_decay(tmp_path, target_with_tokenizer):
    prompts = _prompts(tmp_path, 8)

    def run(name, *extra):
        out = tmp_path / name
        res = _run(["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(prompts),
                    "--work-dir", str(tmp_path / "work" / name), "--num-layers", "1", "--block-size", "4",
                    "--epochs", "1", "--target-layer-ids", "0,1", "--max-new-tokens", "12", "--mask-token-id",
                    str(MASK), "--init", "random", "--soft-weight", "0", *extra])
        assert res.exit_code == 0, res.output + repr(res.exception)
        return json.loads((out / "training.json").read_text())

    default, sharp = run("default"), run("sharp", "--gamma", "0.5")
    assert default["train_config"]["gamma"] is None and sharp["train_config"]["gamma"] == 0.5
    # same data, anchors and init (2 steps): only the position weights differ, and so does the loss
    assert default["history"][0]["hard_ce"] != pytest.approx(sharp["history"][0]["hard_ce"], rel=1e-6)
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "x"), "--gamma", "0"])
    assert res.exit_code == 2 and "--gamma" in res.output


def test_val_samples_and_keep_best(tmp_path, target_with_tokenizer):
    from safetensors.torch import load_file

    from dflash_trt.training.trainer import BEST

    out, work = tmp_path / "drafter", tmp_path / "work"
    base = ["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(_prompts(tmp_path)),
            "--work-dir", str(work), "--num-layers", "1", "--block-size", "4", "--epochs", "3",
            "--target-layer-ids", "0,1", "--max-new-tokens", "12", "--mask-token-id", str(MASK), "--init", "random",
            "--checkpoint-every", "3", "--val-samples", "4", "--lr", "3e-3"]
    res = _run(base + ["--keep-best"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    info = json.loads((out / "training.json").read_text())
    v = info["validation"]
    assert v["samples"] == 4 and info["steps"] == 9  # 12 of the 16 samples train: 3 epochs x 12 / 4 per step
    assert [h["step"] for h in v["history"]] == [0, 3, 6, 9]
    accs = [h["acceptance_length"] for h in v["history"]]
    assert v["best_acceptance_length"] == max(accs) and info["exported_step"] == v["best_step"]
    assert v["best_step"] < 9  # in this run the best is not the last, so the export comes from best.pt
    # the rule (ties, e.g. a short run that stays at tau 1.0, go to the lower held-out cross-entropy)
    assert v["best_step"] == max(v["history"], key=lambda h: (h["acceptance_length"], -h["hard_ce"]))["step"]
    assert f"best {max(accs):.3f} at step {v['best_step']}" in res.output
    last = info["history"][-1]
    assert last["step"] == 9 and f"training loss {last['loss']:.3f} (mean over the log window ending at step 9)" in res.output
    readme = (out / "README.md").read_text()
    assert "9 steps on 12 training + 4 held-out target-written samples" in readme
    assert f"weights are those of step {v['best_step']} of 9, the best held-out tau ({max(accs):.3f})" in readme
    assert ("the weights training started from" in readme) == (v["best_step"] == 0)
    best = torch.load(work / "run" / BEST, weights_only=True)["drafter"]
    exported = load_file(out / "model.safetensors")
    assert all(torch.equal(exported[k], best[k]) for k in exported)  # float32 export of the best weights
    res = _run(base[:-4] + ["--keep-best"])
    assert res.exit_code == 2 and "--keep-best needs --val-samples" in res.output


def test_online_features_train_like_cached_ones(tmp_path, target_with_tokenizer):
    """--online-features caches tokens only; training on features computed per step reaches the
    same result as training on the bfloat16 feature cache, up to that cache's rounding."""
    prompts = _prompts(tmp_path, 8)
    common = ["--target", str(target_with_tokenizer), "--prompts", str(prompts), "--num-layers", "1",
              "--block-size", "4", "--epochs", "2", "--target-layer-ids", "0,1", "--max-new-tokens", "12",
              "--mask-token-id", str(MASK), "--init", "target", "--anchors", "4", "--draft-vocab-size", "32"]
    res = _run([*common, "--out", str(tmp_path / "cached")])
    assert res.exit_code == 0, repr(res.exception)
    res = _run([*common, "--out", str(tmp_path / "online"), "--online-features"])
    assert res.exit_code == 0, repr(res.exception)
    shard = torch.load(next((tmp_path / "online.work" / "data").glob("shard-*.pt")), weights_only=True)
    assert "features" not in shard[0] and shard[0]["tokens"].dtype == torch.int32
    cached = json.loads((tmp_path / "cached" / "training.json").read_text())
    online = json.loads((tmp_path / "online" / "training.json").read_text())
    assert online["features"] == "online" and cached["features"] == "cached (bfloat16)"
    assert online["steps"] == cached["steps"] == 4
    assert online["final_loss"] == pytest.approx(cached["final_loss"], rel=0.02)
    a, b = load_drafter(tmp_path / "cached").state_dict(), load_drafter(tmp_path / "online").state_dict()
    assert a["d2t"].equal(b["d2t"])
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=5e-3, rtol=5e-2)


def test_cuda_device_without_gpu_is_a_clear_error(tmp_path, target_with_tokenizer):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
                str(_prompts(tmp_path, 2)), "--mask-token-id", str(MASK), "--device", "cuda"])
    assert isinstance(res.exception, ConfigError) and "no CUDA GPU" in str(res.exception)
    assert not (tmp_path / "d").exists()


def test_init_from_a_drafter_fine_tunes_it(tmp_path, target_with_tokenizer):
    """--init DIR starts from a trained drafter: its shape, mask token, target layers and draft
    vocabulary are kept; with lr 0 the export equals it bit for bit; a fine-tune continues from its
    loss instead of starting over; a conflicting shape flag or a bad --init is one error."""
    prompts = _prompts(tmp_path, 8)
    base = ["--target", str(target_with_tokenizer), "--prompts", str(prompts), "--max-new-tokens", "12",
            "--anchors", "4", "--epochs", "10"]
    first = tmp_path / "first"
    res = _run([*base, "--out", str(first), "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "0,1",
                "--mask-token-id", str(MASK), "--draft-vocab-size", "32", "--init", "random"])
    assert res.exit_code == 0, repr(res.exception)
    a = load_drafter(first)

    same = tmp_path / "same"
    res = _run([*base, "--out", str(same), "--init", str(first), "--lr", "0", "--max-steps", "1"])
    assert res.exit_code == 0, repr(res.exception)
    b = load_drafter(same)
    assert b.config == a.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(sa[k].equal(sb[k]) for k in sa)
    lineage = json.loads((same / "training.json").read_text())["init"]
    parent = json.loads((first / "training.json").read_text())
    assert lineage["mode"] == "drafter" and lineage["path"] == str(first)
    assert lineage["parent"] == {k: v for k, v in parent.items() if k != "history"}
    assert lineage["parent"]["init"]["mode"] == "random" and lineage["parent"]["steps"] == 20

    res = _run([*base, "--out", str(tmp_path / "tuned"), "--init", str(first), "--block-size", "4"])
    assert res.exit_code == 0, repr(res.exception)
    start = json.loads((first / "training.json").read_text())["history"]
    tuned = json.loads((tmp_path / "tuned" / "training.json").read_text())["history"]
    assert [h["step"] for h in tuned] == [h["step"] for h in start] == [10, 20]
    assert tuned[0]["loss"] < start[0]["loss"] and tuned[1]["loss"] < start[1]["loss"]  # a head start, kept

    res = _run([*base, "--out", str(tmp_path / "x"), "--init", str(first), "--block-size", "8"])
    assert isinstance(res.exception, ConfigError) and "--block-size 8 differs" in str(res.exception)
    res = _run([*base, "--out", str(tmp_path / "x"), "--init", str(first), "--draft-vocab-size", "0"])
    assert isinstance(res.exception, ConfigError) and str(res.exception).startswith(
        f"--draft-vocab-size 0 differs from the drafter being fine-tuned ({first}: 32)"), repr(res.exception)
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    full = init_drafter(new_drafter_config(TargetConfig.from_pretrained(target_with_tokenizer), 1, 4, MASK, [0, 1]),
                        tmp_path / "full")
    res = _run([*base, "--out", str(tmp_path / "x"), "--init", str(full), "--draft-vocab-size", "32"])
    assert isinstance(res.exception, ConfigError) and str(res.exception).startswith(  # it said "(FULL: None)"
        f"--draft-vocab-size 32 differs from the drafter being fine-tuned ({full}: the full vocabulary)"), \
        repr(res.exception)
    res = _run([*base, "--out", str(tmp_path / "x"), "--init", str(tmp_path / "nowhere")])
    assert isinstance(res.exception, ConfigError) and "no such folder" in str(res.exception)
    assert not (tmp_path / "x").exists()
    res = _run([*base, "--out", str(tmp_path / "x"), "--init", str(first / "config.json")])
    assert isinstance(res.exception, ConfigError) and "that is a file" in str(res.exception)
    assert not (tmp_path / "x").exists()


def test_init_from_a_speculators_drafter(tmp_path, target_with_tokenizer):
    """--init with a drafter in the vLLM speculators format fine-tunes the same network (lr 0: the export equals
    the z-lab original bit for bit, in the z-lab format); a copy of another model's lm_head rows is refused."""
    from dflash_trt.errors import IncompatibleModelsError
    from dflash_trt.models.loading import read_tensors, save_checkpoint
    from dflash_trt.training.export import speculators_copy

    base = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--max-new-tokens", "12",
            "--anchors", "4", "--epochs", "2"]
    first = tmp_path / "first"
    res = _run([*base, "--out", str(first), "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "0,1",
                "--mask-token-id", str(MASK), "--draft-vocab-size", "32", "--init", "random"])
    assert res.exit_code == 0, repr(res.exception)
    spec = speculators_copy(first, tmp_path / "spec", target_with_tokenizer)
    res = _run([*base, "--out", str(tmp_path / "same"), "--init", str(spec), "--lr", "0", "--max-steps", "1"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    a, b = load_drafter(first), load_drafter(tmp_path / "same")
    assert b.config == a.config and not b.target_copies
    assert all(v.equal(b.state_dict()[k]) for k, v in a.state_dict().items())
    assert "speculators_model_type" not in json.loads((tmp_path / "same" / "config.json").read_text())

    tensors = read_tensors(spec)
    tensors["lm_head.weight"] = torch.randn_like(tensors["lm_head.weight"])  # another model's rows
    save_checkpoint(spec, json.loads((spec / "config.json").read_text()), tensors)
    res = _run([*base, "--out", str(tmp_path / "x"), "--init", str(spec)])
    assert isinstance(res.exception, IncompatibleModelsError), repr(res.exception)
    assert str(res.exception).startswith(f"drafter {spec}: its 'lm_head.weight'") and not (tmp_path / "x").exists()


def test_a_target_given_as_init_names_the_flag(tmp_path, target_with_tokenizer):
    """--init with a target's folder: the fix names --init (train-drafter has no --drafter)."""
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
                str(_prompts(tmp_path, 4)), "--work-dir", str(tmp_path / "work"), "--init", str(target_with_tokenizer)])
    assert isinstance(res.exception, ConfigError) and str(res.exception).endswith(
        "not a DFlash drafter's (no dflash_config): give a DFlash drafter's folder as --init"), repr(res.exception)
    assert not (tmp_path / "d").exists()


def test_an_existing_out_is_refused_before_any_data_is_written(tmp_path, target_with_tokenizer):
    """An existing --out folder needs --force (it used to be replaced without a word), a file and a folder
    that is not a drafter's are never replaced; all are refused before the target writes any data, and
    nothing of theirs changes."""
    folder, file, work = tmp_path / "precious", tmp_path / "notes.jsonl", tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    file.write_text("keep me too")
    args = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--work-dir", str(work),
            "--num-layers", "1", "--block-size", "4", "--epochs", "1", "--target-layer-ids", "0,1",
            "--max-new-tokens", "8", "--mask-token-id", str(MASK), "--init", "random"]
    res = _run(args + ["--out", str(folder)])
    assert isinstance(res.exception, ConfigError) and f"--out {folder} already exists" in str(res.exception)
    assert "--force" in str(res.exception)
    res = _run(args + ["--out", str(file), "--force"])
    assert isinstance(res.exception, ConfigError) and f"--out {file} is a file" in str(res.exception)
    assert not work.exists() and (folder / "notes.txt").read_text() == "keep me" and file.read_text() == "keep me too"
    res = _run(args + ["--out", str(folder), "--force"])  # a user's folder: --force replaces only a drafter folder
    assert isinstance(res.exception, ConfigError) and f"--out {folder} is a folder that is not a DFlash drafter" in str(
        res.exception) and "so nothing else is lost" in str(res.exception)
    assert not work.exists() and (folder / "notes.txt").read_text() == "keep me"
    (folder / "notes.txt").unlink()  # an empty folder is replaced
    res = _run(args + ["--out", str(folder), "--force", "--max-steps", "1"])  # stops before the first log
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "loss.png", "model.safetensors",
                                                        "training.json"]


def test_a_run_stopped_before_its_first_log_exports_that_step_and_says_so_coherently(tmp_path, target_with_tokenizer):
    """--max-steps 1 (the first log is at step 10) wrote no loss.png, said "no training loss logged" and "weights of
    step 1 of 1; UNFINISHED: the schedule has 3 steps"; now the open log window is exported as the last record
    (training.json, a one-point loss.png, the loss in the message), while the checkpoint's history stays the run's
    own (a resumed run logs as an uninterrupted one)."""
    out = tmp_path / "d"
    res = _run(["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--out", str(out),
                "--num-layers", "1", "--block-size", "4", "--epochs", "1", "--target-layer-ids", "0,1",
                "--max-new-tokens", "8", "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "1"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert (out / "loss.png").stat().st_size > 0
    info = json.loads((out / "training.json").read_text())
    [rec] = info["history"]
    assert (rec["step"], info["steps"], info["total_steps"], info["finished"]) == (1, 1, 2, False)
    assert info["final_loss"] == rec["loss"] > 0 and rec["lr"] > 0
    assert (f"(weights of step 1; UNFINISHED: stopped at step 1 of the schedule's 2 (training.json: finished false; "
            f"--resume trains on), training loss {rec['loss']:.3f} (mean over the log window ending at step 1)") \
        in res.output, res.output
    assert torch.load(tmp_path / "d.work" / "run" / "checkpoint.pt", weights_only=False)["state"]["history"] == []



def test_resume_reexports_only_its_own_export_and_stops_at_max_steps(tmp_path, target_with_tokenizer):
    """--resume may replace the --out its own run exported (training.json names the work dir), not
    another drafter folder; a run resumed at its --max-steps trains no further step (it trained one
    more per rerun), and one resumed past it says so ("weights of step 2 of 2" read as if it had trained)."""
    import shutil

    out, work = tmp_path / "d", tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--work-dir", str(work),
            "--num-layers", "1", "--block-size", "4", "--epochs", "2", "--target-layer-ids", "0,1",
            "--max-new-tokens", "8", "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "2"]
    res = _run(args + ["--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    info = json.loads((out / "training.json").read_text())
    assert (info["steps"], info["work_dir"]) == (2, str(work.resolve()))
    weights = (out / "model.safetensors").read_bytes()
    res = _run(args + ["--out", str(out), "--resume"])
    # stopped by --max-steps before the end of its schedule: said ("step 2 of 2" read as a complete run)
    assert res.exit_code == 0 and ("(weights of step 2; UNFINISHED: stopped at step 2 of the schedule's 4 (training.json: "
                                   "finished false; --resume trains on),") in res.output, res.output + repr(res.exception)
    assert json.loads((out / "training.json").read_text())["steps"] == 2
    assert ("UNFINISHED: the run stopped at step 2 of its 4-step schedule (a time limit or --max-steps); "
            "`train-drafter ... --resume` trains on.") in (out / "README.md").read_text()
    from dflash_trt.compat import WARNING, check_checkpoints

    assert [f.message for f in check_checkpoints(target_with_tokenizer, out) if f.level == WARNING
            and f.message.startswith("unfinished:")] == [
        "unfinished: the drafter's training.json says its run stopped at step 2 of 4 (a time limit or --max-steps); "
        "acceptance may be low: continue it with dflash-trt train-drafter ... --resume"]
    assert (out / "model.safetensors").read_bytes() == weights
    res = _run(args + ["--out", str(out), "--resume", "--max-steps", "1"])  # the last --max-steps counts
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert (f"(the checkpoint in {work / 'run'} is already past --max-steps (step 2 > 1), so no step was trained; "
            "exported: the weights of step 2, ") in res.output, res.output
    assert (out / "model.safetensors").read_bytes() == weights
    other = tmp_path / "other"
    shutil.copytree(out, other)
    (other / "NOTES.txt").write_text("keep me")
    (other / "training.json").write_text(json.dumps({**info, "work_dir": str(tmp_path / "elsewhere")}))
    res = _run(args + ["--out", str(other), "--resume"])
    assert isinstance(res.exception, ConfigError) and f"--out {other} already exists" in str(res.exception)
    assert (other / "NOTES.txt").read_text() == "keep me"


@pytest.mark.parametrize("online", [False, True], ids=["cached", "online"])
def test_resume_with_other_target_layer_ids_names_the_flag_and_both_values(tmp_path, target_with_tokenizer, online):
    """--resume with another --target-layer-ids: one line naming the flag, the value the run was
    started with, the value given and the fix (exit 1), before the data cache (whose refusal would
    speak of the cache) and before the trainer (with online features, or the same number of
    layers, the drafter's shape does not tell them apart)."""
    out, work = tmp_path / "d", tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--work-dir", str(work),
            "--out", str(out), "--num-layers", "1", "--block-size", "4", "--epochs", "2", "--max-new-tokens", "8",
            "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "2",
            *(["--online-features"] if online else [])]
    res = _run(args + ["--target-layer-ids", "0,1"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    checkpoint = (work / "run" / "checkpoint.pt").read_bytes()
    res = _run(args + ["--target-layer-ids", "0,2", "--resume"])
    msg = str(res.exception)
    assert res.exit_code == 1 and isinstance(res.exception, ConfigError), repr(res.exception)
    assert msg == (f"--resume: --target-layer-ids 0,2 differs from the run being resumed in {work / 'run'} (started "
                   "with --target-layer-ids 0,1); rerun with --target-layer-ids 0,1 to continue it, or pass another "
                   "--work-dir (or --out, whose work dir OUT.work is the default) to start a new run")
    assert (work / "run" / "checkpoint.pt").read_bytes() == checkpoint
    res = _run(args + ["--target-layer-ids", "0,2", "--force"])  # without --resume: the checkpoint is refused first
    assert isinstance(res.exception, ConfigError) and "already holds a training checkpoint" in str(res.exception)
    if not online:  # without a checkpoint the data cache refuses other layers, naming the flag and both sets
        (work / "run" / "checkpoint.pt").unlink()
        res = _run(args + ["--target-layer-ids", "0,2", "--force"])
        assert isinstance(res.exception, DFlashError) and (
            "(layer_ids (--target-layer-ids, plus the last layer; none with --online-features) [0, 1, 3] -> "
            "[0, 2, 3]); rerun with the settings it was made with") in str(res.exception), repr(res.exception)
        (work / "run" / "checkpoint.pt").write_bytes(checkpoint)
    res = _run(args + ["--target-layer-ids", "0,1", "--resume"])  # the original value resumes
    assert res.exit_code == 0, res.output + repr(res.exception)



def test_resume_with_another_mask_token_id_is_refused(tmp_path, target_with_tokenizer):
    """--resume with another --mask-token-id: refused naming the flag and both ids (the drafter's shape does not
    show it, so it exported the weights trained on mask 3 under a config saying 5: silently worse drafts)."""
    out, work = tmp_path / "d", tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--work-dir", str(work),
            "--out", str(out), "--num-layers", "1", "--block-size", "4", "--epochs", "2", "--max-new-tokens", "8",
            "--target-layer-ids", "0,1", "--init", "random", "--max-steps", "2"]
    res = _run(args + ["--mask-token-id", str(MASK)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    weights = (out / "model.safetensors").read_bytes()
    res = _run(args + ["--mask-token-id", "5", "--resume"])
    assert res.exit_code == 1 and isinstance(res.exception, DFlashError), res.output + repr(res.exception)
    assert str(res.exception) == (
        f"{work / 'run' / 'checkpoint.pt'} was made with other training settings or data (mask token id "
        f"(--mask-token-id) {MASK} -> 5); resume with the settings it was started with, or remove it to start over")
    assert (out / "model.safetensors").read_bytes() == weights
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"] == MASK
    res = _run(args + ["--mask-token-id", str(MASK), "--resume"])
    assert res.exit_code == 0, res.output + repr(res.exception)


def test_resume_with_other_flags_or_samples_is_refused_before_the_data_step(tmp_path, target_with_tokenizer,
                                                                            monkeypatch):
    """--resume with another --lr or --max-samples: refused naming each, before any data is generated or loaded
    (--max-samples 12 generated the 4 new samples first, and --lr waited for the data too: a long wait on a real
    corpus); the original flags still resume."""
    import dflash_trt.training.pipeline

    out, work = tmp_path / "d", tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 16)), "--work-dir", str(work),
            "--out", str(out), "--num-layers", "1", "--block-size", "4", "--epochs", "2", "--max-new-tokens", "8",
            "--target-layer-ids", "0,1", "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "2",
            "--max-samples", "8"]
    res = _run(args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    real_build = dflash_trt.training.pipeline.build_data

    def no_data_step(*a, **k):
        raise AssertionError("the data step ran")

    monkeypatch.setattr(dflash_trt.training.pipeline, "build_data", no_data_step)
    res = _run([*args[:-1], "12", "--lr", "0.001", "--resume"])
    assert res.exit_code == 1 and isinstance(res.exception, DFlashError), res.output + repr(res.exception)
    assert str(res.exception) == (
        f"{work / 'run' / 'checkpoint.pt'} was made with other training settings or data (lr (--lr) 0.0006 -> 0.001; "
        "samples 8 -> 12); resume with the settings it was started with, or remove it to start over")
    res = _run([*args[:-1], "100", "--resume"])  # more than the 16 prompts: all of them, 16
    assert "samples 8 -> 16)" in str(res.exception), repr(res.exception)
    monkeypatch.setattr(dflash_trt.training.pipeline, "build_data", real_build)
    res = _run(args + ["--resume"])
    assert res.exit_code == 0, res.output + repr(res.exception)


def test_resume_from_another_init_is_refused(tmp_path, target_with_tokenizer):
    """--resume with another --init (random -> target): refused naming the flag and both (the weights would be the
    checkpoint's, but training.json recorded the new --init as the run's start, and the copy from the target ran
    for nothing)."""
    out, work = tmp_path / "d", tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--work-dir", str(work),
            "--out", str(out), "--num-layers", "1", "--block-size", "4", "--epochs", "2", "--max-new-tokens", "8",
            "--target-layer-ids", "0,1", "--mask-token-id", str(MASK), "--max-steps", "2"]
    res = _run(args + ["--init", "random"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    res = _run(args + ["--init", "target", "--resume"])
    assert res.exit_code == 1 and isinstance(res.exception, DFlashError), res.output + repr(res.exception)
    assert str(res.exception) == (
        f"{work / 'run' / 'checkpoint.pt'} was made with other training settings or data (init (--init) random -> "
        "target); resume with the settings it was started with, or remove it to start over")
    res = _run(args + ["--init", "random", "--resume"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads((out / "training.json").read_text())["init"]["mode"] == "random"


def assert_resumed_equals_straight(out, straight, steps: int) -> None:
    """The export at `out` (an interrupted run, resumed) has the weights of the uninterrupted run's at
    `straight`, bit for bit, and its training.json says it finished all `steps`."""
    resumed, uninterrupted = load_drafter(out).state_dict(), load_drafter(straight).state_dict()
    for k, w in uninterrupted.items():
        assert torch.equal(w, resumed[k]), k
    info = json.loads((out / "training.json").read_text())
    assert (info["steps"], info["finished"]) == (steps, True)

def test_ctrl_c_says_where_to_resume_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, target_with_tokenizer,
                                                                                     monkeypatch):
    """Ctrl-C (a KeyboardInterrupt from a training step) exits 130 with one line on stderr: the step,
    the last checkpoint and the rerun; before the first checkpoint the rerun starts over without
    --resume. Nothing is exported, no temporary file is left, and the run resumed with --resume
    ends with bitwise the weights of an uninterrupted run."""
    from dflash_trt.training import trainer

    def run(out, work, *extra):
        return _run(["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path)), "--out", str(out),
                     "--work-dir", str(work), "--num-layers", "1", "--block-size", "4", "--epochs", "2",
                     "--target-layer-ids", "0,1", "--max-new-tokens", "12", "--mask-token-id", str(MASK),
                     "--init", "random", "--anchors", "4", "--checkpoint-every", "3", *extra])

    real = trainer._batch_loss

    def interrupt_at(call):
        calls = []

        def batch_loss(*args, **kwargs):
            calls.append(1)
            if len(calls) == call:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        monkeypatch.setattr(trainer, "_batch_loss", batch_loss)

    torch.use_deterministic_algorithms(True)
    try:
        straight = run(tmp_path / "straight", tmp_path / "straight.work")
        assert straight.exit_code == 0, straight.output + repr(straight.exception)
        out, work = tmp_path / "d", tmp_path / "w"
        interrupt_at(3)  # in step 3: no checkpoint yet (every 3 steps)
        res = run(out, work)
        assert res.exit_code == 130, res.output + repr(res.exception)
        assert res.stderr.splitlines()[-1] == (
            "training interrupted (Ctrl-C) at step 2/8, before its first checkpoint (one every 3 steps, "
            f"--checkpoint-every); rerun the same command to start the training again (the data cache in "
            f"{work / 'data'} is reused)")
        assert not (work / "run" / "checkpoint.pt").exists() and not out.exists()
        interrupt_at(5)  # in step 5: the checkpoint of step 3 is the last one
        res = run(out, work)
        assert res.exit_code == 130, res.output + repr(res.exception)
        assert res.stderr.splitlines()[-1] == (
            f"training interrupted (Ctrl-C) at step 4/8; the last checkpoint is step 3 "
            f"({work / 'run' / 'checkpoint.pt'}): rerun the same command with --resume to continue from it")
        assert "Traceback" not in res.output and not out.exists()
        assert sorted(p.name for p in (work / "run").iterdir()) == [".lock", "checkpoint.pt"]  # .lock: folder_lock
        assert torch.load(work / "run" / "checkpoint.pt", weights_only=False)["state"]["step"] == 3
        monkeypatch.setattr(trainer, "_batch_loss", real)
        res = run(out, work, "--resume")
        assert res.exit_code == 0, res.output + repr(res.exception)
    finally:
        torch.use_deterministic_algorithms(False)
    assert_resumed_equals_straight(out, tmp_path / "straight", steps=8)


def test_time_limit_pauses_at_a_checkpoint_and_resume_finishes_like_an_uninterrupted_run(tmp_path,
                                                                                         target_with_tokenizer,
                                                                                         monkeypatch):
    """--time-limit-min counts this invocation's training time (it was measured from the last
    checkpoint, so with frequent checkpoints it never fired): with the trainer's clock moving 14 s a
    step and a 1-minute limit, the run pauses with a checkpoint at step 5 (checkpoints every 3 steps),
    says so and exports nothing; the same command without --resume (even with --force) is refused
    before any data work; with --resume it ends with bitwise the weights of an uninterrupted run."""
    from dflash_trt.training import pipeline, trainer

    def run(out, work, *extra):
        return _run(["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path)), "--out", str(out),
                     "--work-dir", str(work), "--num-layers", "1", "--block-size", "4", "--epochs", "2",
                     "--target-layer-ids", "0,1", "--max-new-tokens", "12", "--mask-token-id", str(MASK),
                     "--init", "random", "--anchors", "4", "--checkpoint-every", "3", *extra])

    torch.use_deterministic_algorithms(True)
    try:
        straight = run(tmp_path / "straight", tmp_path / "straight.work")
        assert straight.exit_code == 0, straight.output + repr(straight.exception)
        clock = {"now": 0.0}
        real = trainer._batch_loss

        def batch_loss(*args, **kwargs):
            clock["now"] += 14.0
            return real(*args, **kwargs)

        class FakeTime:
            perf_counter = monotonic = time = staticmethod(lambda: clock["now"])
        monkeypatch.setattr(trainer, "_batch_loss", batch_loss)
        monkeypatch.setattr(trainer, "time", FakeTime)
        out, work = tmp_path / "d", tmp_path / "w"
        res = run(out, work, "--time-limit-min", "1")
        assert res.exit_code == 0, res.output + repr(res.exception)
        assert (f"paused at step 5/8 (checkpoint in {work / 'run'}); rerun the same command with --resume to "
                "continue") in res.output, res.output
        assert not out.exists() and not list(tmp_path.glob(".d.tmp-*"))
        assert torch.load(work / "run" / "checkpoint.pt", weights_only=False)["state"]["step"] == 5

        def no_data(*args, **kwargs):
            raise AssertionError("data generation ran before the checkpoint was refused")
        real_build = pipeline.build_data
        monkeypatch.setattr(pipeline, "build_data", no_data)
        data = {p.name: p.stat().st_mtime_ns for p in (work / "data").iterdir()}
        res = run(out, work, "--time-limit-min", "1", "--force")
        assert isinstance(res.exception, ConfigError), res.output + repr(res.exception)
        assert str(res.exception) == (f"{work / 'run'} already holds a training checkpoint; pass --resume to "
                                      "continue it (and export it again), or remove that folder or give another "
                                      "--work-dir to start over (--force replaces --out only)")
        assert {p.name: p.stat().st_mtime_ns for p in (work / "data").iterdir()} == data and not out.exists()
        monkeypatch.setattr(pipeline, "build_data", real_build)
        res = run(out, work, "--time-limit-min", "1", "--resume")  # steps 6-8: 42 s of this call's minute
        assert res.exit_code == 0 and "paused" not in res.output, res.output + repr(res.exception)
    finally:
        torch.use_deterministic_algorithms(False)
    assert_resumed_equals_straight(out, tmp_path / "straight", steps=8)


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_in_data_generation_keeps_the_finished_shards(tmp_path, target_with_tokenizer, monkeypatch,
                                                                        signal_name):
    """Ctrl-C (or SIGTERM: kill, Slurm) while the target writes the data: exit 130 (143), one line saying the
    finished shards are kept; the manifest is whole JSON, not marked complete, and the rerun reuses the finished
    shard."""
    from dflash_trt.interrupts import Terminated
    from dflash_trt.runtime.engine import Engine

    work = tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--work-dir", str(work),
            "--prompts", str(_prompts(tmp_path, 8)), "--target-layer-ids", "0,1", "--max-new-tokens", "4",
            "--mask-token-id", str(MASK), "--gen-batch-size", "4", "--data-only"]
    real, calls = Engine.generate, []

    def generate(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise Terminated if signal_name == "SIGTERM" else KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(Engine, "generate", generate)
    res = _run(args)
    how, code = ("terminated (SIGTERM)", 143) if signal_name == "SIGTERM" else ("interrupted (Ctrl-C)", 130)
    assert res.exit_code == code, res.output + repr(res.exception)
    assert res.stderr.splitlines()[-1] == (f"data generation {how}; the finished shards in "
                                           f"{work / 'data'} are kept: rerun the same command to continue")
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    assert list(manifest["shards"]) == ["shard-00000.pt"] and "complete" not in manifest
    assert sorted(p.name for p in (work / "data").iterdir()) == [".lock", "manifest.json", "shard-00000.pt"]
    first = (work / "data" / "shard-00000.pt").stat().st_mtime_ns
    monkeypatch.setattr(Engine, "generate", real)
    res = _run(args)
    assert res.exit_code == 0 and "data: 8 samples" in res.stdout, res.output + repr(res.exception)
    assert (work / "data" / "shard-00000.pt").stat().st_mtime_ns == first


def test_prompts_that_fill_max_seq_len_are_refused_before_generation(tmp_path, target_with_tokenizer):
    """Every prompt at least --max-seq-len tokens long: refused after tokenizing, before the target writes
    a single response (the trainer's own check would come only after hours of generation)."""
    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps({"prompt": " ".join(f"w{5 + i % 50}" for i in range(n))}) + "\n" for n in (8, 12)))
    work = tmp_path / "work"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts", str(f),
                "--max-seq-len", "8", "--mask-token-id", str(MASK), "--work-dir", str(work), "--num-layers", "1",
                "--block-size", "4", "--target-layer-ids", "0,1"])
    assert isinstance(res.exception, DFlashError), repr(res.exception)
    assert str(res.exception) == ("no training sample has a response within --max-seq-len 8: each prompt fills the "
                                  "window, so nothing would be trained; raise --max-seq-len above the prompt lengths "
                                  "(the longest prompt is 12 tokens; the window holds prompt + response), or use "
                                  "shorter prompts")
    assert not list(work.rglob("*.pt")) and not list(work.rglob("*.safetensors")) and not (tmp_path / "d").exists()


@pytest.mark.parametrize("max_seq_len,max_new_tokens,budget", [(512, 128, 384), (2048, 128, 1920), (64, 128, 384),
                                                                 (1000, 600, 400)])
def test_prompts_keep_what_the_window_leaves_for_them(tmp_path, target_with_tokenizer, monkeypatch, max_seq_len,
                                                      max_new_tokens, budget):
    """A prompt keeps its last max(384, --max-seq-len - --max-new-tokens) tokens, at most the target's context
    - 1 (the tiny target's is 256; a longer prompt stopped the data generation): a long window no longer cuts
    prompts at a fixed 384 (the data cache's settings record the budget, so a cache made with another is
    refused rather than mixed)."""
    from dflash_trt.training import pipeline

    seen = []
    real = pipeline.build_data

    def build_data(*a, **k):
        seen.append(a[9] if len(a) > 9 else k["max_prompt_len"])
        return real(*a, **k)
    monkeypatch.setattr(pipeline, "build_data", build_data)
    work = tmp_path / "work"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
                str(_prompts(tmp_path, 2)), "--target-layer-ids", "0,1", "--max-new-tokens", str(max_new_tokens),
                "--max-seq-len", str(max_seq_len), "--mask-token-id", str(MASK), "--work-dir", str(work),
                "--data-only"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert pipeline.prompt_budget(max_seq_len, max_new_tokens) == budget and seen == [min(budget, 255)]
    assert json.loads((work / "data" / "manifest.json").read_text())["settings"]["max_prompt_len"] == min(budget, 255)


@pytest.mark.parametrize("suffix", ["/", "/."])
def test_default_work_dir_is_beside_a_normalized_out(tmp_path, target_with_tokenizer, suffix):
    """--out d/ and d/. give the work dir d.work (d/. gave 'd/..work', a hidden folder inside d)."""
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d") + suffix, "--prompts",
                str(_prompts(tmp_path, 2)), "--target-layer-ids", "0,1", "--max-new-tokens", "4",
                "--mask-token-id", str(MASK), "--data-only"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.work", "prompts.jsonl"]
    assert (tmp_path / "d.work" / "data" / "manifest.json").is_file()


def test_a_file_as_target_is_named_as_a_file(tmp_path):
    """--target PROMPTS.jsonl: 'is a file; give the model folder' (as check and generate say), not its JSON
    parse error ('not valid JSON (Extra data...)' from reading it as a config.json)."""
    from dflash_trt.errors import CheckpointError

    f = _prompts(tmp_path, 2)
    res = _run(["--target", str(f), "--out", str(tmp_path / "d")])
    assert isinstance(res.exception, CheckpointError) and str(res.exception) == (
        f"--target {f} is a file; give the model folder (the one holding config.json)"), repr(res.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_training_json_records_absolute_paths(tmp_path, target_with_tokenizer, monkeypatch):
    """Relative --prompts / --init / --target: training.json records them absolute (it kept '../w/p.jsonl', which
    means nothing beside the exported drafter or on another machine)."""
    import os

    _prompts(tmp_path, 4)
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    target = os.path.relpath(target_with_tokenizer, run)
    base = ["--target", target, "--prompts", "../prompts.jsonl", "--max-new-tokens", "4", "--max-steps", "1"]
    res = _run([*base, "--out", "../first", "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "0,1",
                "--mask-token-id", str(MASK), "--init", "random"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    res = _run([*base, "--out", "../second", "--init", "../first"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    info = json.loads((tmp_path / "second" / "training.json").read_text())
    assert info["target"] == str(target_with_tokenizer.resolve())
    assert info["data"]["prompts"] == str(tmp_path / "prompts.jsonl")
    assert info["init"]["path"] == str((tmp_path / "first").resolve())


def test_a_draft_vocabulary_that_misses_most_responses_is_warned(tmp_path, target_with_tokenizer):
    """--draft-vocab-size 2 trained silently on a vocabulary covering a fraction of the responses (the drafter can
    never propose the rest): one warning with the coverage; the default-sized test vocabulary gets none."""
    base = ["--target", str(target_with_tokenizer), "--prompts", str(_prompts(tmp_path, 8)), "--num-layers", "1",
            "--block-size", "4", "--target-layer-ids", "0,1", "--max-new-tokens", "8", "--mask-token-id", str(MASK),
            "--init", "random", "--max-steps", "1", "--work-dir", str(tmp_path / "w")]
    res = _run(base + ["--out", str(tmp_path / "a"), "--draft-vocab-size", "2"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    info = json.loads((tmp_path / "a" / "training.json").read_text())
    covered = info["draft_vocab"]["response_token_coverage"]
    assert covered < 0.9 and (f"warning: --draft-vocab-size 2 covers {covered:.1%} of the response tokens; the drafter "
                              f"can never propose the other {1 - covered:.1%}") in res.stderr, res.stderr
    import shutil

    shutil.rmtree(tmp_path / "w" / "run")
    res = _run(base + ["--out", str(tmp_path / "b"), "--draft-vocab-size", "63"])
    assert res.exit_code == 0 and "covers" not in res.stderr, res.stderr


def test_a_work_dir_of_another_target_is_named_before_other_advice(tmp_path, target_with_tokenizer):
    """A work dir whose run was made for another target: with --resume it was told to change
    --target-layer-ids (which this target may not have), without it to pass --resume; now both name the two
    targets, before any data is generated."""
    import shutil

    other = tmp_path / "other-target"
    shutil.copytree(target_with_tokenizer, other)
    work = tmp_path / "w"
    base = ["--prompts", str(_prompts(tmp_path, 4)), "--num-layers", "1", "--block-size", "4", "--max-new-tokens", "4",
            "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "1", "--work-dir", str(work)]
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "a"), "--target-layer-ids", "0,1", *base])
    assert res.exit_code == 0, res.output + repr(res.exception)
    shards = sorted(p.stat().st_mtime_ns for p in (work / "data").iterdir())
    for extra in (["--resume"], []):
        res = _run(["--target", str(other), "--out", str(tmp_path / "b"), "--target-layer-ids", "0,2", *base, *extra])
        what = "--resume continues only a run of the same target" if extra else "its data is not this target's"
        assert isinstance(res.exception, ConfigError) and str(res.exception) == (
            f"{work} holds a run made for the target {target_with_tokenizer.name}, not other-target (--target): {what}; "
            "give that --target to continue it, or another --work-dir (or --out, whose work dir OUT.work is the "
            "default) to start a new run"), repr(res.exception)
    assert sorted(p.stat().st_mtime_ns for p in (work / "data").iterdir()) == shards and not (tmp_path / "b").exists()


def test_more_layers_than_the_target_has_are_refused_before_any_work_with_init_target(tmp_path, target_with_tokenizer):
    """--init target (the default) copies one target layer per drafter layer: --num-layers 5 on a 4-layer target
    failed after the data generation, naming source layers [-1, 0, 1, 2, 3] the user never gave, and left OUT.work
    behind; now it is refused first, naming the flag, the target's layer count and the fixes."""
    from dflash_trt.training.init import default_source_layers

    out = tmp_path / "d"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(_prompts(tmp_path, 4)),
                "--num-layers", "5", "--mask-token-id", str(MASK)])
    assert isinstance(res.exception, ConfigError) and str(res.exception) == (
        "--num-layers 5: --init target (the default) starts each drafter layer as a copy of one of the target's top "
        "layers, and the target has only 4; give --num-layers 4 or less, or --init random"), repr(res.exception)
    assert not out.exists() and not (tmp_path / "d.work").exists()
    with pytest.raises(ConfigError, match=r"^a drafter of 5 layers cannot start as copies of the target's top layers: "
                                          r"the target has only 4; use at most 4 drafter layers, or random"):
        default_source_layers(4, 5)
    assert default_source_layers(4, 4) == [0, 1, 2, 3]


def test_a_corrupt_init_drafter_is_refused_before_any_work(tmp_path, target_with_tokenizer):
    """--init DIR with a truncated model.safetensors was found only when training began, after the target
    had written all its data; its weights are now loaded first, and the error names --init and the file."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    init = init_drafter(new_drafter_config(TargetConfig.from_pretrained(target_with_tokenizer), 1, 4, MASK, [0, 1]),
                        tmp_path / "init")
    weights = init / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "d"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(_prompts(tmp_path, 4)),
                "--init", str(init)])
    assert res.exit_code == 1 and str(res.exception).startswith(f"--init {init}: {weights}: not a readable safetensors "
                                                                "file ("), repr(res.exception)
    assert str(res.exception).endswith("re-save or re-download it")
    assert not out.exists() and not (tmp_path / "d.work").exists()


def test_a_target_of_the_same_name_with_other_weights_does_not_reuse_the_data(tmp_path, target_with_tokenizer):
    """The data cache is keyed by the target's folder name and its weights' fingerprint: a model of the same
    name and shapes but other weights (a fine-tuned one saved over it) is refused, naming --target, instead of
    training on the first model's responses and hidden states."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_trt.models.loading import weights_fingerprint

    other = tmp_path / "elsewhere" / target_with_tokenizer.name
    shutil.copytree(target_with_tokenizer, other)
    assert weights_fingerprint(other) == weights_fingerprint(target_with_tokenizer)  # a copy: the same data
    work = tmp_path / "w"
    base = ["--prompts", str(_prompts(tmp_path, 4)), "--num-layers", "1", "--block-size", "4", "--max-new-tokens", "4",
            "--mask-token-id", str(MASK), "--init", "random", "--target-layer-ids", "0,1", "--work-dir", str(work),
            "--data-only"]
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "a"), *base])
    assert res.exit_code == 0, res.output + repr(res.exception)
    res = _run(["--target", str(other), "--out", str(tmp_path / "a"), *base])  # the copy reuses it
    assert res.exit_code == 0, res.output + repr(res.exception)
    (file,) = other.glob("*.safetensors")
    tensors = load_file(file)
    tensors = {k: v * 1.01 if v.is_floating_point() else v for k, v in tensors.items()}  # fine-tuned: same shapes
    save_file(tensors, file, metadata={"format": "pt"})
    assert weights_fingerprint(other) != weights_fingerprint(target_with_tokenizer)
    res = _run(["--target", str(other), "--out", str(tmp_path / "a"), *base])
    assert isinstance(res.exception, DFlashError) and "holds training data made with other settings (target_weights " \
        "(--target: its weights or config.json) differs)" in str(res.exception), repr(res.exception)
    manifest = work / "data" / "manifest.json"  # a cache made before the fingerprint: the target's name decides
    m = json.loads(manifest.read_text())
    del m["settings"]["target_weights"]
    manifest.write_text(json.dumps(m))
    res = _run(["--target", str(target_with_tokenizer), "--out", str(tmp_path / "a"), *base])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "target_weights" in json.loads(manifest.read_text())["settings"]  # recorded from now on
    same = tmp_path / "reformatted"  # the same config, reformatted: the same model
    shutil.copytree(target_with_tokenizer, same)
    (same / "config.json").write_text(json.dumps(json.loads((same / "config.json").read_text()), indent=4,
                                                 sort_keys=True))
    assert weights_fingerprint(same) == weights_fingerprint(target_with_tokenizer)


def test_damaged_work_dir_files_are_named_with_the_fix(tmp_path, target_with_tokenizer):
    """A data-cache manifest or shard, or a training checkpoint, damaged outside dflash-trt (a partial copy, a disk
    fault): an error naming the file and what to do, not a traceback from json / torch.load."""
    import shutil

    work = tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
            str(_prompts(tmp_path, 4)), "--num-layers", "1", "--block-size", "4", "--max-new-tokens", "4",
            "--mask-token-id", str(MASK), "--init", "random", "--target-layer-ids", "0,1", "--work-dir", str(work),
            "--max-steps", "1"]
    res = _run(args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    kept = tmp_path / "kept"
    shutil.copytree(work, kept)
    fix = f"remove {work / 'data'} (the target's responses are generated again) or pass another --work-dir"
    (work / "data" / "manifest.json").write_text("{")
    res = _run(args + ["--resume"])
    assert isinstance(res.exception, DFlashError) and str(res.exception).startswith(
        f"{work / 'data' / 'manifest.json'} is damaged (not JSON: ") and str(res.exception).endswith(fix), repr(res.exception)
    shutil.rmtree(work)
    shutil.copytree(kept, work)
    shard = next((work / "data").glob("shard-*.pt"))
    for size in (shard.stat().st_size // 2, 0):  # cut short; empty (EOFError with no message)
        shard.write_bytes(shard.read_bytes()[:size])
        res = _run(args + ["--resume"])
        assert isinstance(res.exception, DFlashError) and str(res.exception).startswith(
            f"{shard} is damaged and cannot be read (") and fix in str(res.exception), (size, repr(res.exception))
    shutil.rmtree(work)
    shutil.copytree(kept, work)
    ckpt = work / "run" / "checkpoint.pt"
    for size in (1000, 0):
        ckpt.write_bytes(ckpt.read_bytes()[:size])
        res = _run(args + ["--resume"])
        assert isinstance(res.exception, DFlashError) and str(res.exception).startswith(f"{ckpt} is damaged") and \
            f"remove {work / 'run'} and run without --resume to train from the start" in str(res.exception), \
            (size, repr(res.exception))


def test_a_chosen_mask_token_that_occurs_in_text_is_warned(tmp_path, target_with_tokenizer):
    """--mask-token-id of a token the target's text holds (here its EOS) is warned as init-drafter warns it."""
    args = ["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts", str(_prompts(tmp_path, 2)),
            "--num-layers", "1", "--block-size", "4", "--max-new-tokens", "2", "--init", "random", "--data-only",
            "--target-layer-ids", "0,1", "--mask-token-id"]
    res = _run(args + [str(EOS)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert f"warning: mask token id {EOS} ('w{EOS}') is a special token that occurs in the target's text" in res.output


def test_a_run_started_with_layer_ids_out_of_order_can_be_resumed(tmp_path, target_with_tokenizer):
    """Layer ids must be increasing now; a run an older version started with others continues with its own ids
    (they had been refused either way: as out of order, or as differing from the run's)."""
    work = tmp_path / "w"
    args = ["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts",
            str(_prompts(tmp_path, 4)), "--num-layers", "1", "--block-size", "4", "--max-new-tokens", "4",
            "--mask-token-id", str(MASK), "--init", "random", "--work-dir", str(work)]
    res = _run(args + ["--target-layer-ids", "0,1", "--max-steps", "1"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    ckpt = work / "run" / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=False)
    state["target_layer_ids"] = [1, 0]  # as an older version could have written
    torch.save(state, ckpt)
    res = _run(args + ["--target-layer-ids", "1,0", "--max-steps", "2", "--resume", "--force"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    res = _run(args + ["--target-layer-ids", "2,0", "--max-steps", "2", "--resume", "--force"])
    assert isinstance(res.exception, ConfigError) and "give them in increasing order (0,2)" in str(res.exception)


def test_check_warns_when_the_drafter_was_trained_for_another_target(tmp_path, target_with_tokenizer):
    """`dflash-trt check` ignored training.json's "target" (the target train-drafter trained on): a drafter made for
    one model passed silently with another. Now a target of another name gets one warning naming both (exit 0: a
    drafter may serve a sibling of its target); the same folder, a copy under the same name, and the same model as
    a Hugging Face hub snapshot (models--ORG--NAME/snapshots/REVISION) get none."""
    import shutil

    from dflash_trt.compat import ERROR, WARNING, check_checkpoints

    out = tmp_path / "drafter"
    res = _run(["--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(_prompts(tmp_path, 8)),
                "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "0,1", "--max-new-tokens", "8",
                "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "1"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    trained_for = target_with_tokenizer.resolve()
    assert json.loads((out / "training.json").read_text())["target"] == str(trained_for)

    def training_target_warnings(target):
        findings = check_checkpoints(target, out)
        assert [f.message for f in findings if f.level == ERROR] == []
        return [f.message for f in findings if f.level == WARNING and f.message.startswith("training target:")]

    assert training_target_warnings(target_with_tokenizer) == []
    same_name = shutil.copytree(target_with_tokenizer, tmp_path / "elsewhere" / target_with_tokenizer.name)
    assert training_target_warnings(same_name) == []
    snapshot = shutil.copytree(target_with_tokenizer, tmp_path / "hub" / f"models--org--{target_with_tokenizer.name}"
                               / "snapshots" / "0123abcd")
    assert training_target_warnings(snapshot) == []
    sibling = shutil.copytree(target_with_tokenizer, tmp_path / "tiny-sibling")
    expected = (f"training target: the drafter's training.json says it was trained for the target {trained_for} "
                f"({trained_for.name}), not {sibling} (tiny-sibling); fine if this target is a sibling of that one "
                "(same tokenizer and layers, e.g. a fine-tune of it), otherwise the drafter was made for another model "
                "(acceptance will be low): use the drafter trained for this target, or train one with dflash-trt "
                f"train-drafter --target {sibling}")
    assert training_target_warnings(sibling) == [expected]
    cli_run = CliRunner().invoke(cli, ["check", "--target", str(sibling), "--drafter", str(out)])
    assert cli_run.exit_code == 0, cli_run.output + repr(cli_run.exception)
    assert f"warning: {expected}" in cli_run.stderr.splitlines()
    assert [line.split(":")[1] for line in cli_run.stderr.splitlines()] == [" unfinished", " training target",
                                                                          " mask token"]  # --max-steps 1; MASK is text
    assert cli_run.stdout == f"ok: the drafter fits the target (3 warnings): target {sibling}, drafter {out}\n"


@pytest.mark.parametrize("phase", ["data", "run"])
def test_a_second_run_on_the_same_work_dir_is_refused_while_the_first_holds_it(tmp_path, target_with_tokenizer, phase):
    """Two train-drafter runs given one --out share its work dir: while one holds the data cache (generating) or
    the run folder (training), the other stops with an error naming the folder, the process and the fix, and writes
    no shard or checkpoint into it."""
    from tests.test_files import hold_in_another_process

    work = tmp_path / "d.work"
    args = ["--target", str(target_with_tokenizer), "--out", str(tmp_path / "d"), "--prompts", str(_prompts(tmp_path, 2)),
            "--target-layer-ids", "0,1", "--max-new-tokens", "4", "--mask-token-id", str(MASK), "--epochs", "1"]
    if phase == "run":  # the data cache made first, so the second run gets to training
        assert _run(args + ["--data-only"]).exit_code == 0
    proc = hold_in_another_process(work / phase)
    try:
        res = _run(args)
    finally:
        proc.kill()
        proc.wait()
    msg = str(res.exception)
    assert isinstance(res.exception, ConfigError), repr(res.exception)
    assert f"{work / phase} is in use by another" in msg and f"(process {proc.pid})" in msg
    assert "give this run another folder (train-drafter: --out or --work-dir)" in msg
    assert not (tmp_path / "d").exists() and not (work / "run" / "checkpoint.pt").exists()
    if phase == "data":
        assert not list((work / "data").glob("shard-*"))
    assert _run(args).exit_code == 0  # the first gone, the same command runs
