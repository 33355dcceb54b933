"""`dflash-trt serve`: an OpenAI-compatible HTTP server (trtllm-serve's endpoints and metrics) over the
DFlash runtime (`dflash_trt.serve`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dflash_trt.cli.common import check_port, model_options, prefix_cache_options, tp_size_option


def _check_config_flags(config: dict, given: dict) -> None:
    """An option set both by --config and on the command line must have one value; the config's ignored keys are
    named on stderr.

    Raises:
        click.UsageError: the command line's value differs from the config's (naming both)."""
    ctx = click.get_current_context()
    if given["bundle"] is not None and "drafter" in config["options"]:
        raise click.UsageError(f"--config {config['path']} names a drafter (speculative_config.speculative_model) and "
                               "--bundle holds one; give the bundle's trtllm/serve.yaml with --target (its "
                               "trtllm/target), or --bundle without --config")
    for name, value in config["options"].items():
        source = ctx.get_parameter_source(name)
        if name == "drafter":  # the same folder however written
            same = given[name] is not None and Path(given[name]).resolve() == Path(value).resolve()
        else:  # max_concurrency: N parsed to an int on the command line, the config's kept as text
            same = str(given[name]) == str(value)
        if source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT) and not same:
            flag = "--" + name.replace("_", "-")
            raise click.UsageError(f"{flag} {given[name]} disagrees with --config {config['path']}, which sets it to "
                                   f"{value}; give one of them")
    if config["ignored"]:
        print(f"--config {config['path']}: TensorRT-LLM's {', '.join(config['ignored'])} set its speed or GPU memory "
              "use, not its answers: they do not apply to dflash-trt serve", file=sys.stderr, flush=True)


def _model_name(value: str | None) -> str | None:
    """--served-model-name: None (the default name) or a name that is not blank (clients must send it as `model`).

    Raises:
        click.BadParameter: a blank name."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"{value!r} is blank: clients could not name it; give a name, or leave the option out "
                                 "to serve as the bundle's or the target folder's name")
    return value


def _read_config(ctx: click.Context, param, value):
    """--config: the trtllm-serve YAML's settings become the defaults of serve's options (click's default_map;
    an option also given on the command line must agree, checked in `serve`)."""
    if value is None:
        return None
    from dflash_trt.cli.trtllm_config import read_serve_config
    from dflash_trt.errors import ConfigError

    try:
        options, checked, ignored = read_serve_config(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"--config {value}: "), ctx, param) from None
    from dflash_trt.cli.trtllm_config import SERVE_OPTIONS

    params = {p.name: p for p in ctx.command.params}
    for name, v in options.items():  # out of the option's range: named as the config's key, not as a flag not given
        try:
            params[name].type.convert(v, params[name], ctx)
        except click.BadParameter as exc:
            key = next(k for k, n in SERVE_OPTIONS.items() if n == name and (n != "prefill_chunk_size" or
                                                                              k == "max_num_tokens"))
            raise click.BadParameter(f"{key} is {v}: {exc.message} (serve's {params[name].opts[0]})", ctx,
                                     param) from None
    ctx.default_map = {**(ctx.default_map or {}), **options}
    return {"path": value, "options": options, "checked": checked, "ignored": ignored}


@click.command()
@click.option("--config", "--extra_llm_api_options", "config", type=click.Path(exists=True, dir_okay=False),
              is_eager=True, expose_value=True, callback=_read_config, metavar="FILE",
              help="A trtllm-serve YAML config (TensorRT-LLM's LLM API options, `trtllm-serve --config`; a bundle's "
                   "trtllm/serve.yaml): each of its settings that serve also has becomes that option's value "
                   "(tensor_parallel_size, max_batch_size, max_seq_len, speculative_config's max_draft_len, speculative_model, "
                   "max_concurrency, kv_cache_config.enable_block_reuse (on when left out, as TensorRT-LLM), enable_chunked_prefill "
                   "with max_num_tokens, "
                   "dtype); TensorRT-LLM's speed and memory knobs are named as not applying; a setting serve does not "
                   "implement is refused. A flag given too must agree with it.")
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port (0: any free one).")
@click.option("--served-model-name", default=None, callback=lambda ctx, param, value: _model_name(value),
              help="The model name clients pass as `model` (default: the bundle's or the target folder's name).")
