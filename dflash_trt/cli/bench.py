"""`dflash-trt bench`: tau and speed of DFlash vs autoregressive and HF baselines, on real prompt sets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from dflash_trt.cli.common import (cpu_kernels_option, cuda_kernels_option, draft_confidence_option,
                                   guided_decoding_options, logits_processing_options, max_tokens_option, temperature_option,
                                   SEED_RANGE, lower_word, max_concurrency_option, prompt_lookup_option,
                                   threads_option, tree_topk_option)
from dflash_trt.text import count


@click.command()
@click.option("--target", type=click.Path(), default=None, help="HF target folder (default: embedded SmolLM2-135M-Instruct).")
@click.option("--drafter", type=click.Path(), default=None, help="DFlash drafter folder (default: the project's drafter).")
@click.option("--dataset", "datasets", multiple=True, default=("mt-bench", "humaneval"), show_default=True,
              help="mt-bench, humaneval, or a JSONL prompts file; repeat for several.")
@click.option("--num-prompts", default=20, show_default=True, type=click.IntRange(1, 1000),
              help="Prompts per dataset (the first N of a JSONL file; fewer when it holds fewer).")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Requests decoded together by dflash/ar (HF modes run at batch size 1 only).")
@click.option("--temperature", default=0.0, show_default=True, type=float, callback=temperature_option,
              help="0 = greedy.")
@click.option("--max-tokens", default=128, show_default=True, type=int, callback=max_tokens_option,
              help="Completion tokens per prompt at most, >= 1 (every mode the same).")
@logits_processing_options
@guided_decoding_options
@click.option("--block-size", default=None, type=click.IntRange(2, 64), help="Draft block size (default: the drafter's).")
@click.option("--max-draft-len", default=None, type=click.IntRange(1, 63),
              help="Drafts verified per step, <= block size - 1 (TensorRT-LLM's max_draft_len; default block size - 1). "
                   "Fewer cost less to verify when late drafts are rarely accepted.")
@draft_confidence_option
@tree_topk_option
@prompt_lookup_option
@max_concurrency_option
@click.option("--modes", default="dflash,ar,hf,hf-prompt-lookup", show_default=True,
              help="Comma-separated modes to compare: dflash (speculative decoding with the drafter), ar (the target "
                   "alone, the baseline of every speedup), hf (Hugging Face generate on the same weights), "
                   "hf-prompt-lookup (HF generate's prompt lookup decoding).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"], case_sensitive=False), default="float32", show_default=True,
              help="The dtype every mode computes in.")
@click.option("--fp8-matmul", type=click.Choice(["auto", "on", "off"], case_sensitive=False), default="auto", show_default=True,
              help="FP8 target: W8A8 FP8 matmuls (on; auto = on a CUDA GPU of compute capability >= 8.9) or weights "
                   "dequantized on load (off).")
@click.option("--device", default="cpu", show_default=True, callback=lower_word,
              help="Where the target and drafter run: cpu, cuda or cuda:N.")
@threads_option
@cpu_kernels_option
@cuda_kernels_option
@click.option("--profile", is_flag=True,
              help="Also time each phase of our modes' decode loop (draft, target forward, logits + acceptance, KV "
                   "injection, ...): a 'where the time goes' table in results.md, time_breakdown in results.json. "
                   "On a GPU it synchronizes at every phase.")
@click.option("--seed", default=0, show_default=True, type=SEED_RANGE,
              help="Sampling seed of the first prompt; prompt i uses seed + i (temperature > 0).")
@click.option("--out", default="bench_out", show_default=True, type=click.Path(),
              help="Folder for results.json, results.md and the PNG plots, created if missing. An earlier run's "
                   "files of those names there are overwritten (other files are left alone). Must not be inside a "
                   "built bundle or a DFlash drafter folder (inside a target's folder: a warning).")
def bench(target, drafter, datasets, num_prompts, batch_size, temperature, max_tokens, min_p, repetition_penalty,
          presence_penalty, frequency_penalty, logit_bias, min_tokens, json_schema, json_object, regex, grammar, block_size, max_draft_len, draft_confidence, tree_topk, prompt_lookup, max_concurrency, modes, dtype, fp8_matmul, device, threads, cpu_kernels,
          cuda_kernels, profile, seed, out):
    """Benchmark every mode on the same prompts, interleaved, in one process; write results.json,
    results.md and PNG plots to --out. The logits processing and structured-output flags apply to dflash and ar
    (HF's modes are refused with them).

    \f
    The results table is printed to stdout before the files are written: a write that fails at the end (a full
    disk) is one line naming the file and the fix (InvalidRequestError), the table above it being the run's
    result; no file of the run, and no folder it created, is left in --out."""
    import torch
    from tqdm import tqdm

    from dflash_trt.api import load_pipeline, load_tokenizer, parse_dtype, stop_token_ids
    from dflash_trt.bench.modes import MODES
    from dflash_trt.bench.report import OUTPUT_NAMES, markdown_table, write_outputs
    from dflash_trt.files import cannot_write
    from dflash_trt.bench.runner import DATASETS, encode_dataset, machine_info, run_benchmark, timestamp
    from dflash_trt.build.manifest import enclosing_bundle
    from dflash_trt.out_folder import check_outside_models
    from dflash_trt.cli.common import (check_logit_bias_ids, check_out_folder, check_draft_lengths, check_prompt_lengths,
                                       compile_guided, guided_decoding, jsonl_file, logits_processing,
                                       model_folder, note_max_concurrency, set_threads, warn_block_size,
                                       warn_context_room, warn_draft_flags_unused, warn_sampling_unused,
                                       warn_tree_unused, warn_untrained_drafter)
    from dflash_trt.config import TargetConfig
    from dflash_trt.runtime.guided import Grammars
    from dflash_trt.errors import ConfigError, InvalidRequestError
    from dflash_trt.models.checkpoints import check_device
    from dflash_trt.models.default import default_target_path, drafter_required
    from dflash_trt.ops.cuda import resolve_cuda_kernels
    from dflash_trt.runtime.sampling import SamplingParams
    from dflash_trt.training.prompts import REQUEST_KEYS, load_prompts_jsonl

    mode_list = [m.strip().lower() for m in modes.split(",") if m.strip()]
    datasets = dedupe_datasets(ds.lower() if ds.lower() in DATASETS else ds for ds in datasets)
    bad = [m for m in mode_list if m not in MODES]
    if bad:
        raise click.BadParameter(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}", param_hint="'--modes'")
    if not mode_list:
        raise click.BadParameter(f"{modes!r} names no mode; give a comma-separated list of {', '.join(MODES)}",
                                 param_hint="'--modes'")
    twice = sorted({m for m in mode_list if mode_list.count(m) > 1})
    if twice:
        raise click.BadParameter(f"{', '.join(twice)} listed more than once; give each mode once", param_hint="'--modes'")
    for ds in datasets:  # before any model loads
        if ds in DATASETS:
            continue
        if not ds.strip():
            raise InvalidRequestError(f"--dataset is empty; give {', '.join(DATASETS)} or the path of a JSONL file")
        if not Path(jsonl_file("--dataset", ds)).exists():  # a pipe (<(...)) too
            raise InvalidRequestError(f"--dataset {ds}: no such prompt set or file; give {', '.join(DATASETS)} "
                                      "or the path of an existing JSONL file")
        load_prompts_jsonl(ds, REQUEST_KEYS)  # an empty or malformed file fails here, not after the models load
    hf_modes = [m for m in mode_list if m.startswith("hf")]
    processing = logits_processing(max_tokens, min_p, repetition_penalty, presence_penalty, frequency_penalty,
                                   logit_bias, min_tokens)
    processing["guided"] = guided_decoding(json_schema, json_object, regex, grammar, min_tokens)
    given = [f"--{name.replace('_', '-')}" for name in (*processing, "json_schema", "json_object", "regex", "grammar")
             if name != "guided"
             and click.get_current_context().get_parameter_source(name) != click.core.ParameterSource.DEFAULT]
    if given and hf_modes:  # HF generate has no presence / frequency penalty: ours only, before the models load
        raise click.UsageError(f"--modes {','.join(hf_modes)}: {', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} "
                               "to our modes only; drop the HF modes from --modes (e.g. --modes dflash,ar)")
    if batch_size > 1 and hf_modes:  # before the models load, not after
        raise click.UsageError(f"--modes {','.join(hf_modes)}: the HF modes run at batch size 1 only; drop them "
                                  f"from --modes (e.g. --modes dflash,ar) to bench --batch-size {batch_size}")
    bundle = enclosing_bundle(out)
    if bundle is not None:  # results mixed into a deployable artifact (and into no manifest)
        raise InvalidRequestError(f"--out {out} is inside the dflash-trt bundle {bundle}; choose an --out outside the "
                                  "bundle (e.g. --out bench_out)")
    check_outside_models("--out", out)  # results mixed into a drafter folder: refused; into a target's: warned
    check_out_folder("--out", out, OUTPUT_NAMES)  # a bench can run for hours: an unusable --out fails now, not at the end
    if (Path(out) / "results.json").is_file():  # said now, not after the run: there is time to keep them
        click.echo(f"warning: --out {out} holds an earlier run's results.json; this run replaces it, results.md and "
                   "the plots when it ends: to keep them, stop now and rerun with another --out (or move them away)",
                   err=True)
    warn_tree_unused(tree_topk, temperature)
    seed_given = click.get_current_context().get_parameter_source("seed") != click.core.ParameterSource.DEFAULT
    warn_sampling_unused(temperature, seed=seed if seed_given else None, min_p=min_p)
    check_draft_lengths(prompt_lookup, max_draft_len, block_size, "dflash" in mode_list, target, drafter)
    check_device(device)  # before the default model is converted and the prompts tokenized
    resolve_cuda_kernels(cuda_kernels, device)
    warn_draft_flags_unused("dflash" in mode_list, block_size, max_draft_len, draft_confidence, tree_topk,
                            prompt_lookup, max_concurrency)
    target, drafter = model_folder("--target", target), model_folder("--drafter", drafter, "drafter")
    why = drafter_required(target, drafter, alternative="drop dflash from --modes") if "dflash" in mode_list else None
    if why is not None:
        raise ConfigError(why)
    # every prompt against the target's context, from its config and tokenizer: before the weights load
    target_path = Path(target) if target is not None else default_target_path()
    target_config = TargetConfig.from_pretrained(target_path)
    context = target_config.max_position_embeddings
    check_logit_bias_ids(logit_bias, target_config.vocab_size)
    tokenizer = load_tokenizer(target_path)
    compile_guided(Grammars(tokenizer, target_config.vocab_size, stop_token_ids(target_path, target_config)),
                   processing["guided"])
    prompts = {}
    for ds in datasets:
        ids, where = encode_dataset(tokenizer, ds, num_prompts, f"the target at {target_path}")
        if ds in DATASETS:
            check_prompt_lengths(ids, context, name=ds, fix=f"drop --dataset {ds} or use a target with a longer context")
        else:
            check_prompt_lengths(ids, context, where, f"shorten it to at most {context - 1} tokens or remove that line")
        warn_context_room(ids, context, max_tokens, f"{ds}: ")
        if len(ids) < num_prompts:
            click.echo(f"warning: {ds} holds {count(len(ids), 'prompt')}, fewer than --num-prompts {num_prompts}; "
                       f"its rows are over {'that one' if len(ids) == 1 else f'those {len(ids)}'}", err=True)
        prompts[ds] = ids
    bar = None
    try:
        set_threads(threads)  # the same for every mode
        pipe = load_pipeline(target, drafter, dtype, block_size, load_drafter_model="dflash" in mode_list,
                             max_draft_len=max_draft_len, fp8_matmul=fp8_matmul, device=device,
                             draft_confidence=draft_confidence, cpu_kernels=cpu_kernels, cuda_kernels=cuda_kernels,
                             tree_topk=tree_topk, prompt_lookup=prompt_lookup,
                             max_concurrency=max_concurrency)
        warn_block_size(pipe)
        warn_untrained_drafter(pipe)
        if "dflash" in mode_list:
            note_max_concurrency(pipe, batch_size, max(len(ids) for ids in prompts.values()))
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, **processing)
        # the prompts that actually run (a JSONL file may hold fewer than --num-prompts), each in every mode
        bar = tqdm(total=sum(len(ids) for ids in prompts.values()) * len(mode_list), desc="bench", unit="run")
        results = run_benchmark(pipe, list(datasets), mode_list, num_prompts, params, parse_dtype(dtype), batch_size,
                                progress=bar.update, profile=profile, prompts=prompts)
        bar.close()
        proposer = pipe.engine.proposer
        results["config"] = {"target": str(pipe.target_path), "drafter": str(pipe.drafter_path),
                             "block_size": proposer.block_size if proposer else None,
                             "max_draft_len": proposer.max_draft_len if proposer else None,
                             "draft_confidence": proposer.draft_confidence if proposer else None,
                             "sampled_draft_confidence": proposer.sampled_draft_confidence if proposer else None,
                             "tree_topk": proposer.tree_topk if proposer else None,
                             "prompt_lookup": proposer.prompt_lookup if proposer else None,
                             "max_concurrency": proposer.max_concurrency if proposer else None, "temperature": temperature,
                             "max_tokens": max_tokens,
                             **{k: v for k, v in processing.items() if k not in ("logit_bias", "guided")},
                             "guided": None if processing["guided"] is None else {
                                 "kind": processing["guided"].kind, **{k: v for k, v in
                                                                     dataclasses.asdict(processing["guided"]).items()
                                                                     if v not in (None, False)}},
                             "logit_bias": {str(t): b for t, b in (logit_bias or {}).items()} or None,
                             "fp8_matmul": fp8_matmul, "device": device, "num_prompts": num_prompts,
                             "cpu_kernels": cpu_kernels, "cpu_kernels_used": pipe.engine.target.packed_head is not None,
                             "cuda_kernels": cuda_kernels,
                             "batch_size": batch_size, "modes": mode_list, "profile": profile,
                             "datasets": list(datasets), "seed": seed, "created": timestamp()}
        results["machine"] = machine_info(torch.get_num_threads(), dtype)
        out_dir = Path(out)
        click.echo(markdown_table(results))  # first: a failed write below still leaves the run's result on stdout
        try:
            write_outputs(results, out_dir)
        except OSError as exc:  # a full disk after a long run: which file, the fix, and that the table is the result
            raise InvalidRequestError(cannot_write(exc.filename or f"the results to --out {out}", exc,
                                                   "rerun with another --out")
                                      + f"; the table above is this run's result (none of its files was written to "
                                        f"{out})") from None
        click.echo(f"wrote {out_dir}/results.json, results.md, tau_histogram.png, acceptance_by_position.png, speedup.png")
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM: one line, exit 130 / 143; results are written at the end
        from dflash_trt.interrupts import exit_stopped

        if bar is not None:
            bar.close()  # ends the progress line, so the message starts a line of its own
        exit_stopped(exc, lambda how: f"bench {how}; no results were written to {out} (an earlier run's files there "
                                      "are unchanged)")


def dedupe_datasets(datasets) -> tuple[str, ...]:
    """The --dataset values in order, each prompt set once: JSONL paths compare resolved (good.jsonl and
    ./good.jsonl are one file), the built-in names as given. One stderr warning line per dropped repeat."""
    from dflash_trt.bench.runner import DATASETS
    from dflash_trt.cli.common import drop_repeats

    return drop_repeats("--dataset", datasets, "file", "it runs once", DATASETS)
