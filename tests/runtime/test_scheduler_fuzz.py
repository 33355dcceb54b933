"""A few fixed seeds of the scheduler's randomized differential check (`tests.runtime.scheduler_fuzz`): random
workloads of greedy requests (shared prefixes, identical and 1-token prompts, prompts near the context limit, stop
tokens and strings (serve's StopText and the engine's params.stop), min_tokens, penalties, logit bias, bad words, logprobs, aborts) joining a DecodeBatch at random
steps with random chunked prefill, prefix cache bounds and proposer settings; every request must decode exactly as it
does alone in mode "ar" (token flips only at near-ties of the reference's scores), with the same finish reason and
logprobs, and the prefix cache must keep its invariants. More seeds: `python -m tests.runtime.scheduler_fuzz`."""

from __future__ import annotations

import pytest
import torch

from tests.runtime import scheduler_fuzz as fuzz


@pytest.mark.parametrize("name, seeds", [("tiny", range(0, 12)), ("tiny-small", range(0, 12))])
def test_random_workloads_decode_as_each_request_alone(tmp_path, name, seeds):
    torch.manual_seed(0)
    env = fuzz.tiny_env(tmp_path, name)
    bugs = []
    for seed in seeds:  # in order: "reuse" workloads read the prefix cache the earlier ones filled
        found, _ = fuzz.run_workload(env, fuzz.make_workload(env, seed))
        bugs += found
    assert bugs == []
    s = env.stats  # what the seeds exercised
    assert s["requests"] >= 40 and s["cached"] >= 2 and s["aborted"] >= 2 and s["stop string"] >= 2
    assert s["engine stop string"] >= 2  # stop strings in params.stop, the engine's own cut
    assert s["drafted"] >= 2 and s["context full"] >= 1
