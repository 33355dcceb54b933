"""`dflash-trt generate`: run DFlash (or autoregressive) generation on prompts."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from dflash_trt.cli.answers import AnswersInOrder, stopped_line
from dflash_trt.cli.common import (SEED_RANGE, guided_decoding_options, logits_processing_options, max_tokens_option,
                                   model_options, prefix_cache_options,
                                   temperature_option, top_k_option, top_p_option, tp_size_option)
from dflash_trt.runtime.stop_text import StopText
from dflash_trt.text import count, final_text


def encode_item(pipe, item, where: str | None = None) -> list[int]:
    """A prompts-file item: plain text (no chat template) or a list of chat messages (template);
    `where` ("FILE:LINE") names it in the error of messages for a target without a chat template."""
    from dflash_trt.training.prompts import encode_prompt

    if isinstance(item, str):
        return pipe.encode(item)
    return encode_prompt(pipe.tokenizer, item, f"the target at {pipe.target_path}", where)


def logprobs_json(pipe, logprobs) -> list[dict]:
    """`--json`'s "logprobs": per token {"token_id", "token" (its text), "logprob", "bytes" (its UTF-8 bytes, as
    OpenAI's chat logprobs: a token holding part of a character has text "\ufffd", its bytes say which part),
    "top_logprobs": [{"token_id", "token", "logprob", "bytes"}, ...]} (natural logs, the target's raw distribution;
    `dflash_trt.runtime.logprobs`)."""
    from dflash_trt.serve.logprobs import LogprobFormatter

    fmt = LogprobFormatter(pipe.tokenizer)

    def entry(token_id: int, logprob: float) -> dict:
        return {"token_id": token_id, "token": fmt.text(token_id), "logprob": logprob, "bytes": fmt.bytes(token_id)}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in logprobs]


def prompt_header(index: int, total: int) -> str:
    """The stdout line before the plain-text answer to prompt `index` (0-based) of `total`, so that the
    answers of several prompts can be told apart; "" for a single prompt (its output is the answer alone)."""
    return f"=== prompt {index + 1}/{total} ===" if total > 1 else ""


@click.command()
@model_options
@click.option("--prompt", default=None, help="A plain-text prompt (no chat template).")
@click.option("--chat", default=None, help="A user message, wrapped in the target's chat template.")
@click.option("--prompts-file", type=click.Path(), default=None, help='JSONL of {"prompt": ...} or {"messages": [...]}.')
@click.option("--max-tokens", default=256, show_default=True, type=int, callback=max_tokens_option,
              help="Completion tokens at most, >= 1 (fewer when the target's context fills up first).")
@click.option("--temperature", default=0.0, show_default=True, type=float, callback=temperature_option,
              help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float, callback=top_p_option, help="In (0, 1]; 1 = off.")
@click.option("--top-k", default=0, show_default=True, type=int, callback=top_k_option, help="0 = off.")
@logits_processing_options
@guided_decoding_options
@click.option("--seed", default=None, type=SEED_RANGE,
              help="RNG seed for sampling (a 64-bit integer): prompt i of --prompts-file samples with seed + i, so "
                   "repeated prompts sample differently and each reproducibly; unset: a random one per prompt.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1, 256), help="Prompts decoded together.")
@tp_size_option("generate", "rank 0 prints")
@prefix_cache_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per prompt instead of streaming text (its times count from the start "
                   "of the batch: requests of one batch share the time to first token).")
@click.option("--bad-word", "bad_words", multiple=True, metavar="WORD",
              help="A word the answer never holds (vLLM's bad_words: its tokens, as written and after a space, "
                   "cannot complete in the output). Repeat for several.")
@click.option("--stop", "stops", multiple=True, metavar="TEXT",
              help="A stop string: the answer ends before it (OpenAI's and vLLM's stop; the token that completes it "
                   "is the last one generated). Repeat for several. A newline: bash's $'\\n' (\"\\n\" is a backslash "
                   "and an n).")
@click.option("--logprobs", "num_logprobs", default=None, type=click.IntRange(0, 20), metavar="N",
              help="With --json: each token's log-probability under the target (raw, before temperature / top-k / "
                   "top-p), its UTF-8 bytes and its N most likely alternatives, as \"logprobs\" (0: the token's own only).")
def generate(target, drafter, bundle, fp8_matmul, prompt, chat, prompts_file, max_tokens, temperature, top_p, top_k,
             min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens, json_schema,
             json_object, regex, grammar, seed, block_size,
             max_draft_len, draft_confidence, tree_topk, prompt_lookup, max_concurrency, mode, dtype, device, batch_size,
             threads, cpu_kernels, cuda_kernels, tp_size, enable_prefix_caching, prefix_cache_gb, bad_words, stops,
             as_json, num_logprobs):
    """Generate text with DFlash speculative decoding and report acceptance statistics.

    Answers go to stdout (with several prompts, each after its own "=== prompt i/N ===" line), their
    statistics to stderr; each is written as soon as it and every answer before it are finished, so that
    Ctrl-C or SIGTERM keeps the answers written (its stderr line says how many, and where the rest start)."""
    from dflash_trt.cli.common import (check_argv_text, check_context, check_draft_lengths, check_logit_bias_ids,
                                       jsonl_file, load_models, compile_guided, guided_decoding, logits_processing,
                                       note_max_concurrency, prompt_file_lines, set_threads, use_prefix_cache,
                                       warn_block_size, warn_escaped_stops,
                                       warn_draft_flags_unused, warn_float16_on_cpu, warn_sampling_unused,
                                       warn_training_target, warn_tree_unused, warn_untrained_drafter)
    from dflash_trt.errors import ConfigError
    from dflash_trt.interrupts import exit_stopped
    from dflash_trt.runtime.sampling import SamplingParams, offset_seed

    given = [x is not None for x in (prompt, chat, prompts_file)]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of --prompt, --chat, --prompts-file")
    for flag, text in (("--prompt", prompt), ("--chat", chat)):
        if text is not None and not text.strip():  # as a prompts file's line is refused
            raise click.UsageError(f"{flag} is {'empty' if text == '' else 'only whitespace'}; give some text")
    check_argv_text("--prompt", prompt)
    check_argv_text("--chat", chat)
    if any(not w for w in bad_words):
        raise click.BadParameter("a word is empty; give the words the answer must not hold", param_hint="'--bad-word'")
    if any(not s for s in stops):
        raise click.BadParameter("a stop string is empty, which would stop before any text; remove it",
                                 param_hint="'--stop'")
    for text in stops:
        check_argv_text("--stop", text)
    warn_escaped_stops(stops)
    if num_logprobs is not None and not as_json:
        raise click.UsageError("--logprobs prints the log-probabilities in --json's objects: add --json")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=seed,
                            logprobs=num_logprobs, stop=stops or None, **logits_processing(max_tokens, min_p, repetition_penalty,
                                                                       presence_penalty, frequency_penalty, logit_bias,
                                                                       min_tokens),
                            guided=guided_decoding(json_schema, json_object, regex, grammar, min_tokens))
    from dflash_trt.training.prompts import REQUEST_KEYS, load_prompts_jsonl

    warn_tree_unused(tree_topk, temperature)
    warn_sampling_unused(temperature, top_p, top_k, seed, min_p)
    warn_float16_on_cpu(dtype, device)
    check_draft_lengths(prompt_lookup, max_draft_len, block_size, mode == "dflash", target, drafter, bundle)
    warn_draft_flags_unused(mode == "dflash", block_size, max_draft_len, draft_confidence, tree_topk, prompt_lookup,
                            max_concurrency)
    items = load_prompts_jsonl(jsonl_file("--prompts-file", prompts_file), REQUEST_KEYS) if prompts_file else (
        [prompt] if prompt is not None else [[{"role": "user", "content": chat}]])
    set_threads(threads)
    try:
        pipe = load_models(target, drafter, bundle, dtype, block_size, mode == "dflash", max_draft_len=max_draft_len,
                           fp8_matmul=fp8_matmul, device=device, draft_confidence=draft_confidence,
                           cpu_kernels=cpu_kernels, cuda_kernels=cuda_kernels, tree_topk=tree_topk,
                           prompt_lookup=prompt_lookup, max_concurrency=max_concurrency,
                           **({"tp_size": tp_size} if tp_size > 1 else {}))
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM while the models load: generate's line (nothing written)
        exit_stopped(exc, lambda how: f"generate {how} while loading the models; nothing was written to stdout")
    if tp_size > 1:
        import torch.distributed as dist

        if dist.get_rank() != 0:  # every rank decodes the same tokens; rank 0 alone reports them
            import os

            sys.stdout = sys.stderr = open(os.devnull, "w")
    if chat is not None and not getattr(pipe.tokenizer, "chat_template", None):
        raise ConfigError(f"the target at {pipe.target_path} has no chat template, so --chat cannot be used; drop --chat "
                          "(use --prompt for plain text) or use a target with a chat template")
    check_logit_bias_ids(logit_bias, pipe.engine.target.config.vocab_size)
    if bad_words:
        from dflash_trt.runtime.penalties import bad_word_ids

        params = dataclasses.replace(params, bad_words=bad_word_ids(
            bad_words, lambda w: pipe.tokenizer.encode(w, add_special_tokens=False)))
    compile_guided(pipe.engine.grammars, params.guided)
    warn_block_size(pipe)
    warn_untrained_drafter(pipe)
    warn_training_target(pipe)
    use_prefix_cache(pipe, enable_prefix_caching, prefix_cache_gb)  # batches after the first reuse what it read
    lines = prompt_file_lines(prompts_file) if prompts_file else None  # each prompt's line in the file
    wheres = [f"{prompts_file}:{n}" for n in lines] if prompts_file else [None] * len(items)
    prompts = [encode_item(pipe, it, where) for it, where in zip(items, wheres)]
    if prompts_file:  # a prompt too long for the context is named by its file and line
        limit = pipe.engine.context_len - 1
        check_context(pipe, prompts, max_tokens, wheres, f"shorten it to at most {limit} tokens or remove that line")
    else:
        check_context(pipe, prompts, max_tokens)
    if mode == "dflash":
        note_max_concurrency(pipe, batch_size, len(prompts))
    stream = not as_json and len(prompts) == 1
    shown = StopText(pipe.decode, params.stop or (), min_tokens=params.min_tokens)  # the streamed answer so far

    def on_tokens(_i, toks, *_logprobs):
        shown.add(toks)  # complete characters only, none that may start a stop string
        new = shown.delta()
        if new:
            sys.stdout.write(new)
            sys.stdout.flush()

    def write(index: int, res) -> None:  # answer `index` (and its stats line), flushed
        m = res.metrics
        text = final_text(res.text, res.finish_reason)
        if as_json:
            out = {"text": text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                   "stop_reason": res.stop_reason, "metrics": m.to_dict()}
            if res.logprobs is not None:
                out["logprobs"] = logprobs_json(pipe, res.logprobs)
            click.echo(json.dumps(out))
            return
        if not stream:
            header = prompt_header(index, len(prompts))
            if header:
                click.echo(header)
            click.echo(text)
        else:  # what was held back (a character completed by the last tokens; one cut by length is dropped)
            click.echo(text[len(shown.sent):])
        rate = f"acceptance rate={m.acceptance_rate:.2f}" if m.drafted_tokens else "no drafts"
        drafting = f"tau={m.acceptance_length:.2f}, {rate}, " if mode == "dflash" else ""  # ar drafts nothing
        click.echo(
            f"[{mode}] {count(m.completion_tokens, 'token')}, finish={res.finish_reason}, {drafting}"
            f"TTFT={m.time_to_first_token_s * 1000:.0f} ms, {m.tokens_per_s:.1f} tok/s", err=True)

    # each answer is written as soon as it and those before it are finished (batches run in order)
    answers = AnswersInOrder(write)
    plist = [dataclasses.replace(params, seed=offset_seed(seed, i)) for i in range(len(prompts))]
    try:
        for lo in range(0, len(prompts), batch_size):
            chunk = prompts[lo : lo + batch_size]
            try:
                pipe.generate(chunk, plist[lo : lo + batch_size], mode, on_tokens if stream else None,
                              on_finished=lambda j, res, lo=lo: answers.finished(lo + j, res))
            except BaseException:  # a failure mid-stream: end the partial answer's line, so the error starts its own
                if not answers.written and shown.sent and not shown.sent.endswith("\n"):
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                raise
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM: the answers written stay; a line says how many; 130 / 143
        exit_stopped(exc, lambda how: stopped_line(how, answers.written, len(prompts), stream and bool(shown.sent),
                                                   prompts_file, lines))