@click.option("--max-batch-size", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Sequences decoded together at most (in-flight batching: waiting requests join the running "
                   "batch between decode steps).")
@click.option("--prefill-chunk-size", default=None, type=click.IntRange(1), metavar="N",
              help="Chunked prefill (TensorRT-LLM's enable_chunked_prefill): a request joining the running batch has "
                   "N prompt tokens read per decode step, so a long prompt delays the running streams by one chunk "
                   "per step instead of its whole prefill. Default: off (the whole prompt, before the next step).")
@click.option("--max-seq-len", default=None, type=click.IntRange(2), metavar="N",
              help="A request's prompt + output tokens at most (trtllm-serve's --max_seq_len), up to the target's "
                   "context: longer prompts are refused and max_tokens fitted to it as to the context. Default: the "
                   "target's context (max_position_embeddings).")
@prefix_cache_options
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"], case_sensitive=False),
              default="info", show_default=True, help="uvicorn's log level (one access line per request at info).")
@click.option("--tool-parser", type=click.Choice(["hermes", "qwen3", "llama3_json"], case_sensitive=False),
              default=None,
              help="The target's tool-call format, for tool_choice \"auto\" (vLLM's --tool-call-parser, trtllm-serve's "
                   "--tool_parser): hermes (alias qwen3) reads <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> "
                   "(Hermes 2 Pro, Qwen2.5, Qwen3); llama3_json an answer made of {\"name\": ..., \"parameters\": ...} "
                   "objects (Llama 3.1-3.3). Default: none, and \"auto\" is refused; tool_choice \"required\" and named "
                   "functions work with any target (guided decoding).")
@click.option("--reasoning-parser", type=click.Choice(["deepseek-r1", "qwen3"], case_sensitive=False), default=None,
              help="Split a reasoning model's <think>...</think> into message.reasoning_content (trtllm-serve's "
                   "--reasoning_parser, vLLM's --reasoning-parser): deepseek-r1 (the answer starts inside the "
                   "reasoning) or qwen3 (reasoning where the answer writes <think>). Default: none, the answer is the "
                   "content.")
@click.option("--api-key", envvar="DFLASH_TRT_API_KEY", default=None, metavar="KEY",
              help="Require `Authorization: Bearer KEY` on the /v1 endpoints (vLLM's --api-key; the openai client's "
                   "api_key); also read from DFLASH_TRT_API_KEY. /health, /health_generate, /version and the metrics stay open. "
                   "Default: none, every request is served.")
@click.option("--perf-metrics-max-requests", default=0, show_default=True, type=click.IntRange(0), metavar="N",
              help="Keep the per-request metrics of the last N finished requests for GET /perf_metrics (TensorRT-LLM's "
                   "perf_metrics_max_requests; each record returned once): arrival, scheduling, first and last token "
                   "times, draft and accepted tokens. 0: none kept.")
