"""One rank of a tensor-parallel run for the tests (spawned by torch.multiprocessing): joins a gloo group,
loads the pipeline with tp_size, decodes the prompts greedily in both modes (and with penalties) and writes what
it got."""

from __future__ import annotations

import json


def penalized_params(max_tokens: int):
    """Greedy params with logits processing (`dflash_trt.runtime.penalties`) that the TP tests decode too."""
    from dflash_trt.runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, repetition_penalty=1.3, presence_penalty=0.5, min_tokens=max_tokens)


def guided_params(max_tokens: int):
    """Greedy params with a grammar (`dflash_trt.runtime.guided`: any JSON object) that the TP tests decode too."""
    from dflash_trt.runtime.guided import GuidedDecoding
    from dflash_trt.runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, guided=GuidedDecoding(json_object=True))


def run_rank(rank: int, world: int, init_file: str, target, drafter, prompts: list[list[int]], max_tokens: int,
             out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from dflash_trt.api import load_pipeline
        from dflash_trt.runtime.sampling import SamplingParams

        pipe = load_pipeline(target, drafter, "float32", tp_size=world, draft_confidence=0.0, tree_topk=1,
                             prompt_lookup=0, max_concurrency=None)
        params = SamplingParams(max_tokens=max_tokens)
        dflash = pipe.generate(prompts, params, mode="dflash")
        ar = pipe.generate(prompts, params, mode="ar")
        penalized = pipe.generate(prompts, penalized_params(max_tokens), mode="dflash")
        guided = pipe.generate(prompts, guided_params(max_tokens), mode="dflash")
        cache = pipe.engine.target.new_cache(1, 64)
        with torch.inference_mode():
            ids = torch.tensor([prompts[0]])
            pos = torch.arange(ids.shape[1])[None]
            logits = pipe.engine.target(ids, pos, cache, ids.shape[1]).logits[0, -1]
        record = {"dflash": [r.token_ids for r in dflash], "ar": [r.token_ids for r in ar],
                  "penalized": [r.token_ids for r in penalized], "guided": [r.token_ids for r in guided],
                  "accepted": [r.metrics.accepted_tokens for r in dflash],
                  "kv_heads": cache.k[0].shape[1], "logits": logits.tolist()}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(record, f)
    finally:
        dist.destroy_process_group()
