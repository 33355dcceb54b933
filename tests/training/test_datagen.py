"""The data cache: responses are the target's greedy output, features equal a teacher-forced forward."""

import json

import torch

from tests.training.conftest import DATA_LAYERS, EOS
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.sampling import SamplingParams


def test_responses_are_greedy_target_output(tiny_target, tiny_prompts, tiny_samples):
    by_index = {s["index"]: s for s in tiny_samples}
    assert sorted(by_index) == list(range(len(tiny_prompts)))
    engine = Engine(tiny_target, None, (EOS,))
    ref = engine.generate(tiny_prompts[:3], SamplingParams(max_tokens=40), mode="ar")
    for i, r in enumerate(ref):
        assert by_index[i]["tokens"].tolist() == tiny_prompts[i] + r.token_ids
        assert by_index[i]["prompt_len"] == len(tiny_prompts[i])


def test_recorded_features_match_teacher_forced_forward(tiny_target, tiny_samples):
    s = tiny_samples[0]
    tokens = s["tokens"][:-1].long()[None]
    t = tokens.shape[1]
    cache = tiny_target.new_cache(1, t)
    out = tiny_target(tokens, torch.arange(t)[None], cache, t, None, DATA_LAYERS)
    assert s["features"].shape == (t, len(DATA_LAYERS) * 64)
    assert s["features"].dtype == torch.bfloat16
    torch.testing.assert_close(s["features"].float(), out.features[0].to(torch.bfloat16).float(), atol=0.05, rtol=0.02)


def test_manifest_totals_and_rerun_reuses_shards(tiny_data_dir, tiny_samples):
    manifest = json.loads((tiny_data_dir / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["totals"]["samples"] == len(tiny_samples) == 24
    resp = sum(len(s["tokens"]) - s["prompt_len"] for s in tiny_samples)
    assert manifest["totals"]["response_tokens"] == resp


def test_max_samples_takes_exactly_that_many_and_reuses_the_cache(tmp_path, tiny_target, tiny_prompts):
    """A limit that is not a multiple of the batch size is met exactly (partial last shard); a smaller
    limit reuses a prefix of the cache, a larger one regenerates only the partial shard."""
    from dflash_trt.training.datagen import generate_dataset, load_shards

    engine = Engine(tiny_target, None, (EOS,))

    def run(n):
        stats = generate_dataset(engine, tiny_prompts, tmp_path, (), 6, 8, {"test": True}, False, max_samples=n)
        samples = load_shards(tmp_path)
        assert stats.samples == len(samples) == n
        assert stats.prompt_tokens == sum(s["prompt_len"] for s in samples)
        assert stats.response_tokens == sum(len(s["tokens"]) - s["prompt_len"] for s in samples)
        return samples, {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard-*.pt")}

    ten, shards = run(10)
    assert sorted(shards) == ["shard-00000.pt", "shard-00001.pt"]
    five, again = run(5)
    assert again == shards and [s["index"] for s in five] == [s["index"] for s in ten[:5]]
    sixteen, again = run(16)
    assert again["shard-00000.pt"] == shards["shard-00000.pt"] and again["shard-00001.pt"] != shards["shard-00001.pt"]
    assert [s["index"] for s in sixteen[:10]] == [s["index"] for s in ten]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for entry in manifest["shards"].values():  # a cache written before per-sample lengths were kept
        del entry["lengths"]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    run(11)


def test_max_samples_is_exact_when_a_batch_in_the_order_is_short(tmp_path, tiny_target, tiny_prompts):
    """22 prompts in batches of 8: the length-sorted batches hold 8, 8 and 6 prompts, in a seeded order;
    every limit 1..22 gives exactly that many samples, each a prefix of the next."""
    from dflash_trt.training.datagen import generate_dataset, load_shards

    engine = Engine(tiny_target, None, (EOS,))
    prompts = tiny_prompts[:22]
    previous = []
    for n in range(1, 23):
        stats = generate_dataset(engine, prompts, tmp_path, (), 4, 8, {"test": True}, False, max_samples=n)
        indices = [s["index"] for s in load_shards(tmp_path)]
        assert stats.samples == len(indices) == len(set(indices)) == n, n
        assert indices[: n - 1] == previous
        previous = indices
    assert sorted(previous) == list(range(22))


def test_online_features_equal_the_cached_ones(tiny_target, tiny_samples):
    """`--online-features` computes, per step, what the offline cache holds (one padded batch)."""
    from dflash_trt.training.features import OnlineFeatures

    last = tiny_target.config.num_hidden_layers - 1
    drafter_ids = tuple(i for i in DATA_LAYERS if i != last)
    online = OnlineFeatures(tiny_target, [s["tokens"] for s in tiny_samples], drafter_ids, True, max_seq_len=512)
    picks = [0, 5, 3]  # different lengths in one batch: right padding must not leak
    feats, teach = online(picks)
    width = len(drafter_ids) * 64
    for i, f, t in zip(picks, feats, teach):
        cached = tiny_samples[i]["features"].float()
        assert f.shape == (cached.shape[0], width) and t.shape == (cached.shape[0], 64)
        torch.testing.assert_close(f.to(torch.bfloat16).float(), cached[:, :width], atol=1e-5, rtol=8e-3)  # 1 bf16 ulp
        torch.testing.assert_close(t.to(torch.bfloat16).float(), cached[:, width:], atol=1e-5, rtol=8e-3)
    short = OnlineFeatures(tiny_target, [s["tokens"] for s in tiny_samples], drafter_ids, False, max_seq_len=10)
    feats, teach = short([0])
    assert teach is None and feats[0].shape == (min(10, tiny_samples[0]["tokens"].numel() - 1), width)


def test_batch_order_lists_what_a_cache_used():
    """batch_order: length-sorted batches in a seeded order, cut at max_samples; the prompts left out
    are the complement (what build_scripts/drafter_fit_check.py calls never seen)."""
    from dflash_trt.training.datagen import batch_order

    lens = [(7 * i) % 23 for i in range(50)]
    full = batch_order(lens, 8)
    assert sorted(i for b in full for i in b) == list(range(50)) and len(full) == 7
    assert all(max(lens[i] for i in b) <= min(lens[j] for j in c) or max(lens[j] for j in c) <= min(lens[i] for i in b)
               for b in full for c in full if b is not c)  # batches are disjoint length ranges
    assert batch_order(lens, 8) == full  # seeded
    cut = batch_order(lens, 8, max_samples=20)
    assert [len(b) for b in cut] == [len(b) for b in full[:len(cut) - 1]] + [20 - sum(map(len, cut[:-1]))]
    assert sum(map(len, cut)) == 20 and cut[:-1] == full[:len(cut) - 1] and cut[-1] == full[len(cut) - 1][:len(cut[-1])]