@tp_size_option("serve", "rank 0 serves HTTP and the other ranks decode every batch with it")
def serve(config, target, drafter, bundle, fp8_matmul, block_size, max_draft_len, draft_confidence, tree_topk, prompt_lookup,
          max_concurrency, mode, dtype, device, threads, cpu_kernels, cuda_kernels, host, port, served_model_name,
          max_batch_size, prefill_chunk_size, max_seq_len, enable_prefix_caching, prefix_cache_gb, log_level, tool_parser, reasoning_parser, api_key,
          perf_metrics_max_requests, tp_size):
    """Serve the target with DFlash over an OpenAI-compatible HTTP API.

    Endpoints as trtllm-serve: /v1/completions, /v1/chat/completions (streaming too), /v1/responses,
    /v1/models, /health, /health_generate (a one-token generation: 200 "Generation health check OK"), /version,
    /metrics (iteration stats, JSON), /perf_metrics (per-request metrics, JSON), /prometheus/metrics (trtllm_
    metrics, Prometheus text).
    Greedy requests (temperature 0) return exactly the target's own greedy output."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise click.ClickException(f"dflash-trt serve needs {exc.name}, which is not installed: "
                                   "pip install 'dflash-trt[serve]' (make install includes it)") from None
    from dflash_trt.cli.common import (check_draft_lengths, load_models, set_threads, use_prefix_cache, warn_block_size,
                                       warn_draft_flags_unused, warn_float16_on_cpu, warn_training_target,
                                       warn_untrained_drafter)
    from dflash_trt.serve.app import create_app

    import os

    if api_key is None and "DFLASH_TRT_API_KEY" in os.environ:  # set but empty: click reads that as unset
        api_key = os.environ["DFLASH_TRT_API_KEY"]
    if api_key is not None and (not api_key.strip() or not api_key.isprintable() or api_key != api_key.strip()):
        raise click.UsageError("--api-key (or DFLASH_TRT_API_KEY) is empty, holds control characters, or starts or ends "
                               "with blanks (an HTTP header cannot carry those); give the key clients send, or leave it "
                               "out to serve without one")
    if config is not None:
        _check_config_flags(config, locals())
    check_port(host, port)
    warn_float16_on_cpu(dtype, device)
    check_draft_lengths(prompt_lookup, max_draft_len, block_size, mode == "dflash", target, drafter, bundle)
    if config is not None and mode == "ar":  # the config's speculative settings: not the user's flags, no warning
        source = click.get_current_context().get_parameter_source
        if source("max_draft_len") == click.core.ParameterSource.DEFAULT_MAP:
            max_draft_len = None
        if source("max_concurrency") == click.core.ParameterSource.DEFAULT_MAP:
            max_concurrency = "auto"
    warn_draft_flags_unused(mode == "dflash", block_size, max_draft_len, draft_confidence, tree_topk, prompt_lookup,
                            max_concurrency)
    set_threads(threads)
    tp_config = None  # the YAML that set tp_size, for the errors about it
    if config is not None and click.get_current_context().get_parameter_source("tp_size") == \
            click.core.ParameterSource.DEFAULT_MAP:
        tp_config = config["path"]
    pipe = load_models(target, drafter, bundle, dtype, block_size, mode == "dflash", tp_config=tp_config,
                       max_draft_len=max_draft_len,
                       fp8_matmul=fp8_matmul, device=device, draft_confidence=draft_confidence,
                       cpu_kernels=cpu_kernels, cuda_kernels=cuda_kernels, tree_topk=tree_topk,
                       prompt_lookup=prompt_lookup, max_concurrency=max_concurrency,
                       **({"tp_size": tp_size} if tp_size > 1 else {}))
    use_prefix_cache(pipe, enable_prefix_caching, prefix_cache_gb)
    if max_seq_len is not None:  # every rank: the same stops at the context's end
        own = pipe.engine.context_len
        if max_seq_len > own:
            raise click.UsageError(f"--max-seq-len {max_seq_len} is more than the target's context of {own} tokens "
                                   f"(max_position_embeddings); give at most {own}, or leave it out")
        pipe.engine.max_seq_len = max_seq_len
    if config is not None and mode == "dflash":
        from dflash_trt.cli.trtllm_config import check_drafter

        dcfg = pipe.engine.proposer.drafter.config
        check_drafter(config["checked"], dcfg.mask_token_id, dcfg.target_layer_ids, config["path"])
    if tp_size > 1:
        import torch.distributed as dist

        if dist.get_rank() != 0:  # a follower: runs rank 0's batch operations in lockstep, answers nothing itself
            import signal

            from dflash_trt.runtime.decode_batch import DecodeBatch
            from dflash_trt.serve.lockstep import follow

            # Ctrl-C reaches every rank, and torchrun passes the SIGTERM it gets (kill, docker stop, systemd) on to
            # every rank: a follower stays until rank 0 has shut down (aborting what it was decoding with it) and
            # sends the stop; torchrun kills it if rank 0 is gone
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            follow(lambda: DecodeBatch(pipe.engine, mode, prefill_chunk_size))
            return
    warn_block_size(pipe)
    warn_untrained_drafter(pipe)
    warn_training_target(pipe)
    name = served_model_name or (Path(bundle).resolve().name if bundle is not None else pipe.target_path.name)
    app = create_app(pipe, name, mode, max_batch_size, lockstep=tp_size > 1, prefill_chunk=prefill_chunk_size,
                     tool_parser=tool_parser, reasoning_parser=reasoning_parser, api_key=api_key,
                     perf_metrics_max_requests=perf_metrics_max_requests)
    what = f"drafter {pipe.drafter_path}" if pipe.drafter_path is not None else "no drafter (mode ar)"
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    where = f"http://{shown}:{port}" if port else f"{host}, on a free port (uvicorn's line below names it)"
    key = ", an API key required" if api_key is not None else ""
    print(f"serving {name!r} ({pipe.target_path}, {what}) on {where} (OpenAI API under /v1{key})", file=sys.stderr,
          flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # Ctrl-C / SIGTERM: running and queued requests end now ("abort"),
            app.state.scheduler.abort_all()  # so the graceful shutdown waits for no long stream
            super().handle_exit(sig, frame)

    try:
        Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower())).run()
    except KeyboardInterrupt:  # re-raised by uvicorn after its graceful shutdown (as uvicorn.run swallows it)
        pass
