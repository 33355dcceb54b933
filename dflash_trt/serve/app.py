"""The OpenAI-compatible HTTP server (FastAPI), with trtllm-serve's endpoints:

- `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI API; `stream: true` sends
  server-sent events ending with `data: [DONE]`), `GET /v1/models`;
- `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` (OpenAI's
  Responses API, answered by the chat pipeline: `dflash_trt.serve.responses`);
- `GET /health` (200 once the model is loaded; 503 once the generation thread has stopped), `GET /health_generate` (200 "Generation health check OK" after a
  one-token generation, 500 "Generation health check failed: ..." when it fails, as trtllm-serve's, without a Content-Type),
  `GET /version`;
- `GET /metrics` (iteration stats, JSON), `GET /perf_metrics` (per-request metrics, JSON) and
  `GET /prometheus/metrics` (Prometheus text): `dflash_trt.serve.metrics`.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(malformed JSON, a field of the wrong type or out of range, a prompt too long for the context, an
unsupported field), 404 for another model name, 500 when generation itself fails. The server keeps
serving after any of them. Each choice also carries a non-standard `metrics` object (the runtime's
`RequestMetrics.to_dict()`: acceptance length tau, acceptance rate, draft / accepted tokens, times)
plus its `queue_time_s`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager

from starlette.requests import Request

from dflash_trt.errors import ConfigError, DFlashError, InvalidRequestError, PromptTooLongError
from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.serve.chat import ChatAnswers
from dflash_trt.serve.metrics import ServerMetrics
from dflash_trt.serve.protocol import (UNSUPPORTED, ChatCompletionRequest, CompletionRequest, check_request_nesting,
                                       fit_context, jsonable)
from dflash_trt.serve.responses import (ResponseEvents, ResponseNotFound, ResponsesRequest, ResponseStore,
                                        as_responses_error, assistant_messages, listed_items, new_id, response_object,
                                        usage_of, whole_response)
from dflash_trt.runtime.stop_text import StopText
from dflash_trt.serve.scheduler import Scheduler, Sequence

logger = logging.getLogger("dflash_trt.serve")

#: OpenAI's default max_tokens for /v1/completions.
COMPLETIONS_MAX_TOKENS = 16


#: how often a non-streaming request checks whether its client is still connected (seconds)
DISCONNECT_POLL_S = 0.5
#: the largest request body taken (Content-Length); a prompt that fits any context is far smaller
MAX_BODY_BYTES = 16 * 2**20


class ModelNotFound(DFlashError):
    """The request names a model this server does not serve (HTTP 404)."""


#: the status logged for a request whose client disconnected before its answer (nginx's 499 "client closed
#: request"; no client receives it)
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client of a non-streaming request disconnected: its sequences are aborted, nothing is sent."""


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object; `code` is a string or null as there (the HTTP status is the response's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


#: request fields an error message may start with (its `param`)
FIELDS = ("max_completion_tokens", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop_token_ids",
          "stop", "stream_options", "messages", "prompt", "model", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "min_tokens", "min_p", "prompt_ignore_length") + tuple(UNSUPPORTED)


def param_of(message: str) -> str | None:
    """The request field an error message is about, when it starts with one (OpenAI's `param`; "logit_bias[504]
    must be ..." is about logit_bias)."""
    return next((f for f in FIELDS if message.startswith(f) and message[len(f):len(f) + 1] in (" ", "=", ":", ".", "[")),
                None)


def _status_of(exc: BaseException) -> tuple[int, dict]:
    if isinstance(exc, ModelNotFound):
        return 404, error_body(str(exc), code="model_not_found", param="model")
    if isinstance(exc, ResponseNotFound):
        return 404, error_body(str(exc), code="response_not_found", param=exc.param)
    if isinstance(exc, (InvalidRequestError, ConfigError, PromptTooLongError)):
        return 400, error_body(str(exc), param=exc.param or param_of(str(exc)), code=getattr(exc, "code", None))
    return 500, error_body(f"generation failed: {exc}", kind="server_error")


def create_app(pipe, model_name: str, mode: str = "dflash", max_batch_size: int = 8, lockstep: bool = False,
               prefill_chunk: int | None = None, tool_parser: str | None = None, reasoning_parser: str | None = None,
               api_key: str | None = None, perf_metrics_max_requests: int = 0):
    """The FastAPI app serving `pipe` (a `dflash_trt.api.Pipeline`) under `model_name`.

    Args:
        pipe: the loaded pipeline (target, drafter, tokenizer).
        model_name: the name clients pass as `model` (GET /v1/models lists it); a request may also omit it.
        mode: "dflash" (speculative) or "ar" (the target alone).
        max_batch_size: sequences decoded together at most (in-flight batching, `Scheduler`).
        lockstep: rank 0 of a tensor-parallel target: every batch operation and decision is broadcast to the other
            ranks, which run `dflash_trt.serve.lockstep.follow` (stopped at the app's shutdown).
        prefill_chunk: chunked prefill: prompt positions read per decode step while requests join the batch
            (`DecodeBatch`), or None: a joining request's whole prompt is read before the next step.
        tool_parser: the target's tool-call format for tool_choice "auto" (`dflash_trt.serve.tools.TOOL_PARSERS`),
            or None: "auto" is refused.
        reasoning_parser: splits chat answers into reasoning_content and content
            (`dflash_trt.serve.reasoning.REASONING_PARSERS`), or None: the answer is the content.
        api_key: the key the /v1 endpoints require (`RequireApiKey`), or None: none.
        perf_metrics_max_requests: finished sequences whose per-request metrics GET /perf_metrics keeps (the
            latest; `ServerMetrics`), 0: none.
    Returns:
        a FastAPI app; its generation thread starts now and stops at the app's shutdown.
    """
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    import dflash_trt

    tokenizer_lock = threading.Lock()  # fast tokenizers must not be used from two threads at once
    context_len = pipe.engine.context_len
    # what the context's bound is called in a refusal: the server's --max-seq-len where it is below the target's
    capped = pipe.engine.max_seq_len is not None and pipe.engine.max_seq_len < pipe.engine.target.config.max_position_embeddings
    context_name = "the server's max_seq_len" if capped else "the target's context"
    created = int(time.time())

    def decode(ids: list[int]) -> str:
        with tokenizer_lock:
            return pipe.decode(ids)

    from dflash_trt.serve.logprobs import LogprobFormatter

    formatter = LogprobFormatter(pipe.tokenizer, tokenizer_lock)

    metrics: ServerMetrics | None = None

    def open_batch():
        return DecodeBatch(pipe.engine, mode, prefill_chunk)

    if lockstep:
        from dflash_trt.serve.lockstep import leader

        open_batch = leader(open_batch)
    scheduler = Scheduler(open_batch, max_batch_size, lambda stats: metrics.iteration(stats),
                          lambda s, r: metrics.finished(r, s.queue_time_s, s.arrival, (s.first_iter, s.last_iter)),
                          lambda s: metrics.cancelled_in_queue(s.queue_time_s))
    metrics = ServerMetrics(model_name, lambda: scheduler.running, lambda: scheduler.waiting,
                            prefix_cache=(lambda: pipe.engine.prefix_cache) if pipe.engine.prefix_cache is not None else None,
                            perf_metrics_max_requests=perf_metrics_max_requests, max_batch_size=max_batch_size,
                            device=str(pipe.engine.device), speculative=mode == "dflash")

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()
        if lockstep:
            from dflash_trt.serve.lockstep import stop_followers

            stop_followers()

    app = FastAPI(title="dflash-trt", version=dflash_trt.__version__, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, context_len=context_len)
    app.add_middleware(ServerErrors)
    if api_key is not None:
        app.add_middleware(RequireApiKey, key=api_key)  # a request without the key is read no further
    app.add_middleware(CountErrors, metrics=metrics)  # the outermost: sees every status, the 401s included

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        loc = [str(x) for x in (errors[0].get("loc", ()) if errors else ()) if x not in ("body", "query", "path")]
        if errors and errors[0].get("type") == "json_invalid":
            loc = []  # its loc is the character position, not a field
        code = responses_error_code(errors[0]) if errors and loc and request.url.path == "/v1/responses" else None
        return JSONResponse(error_body(validation_message(errors, request.url.path), param=loc[0] if loc else None,
                                       code=code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):  # 404 / 405 / an unparsable body: OpenAI's body too
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in detail and isinstance(exc.__cause__, RecursionError):
            detail = ("the body's JSON is nested too deeply to parse (arrays or objects nested hundreds of levels deep); "
                      "send one JSON object with Content-Type: application/json")
        elif exc.status_code == 400 and "parsing the body" in detail and "integer string conversion" in str(exc.__cause__):
            detail = ("the body holds an integer of more digits than Python reads (4300); no field takes one that long: "
                      "send each number within its field's range")
        elif exc.status_code == 400 and "parsing the body" in detail:
            detail = "the body could not be parsed (not UTF-8 JSON?); send one JSON object with Content-Type: application/json"
        elif exc.status_code == 404:
            detail = (f"no endpoint {request.method} {request.url.path}; this server has /v1/completions, "
                      "/v1/chat/completions, /v1/responses, /v1/responses/{id} (GET, DELETE), "
                      "/v1/responses/{id}/input_items, /v1/models, /v1/models/{name}, /health, /health_generate, "
                      "/version, /metrics, /perf_metrics, "
                      "/prometheus/metrics")
        elif exc.status_code == 405:  # the methods of every route of this path (Starlette's names the first's)
            methods = {m for r in request.app.router.routes if getattr(r, "methods", None)
                       and r.path_regex.match(request.url.path) for m in r.methods}
            allowed = ", ".join(sorted(methods)) or (exc.headers or {}).get("Allow")
            exc.headers = {**(exc.headers or {}), "Allow": allowed} if allowed else exc.headers
            detail = f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
        return JSONResponse(error_body(detail), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _client_gone(request, exc: ClientGone):  # a normal abort: no traceback in the log (`ServerErrors`
        return Response(status_code=CLIENT_CLOSED)       # logs one); nobody reads this

    @app.exception_handler(DFlashError)
    async def _dflash_error(request, exc: DFlashError):
        status, body = _status_of(exc)
        return JSONResponse(body, status_code=status)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            shown = repr(name) if len(name) <= 200 else repr(name[:200]) + f" (cut; {len(name)} characters)"
            raise ModelNotFound(f"the model {shown} does not exist on this server; it serves {model_name!r} "
                                "(GET /v1/models)")

    def encode_text(text: str, what: str) -> list[int]:
        from dflash_trt.api import check_text

        check_text(text, what)
        with tokenizer_lock:
            return pipe.encode(text)

    vocab = pipe.engine.target.config.vocab_size
    eos = tuple(pipe.engine.eos_token_ids)

    def check_ids(ids: list[int], what: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{what} holds token id {bad}, outside the vocabulary [0, {vocab})")
        return ids

    async def run(req, prompts: list[list[int]], max_tokens: list[int], score_only: bool = False):
        """Queue n sequences per prompt; return (sequences, the asyncio queue their events go to)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        stops = req.stop_strings()
        bad = None
        if req.bad_words:
            from dflash_trt.runtime.penalties import bad_word_ids

            with tokenizer_lock:
                try:
                    bad = bad_word_ids(req.bad_words, lambda w: pipe.tokenizer.encode(w, add_special_tokens=False))
                except InvalidRequestError as exc:
                    raise InvalidRequestError(str(exc), param="bad_words") from None
        params_of = [[req.sampling_params(mt, eos, vocab, j, bad) for j in range(req.n)] for mt in max_tokens]
        # the stop tokens a stop_reason names: the request's own, but an EOS among them is an EOS (null), as vLLM's
        own_stops = tuple(t for t in req.stop_token_ids or () if req.ignore_eos or t not in eos)
        guided = params_of[0][0].guided
        if guided is not None:  # compiled here (cached), off the event loop: not on the generation thread
            try:
                await asyncio.to_thread(pipe.engine.grammars.compile, guided)
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), param=req.guided_param()) from None
        seqs = []
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                index = p * req.n + j
                params = params_of[p][j]

                text = StopText(decode, stops, token_aligned=req.stream and params.logprobs is not None,
                                min_tokens=params.min_tokens)

                def on_text(delta, logprobs=None, index=index, text=text):  # on the generation thread: the count now
                    loop.call_soon_threadsafe(events.put_nowait, (index, "text", (delta, logprobs, text.generated)))

                def on_done(result, error, index=index):
                    loop.call_soon_threadsafe(events.put_nowait, (index, "done", (result, error)))

                streamed = on_text if req.stream and not score_only else None  # scoring: its one token is dropped
                seqs.append(Sequence(ids, params, text, streamed, on_done, score_only=score_only,
                                     stop_token_ids=own_stops))
        scheduler.submit(seqs)
        return seqs, events

    async def collect(seqs, events, request: Request) -> list:
        """The results of every sequence; a client that disconnects meanwhile has its sequences aborted."""
        results: list = [None] * len(seqs)
        pending = len(seqs)
        try:
            while pending:
                try:
                    index, kind, payload = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise ClientGone() from None
                    continue
                if kind == "done":
                    result, error = payload
                    if error is not None:
                        raise error
                    results[index] = result
                    pending -= 1
        finally:
            for s in seqs:
                s.cancelled = True  # no-op for finished ones; ends the rest if this request is gone
        return results

    def responses_usage(ids: list[int], result, answers: ChatAnswers) -> dict:
        """A Response's usage: its prompt `ids`, its `result`'s tokens, cached and reasoning tokens."""
        return usage_of(len(ids), len(result.token_ids), result.metrics.cached_tokens,
                        answers.reasoning_tokens(result.token_ids, decode))

    def choice_metrics(seq: Sequence, result) -> dict:
        return {**result.metrics.to_dict(), "queue_time_s": seq.queue_time_s}

    def usage(prompts: list[list[int]], results, answers: ChatAnswers | None = None) -> dict:
        """OpenAI's usage of `prompts` and their choices' `results` (n per prompt, in order); with prefix caching,
        `prompt_tokens_details.cached_tokens`: per prompt, the tokens all of its choices reused; for a chat request
        (`answers`) on a server with a --reasoning-parser, `completion_tokens_details.reasoning_tokens`: the
        choices' reasoning tokens (`ChatAnswers.reasoning_tokens`, as the Responses usage counts them; vLLM reports
        it only with a reasoning parser too, and trtllm-serve not at all)."""
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(r.token_ids) for r in results)
        out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
        if pipe.engine.prefix_cache is not None:
            n = len(results) // len(prompts)
            cached = sum(min(r.metrics.cached_tokens for r in results[p * n : (p + 1) * n]) for p in range(len(prompts)))
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        if answers is not None and answers.parser is not None:
            out["completion_tokens_details"] = {
                "reasoning_tokens": sum(answers.reasoning_tokens(r.token_ids, decode) for r in results)}
        return out

    async def stream(req, seqs, events, prompts, chunk, path, first_delta=None, opening=None, answers=None):
        """Server-sent events: per choice an opening chunk, text deltas, a closing chunk with finish_reason;
        then (stream_options.include_usage) a usage chunk; then [DONE]. `chunk(index, text, finish,
        include_usage, logprobs)` builds one (logprobs: the TokenLogprobs it carries, or None). The opening
        chunk is `first_delta`'s (chat: the role; `chunk` may return None for it, and the role then rides on the
        choice's first delta: `ChatStream`), or `opening(index, include_usage)`'s (completions' echo: the prompt),
        sent at once, or, when the choice asks for logprobs, with its first tokens (the prompt's logprobs are read
        with the prompt). A failed generation ends the stream with an error chunk
        (a server error's traceback logged as `ServerErrors` logs one, `path` naming the endpoint).

        With `stream_options.continuous_usage_stats` (and include_usage, as vLLM and trtllm-serve read it) every
        choice chunk carries `usage` so far: its prompt's tokens and the tokens the choice has generated when the
        chunk was made (text held back for a possible stop string included; the closing chunk: the choice's
        `usage.completion_tokens`). `answers`: a chat request's (the usage chunk's reasoning tokens: `usage`)."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        unopened = set(range(len(seqs)) if opening is not None else ())

        def sse(obj, generated: int | None = None) -> str:
            if continuous and generated is not None:
                prompt_tokens = len(prompts[obj["choices"][0]["index"] // req.n])
                obj["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                                "total_tokens": prompt_tokens + generated}
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        async def open_choice(i: int) -> str:
            unopened.discard(i)
            return sse(await asyncio.to_thread(opening, i, include_usage), 0)  # a long prompt's text: off the loop

        results: list = [None] * len(seqs)
        pending = len(seqs)
        try:
            for i in range(len(seqs)):
                if first_delta is not None:
                    made = chunk(i, first_delta, None, include_usage, None)
                    if made is not None:  # None: the chat opening waits for its first delta (`ChatStream`)
                        yield sse(made, 0)
                elif i in unopened and seqs[i].params.logprobs is None:
                    yield await open_choice(i)
            while pending:
                index, kind, payload = await events.get()
                if kind == "text":
                    if index in unopened:
                        yield await open_choice(index)
                    delta, lps, generated = payload
                    made = chunk(index, delta, None, include_usage, lps)
                    if made is not None:  # None: nothing to send yet (`chunk`'s choice)
                        yield sse(made, generated)
                    continue
                result, error = payload
                pending -= 1
                if error is not None:
                    status, body = _status_of(error)
                    if status == 500:
                        log_failure("POST", path, error)
                    yield sse(body)
                    break
                if index in unopened:
                    yield await open_choice(index)
                results[index] = result
                rest = "" if seqs[index].score_only else seqs[index].text.rest(result.finish_reason)
                lps = seqs[index].rest_logprobs(result) if result.logprobs is not None else None
                last = chunk(index, rest, result.finish_reason, include_usage, lps)
                last["choices"][0]["stop_reason"] = result.stop_reason
                last["choices"][0]["metrics"] = choice_metrics(seqs[index], result)
                yield sse(last, len(result.token_ids))
            else:
                if include_usage:
                    yield sse({**chunk(0, "", None, False, None), "choices": [], "usage": usage(prompts, results, answers)})
            yield "data: [DONE]\n\n"
        finally:
            for s in seqs:
                s.cancelled = True

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and uptime checkers' probe
    async def health():
        if not scheduler.alive:  # trtllm-serve's /health is a 503 when its executor has stopped
            return PlainTextResponse("the generation thread has stopped: restart the server (its log says why)",
                                     status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        from dflash_trt.runtime.sampling import SamplingParams
        from dflash_trt.training.prompts import encode_prompt

        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def probe_prompt() -> list[int]:  # trtllm-serve's probe: the chat request "hi", greedy, one token
            with tokenizer_lock:
                if getattr(pipe.tokenizer, "chat_template", None):
                    return encode_prompt(pipe.tokenizer, [{"role": "user", "content": "hi"}])
                return pipe.encode("hi")

        # counted in the request metrics and iteration stats as any request, as trtllm-serve counts its probe (a
        # chat request through its chat endpoint)
        seq = Sequence(await asyncio.to_thread(probe_prompt), SamplingParams(max_tokens=1), StopText(decode),
                       lambda d: None, lambda r, e: loop.call_soon_threadsafe(done.set_result, (r, e)))
        scheduler.submit([seq])
        result, error = await done
        # trtllm-serve's answers, sent as it sends them: 200 "Generation health check OK", or 500 "Generation health
        # check failed: ..." (its status and text), with no Content-Type header (Starlette's Response without a
        # media type)
        if error is not None:
            logger.error("dflash-trt: GET /health_generate: the one-token generation failed", exc_info=error)
            return Response(f"Generation health check failed: {error}", status_code=500)
        if result.finish_reason == "abort":
            return Response("Generation health check failed: the server is shutting down", status_code=500)
        return Response("Generation health check OK")

    @app.get("/version")
    async def version():
        return {"version": dflash_trt.__version__}

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "dflash-trt",
            "max_model_len": context_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):  # OpenAI's "retrieve model" (the openai client's models.retrieve)
        check_model(name)
        return card

    @app.get("/metrics")
    async def iteration_stats():
        return metrics.iteration_stats()

    @app.get("/perf_metrics")
    async def perf_metrics():
        return metrics.perf_metrics()

    @app.get("/prometheus/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        req.unsupported()
        items = req.prompt_list()
        req.check_n(len(items))
        # tokenizing a long prompt takes a while: off the event loop, which keeps answering /health
        prompts = await asyncio.to_thread(
            lambda: [encode_text(x, f"prompt {i}") if isinstance(x, str) else check_ids(x, f"prompt {i}")
                     for i, x in enumerate(items)])
        want = req.max_tokens if req.max_tokens is not None else COMPLETIONS_MAX_TOKENS
        # max_tokens 0 with echo scores the prompt (OpenAI's legacy API, vLLM): the prompt and its logprobs,
        # no completion. The prefill's first token is generated (it costs nothing more) and dropped.
        scoring = want == 0 and req.echo
        if want < 0 or (want == 0 and not req.echo):
            raise InvalidRequestError(f"max_tokens must be >= 1, got {want} (0 is allowed with echo: true, which "
                                      "returns the prompt and, with logprobs, its tokens' logprobs)", param="max_tokens")
        if scoring and req.min_tokens:
            raise InvalidRequestError(f"min_tokens must be 0 with max_tokens 0 (echo: scoring the prompt, which "
                                      f"generates nothing), got {req.min_tokens}", param="min_tokens")
        max_tokens = [fit_context(len(ids), 1 if scoring else want, context_len,
                                  f"prompt {i}" if len(prompts) > 1 else "the prompt", "prompt",
                                  context_name=context_name)
                      for i, ids in enumerate(prompts)]
        seqs, events = await run(req, prompts, max_tokens, scoring)
        rid = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if req.stream:
            offsets = [0] * len(seqs)  # per choice: characters the tokens listed so far complete (text_offset)

            def chunk(index, text, finish, include_usage, lps):
                obj = None
                if lps is not None:
                    obj = formatter.completion(lps, offsets[index])
                    offsets[index] += formatter.characters([lp.token_id for lp in lps])
                out = {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                       "choices": [{"index": index, "text": text, "logprobs": obj, "finish_reason": finish}]}
                if include_usage:
                    out["usage"] = None
                return out

            def opening(index, include_usage):
                """Choice index's echo: the prompt's text and, with logprobs, its tokens' (the completion's
                text_offset then counts from the prompt's start, as without streaming)."""
                p, seq = index // req.n, seqs[index]
                given = items[p] if isinstance(items[p], str) else formatter.prompt_text(prompts[p])
                out = chunk(index, given, None, include_usage, None)
                if seq.params.logprobs is not None and seq.prompt_logprobs is not None:
                    out["choices"][0]["logprobs"] = formatter.completion([], prompt=(prompts[p], seq.prompt_logprobs))
                    offsets[index] = formatter.characters(prompts[p])
                return out

            return StreamingResponse(stream(req, seqs, events, prompts, chunk, request.url.path,
                                            opening=opening if req.echo else None), media_type="text/event-stream")
        results = await collect(seqs, events, request)

        def echoed(i: int, r) -> tuple[str, dict | None]:
            """Choice i's text and logprobs object; with echo, the prompt's come first."""
            p = i // req.n  # the prompt of choice i
            if not req.echo:
                return r.text, None if r.logprobs is None else formatter.completion(r.logprobs)
            given = items[p] if isinstance(items[p], str) else formatter.prompt_text(prompts[p])
            lps = None if r.logprobs is None else formatter.completion(r.logprobs, prompt=(prompts[p], r.prompt_logprobs))
            return given + r.text, lps

        choices = []
        for i, (s, r) in enumerate(zip(seqs, results)):
            text, lps = await asyncio.to_thread(echoed, i, r)  # a long prompt's tokens: off the event loop
            choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": r.finish_reason,
                            "stop_reason": r.stop_reason, "metrics": choice_metrics(s, r)})
            if req.return_context_logits:  # trtllm-serve's: the prompt's [tokens][V] logits (V floats a token)
                choices[-1]["context_logits"] = await asyncio.to_thread(r.context_logits.tolist)
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                "choices": choices, "usage": usage(prompts, results)}

    template_renders_tools = "tools" in str(getattr(pipe.tokenizer, "chat_template", None) or "")

    @functools.cache
    def warn_tools_unrendered() -> None:  # once per server
        logger.warning("dflash-trt: the chat template of %s does not render `tools`, so the target does not see the "
                       "functions a request offers (forced calls still follow their schemas); serve a target whose "
                       "template renders them (e.g. Qwen3) for tool_choice \"auto\"", pipe.target_path)

    async def prepare_chat(req: ChatCompletionRequest):
        """Check a chat request, render its messages and queue it: (prompt ids, its sequences, the queue of their
        events (`run`), the `ChatAnswers` that make its messages). Raises InvalidRequestError / PromptTooLongError /
        ConfigError / ModelNotFound as the request's error."""
        from dflash_trt.training.prompts import encode_prompt, parse_messages

        check_request_nesting(req)
        check_model(req.model)
        req.unsupported()
        req.check_n()
        want = req.requested_max_tokens()
        calling = req.tool_calling(tool_parser)
        check_tools_text(req.tools, req.messages)
        if calling is not None:
            await asyncio.to_thread(calling.compile, pipe.engine.grammars)  # names a tool whose schema fails
            if not template_renders_tools:
                warn_tools_unrendered()
        template_kwargs = req.template_kwargs()
        req.check_tool_messages()
        messages = parse_messages({"messages": req.messages}, "messages", tool_calls=True, user_text=False)
        if messages is None:
            raise InvalidRequestError("messages is an empty list; give at least one "
                                      '{"role": "user", "content": "<text>"} message')
        for i, m in enumerate(messages, 1):
            from dflash_trt.api import check_text

            try:
                check_text(m["content"], f"message {i} content")
            except InvalidRequestError as exc:
                exc.param = "messages"
                raise
        if not getattr(pipe.tokenizer, "chat_template", None):
            raise ConfigError(f"the target at {pipe.target_path} has no chat template, so /v1/chat/completions "
                              "cannot render messages; use /v1/completions with a plain prompt")
        def encode():
            from jinja2.exceptions import TemplateError

            with tokenizer_lock:
                try:
                    return encode_prompt(pipe.tokenizer, messages, f"the target at {pipe.target_path}",
                                         tools=calling.template_tools() if calling is not None else None,
                                         template_kwargs=template_kwargs)
                except (TemplateError, TypeError, ValueError, ArithmeticError, RecursionError) as exc:
                    # the template's raise_exception (roles that must alternate...), or its own failure on what the
                    # request gave it (a variable of another type): the request's, not the server's
                    field = "chat_template_kwargs" if template_kwargs else "messages"
                    raise InvalidRequestError(f"{field}: the target's chat template failed on this request "
                                              f"({type(exc).__name__}: {exc})", param=field) from None

        ids = await asyncio.to_thread(encode)
        max_tokens = fit_context(len(ids), want, context_len, "the conversation", "messages", req.max_tokens_field(),
                                 context_name=context_name)
        seqs, events = await run(req, [ids], [max_tokens])
        guided = seqs[0].params.guided
        return ids, seqs, events, ChatAnswers(calling, reasoning_parser, guided.kind if guided is not None else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        ids, seqs, events, answers = await prepare_chat(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if req.stream:
            states = None if answers.plain else [answers.stream() for _ in seqs]

            def chunk(index, text, finish, include_usage, lps):
                if states is None:
                    delta = text if isinstance(text, dict) else ({"content": text} if text else {})
                elif isinstance(text, dict):  # the opening delta
                    delta = states[index].opening()
                    if delta is None:
                        return None  # it waits for the first delta that says whether the content is text
                elif finish is not None:
                    delta, finish = states[index].last(text, finish)
                elif not text:  # a chunk of logprobs only, or the usage chunk's envelope: no text to transform
                    delta = states[index].open_now() if lps is not None else {}
                else:
                    delta = states[index].delta(text)
                    if not delta and lps is None:
                        return None  # text held back (a tag, a tool call): no chunk
                    delta = delta or states[index].open_now()  # logprobs only: the choice's first chunk has the role
                out = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                       "choices": [{"index": index, "delta": delta,
                                    "logprobs": None if lps is None else formatter.chat(lps), "finish_reason": finish}]}
                if include_usage:
                    out["usage"] = None
                return out

            return StreamingResponse(stream(req, seqs, events, [ids], chunk, request.url.path,
                                            {"role": "assistant", "content": ""}, answers=answers),
                                     media_type="text/event-stream")
        results = await collect(seqs, events, request)
        replies = [answers.message(r.text, r.finish_reason) for r in results]
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [{"index": i, "message": message,
                             "logprobs": None if r.logprobs is None else formatter.chat(r.logprobs),
                             "finish_reason": finish, "stop_reason": r.stop_reason, "metrics": choice_metrics(s, r)}
                            for i, (s, r, (message, finish)) in enumerate(zip(seqs, results, replies))],
                "usage": usage([ids], results, answers)}

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        check_request_nesting(req)
        check_model(req.model)
        req.unsupported()
        items = listed_items(req.input)  # checked here: they are stored as given
        if req.logprobs() and (reasoning_parser is not None or req.tools and req.tool_choice != "none"):
            raise InvalidRequestError("logprobs on /v1/responses are served for plain text answers: not with tools or "
                                      "a reasoning parser (use /v1/chat/completions, whose choices carry them)",
                                      param="include" if req.include else "top_logprobs")
        history = stored.conversation(req.previous_response_id) if req.previous_response_id is not None else []
        try:
            chat, conversation = req.chat_request(history)
            ids, seqs, events, answers = await prepare_chat(chat)
        except (InvalidRequestError, PromptTooLongError, ConfigError) as exc:
            raise as_responses_error(exc) from None
        rid, created, seq = new_id("resp"), int(time.time()), seqs[0]
        keep = req.store is not False
        start = response_object(rid, created, model_name, req, [], "in_progress", None)
        if keep:  # GET shows it in progress
            stored.put(start, None, items)

        def logprobs_of(lps) -> list | None:
            return None if lps is None else formatter.chat(lps)["content"]

        def settle(response: dict | None, error: BaseException | None = None, output: list | None = None) -> None:
            """Store the finished `response`, or (None) the request's end without one: failed (`error`: the
            generation's) or cancelled (its client left; `output`: the items it was sent, the last one
            incomplete)."""
            if not keep or rid not in stored:  # not stored, or deleted while it was made
                return
            if response is not None:
                stored.put(response, conversation + assistant_messages(response["output"])
                           if response["status"] in ("completed", "incomplete") else None, items)
                return
            status = "cancelled" if error is None else "failed"
            failure = None if error is None else {"code": "server_error", "message": f"generation failed: {error}"}
            output = [dict(it) for it in output or []]
            if output:
                output[-1]["status"] = "incomplete"
            stored.put({**start, "status": status, "error": failure, "output": output}, None, items)

        if not req.stream:
            try:
                [result] = await collect(seqs, events, request)
            except BaseException as exc:
                settle(None, None if isinstance(exc, (ClientGone, asyncio.CancelledError)) else exc)
                raise
            response = whole_response(start, answers.stream(), result.text, result.finish_reason,
                                      responses_usage(ids, result, answers), choice_metrics(seq, result),
                                      logprobs_of(result.logprobs))
            settle(response)
            return response

        def sse(event: dict) -> str:
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        async def stream_events():
            out = ResponseEvents(start)
            state = answers.stream()
            settled = False
            try:
                for event in out.start() + out.delta(state.opening() or {}):
                    yield sse(event)
                while True:
                    _, kind, payload = await events.get()
                    if kind == "text":
                        text, lps, _ = payload
                        for event in out.text(state, text, logprobs_of(lps)):
                            yield sse(event)
                        continue
                    result, error = payload
                    if error is not None:
                        status, body = _status_of(error)
                        if status == 500:
                            log_failure("POST", request.url.path, error)
                        settle(None, error)
                        settled = True
                        yield sse(out.error(body))
                        return
                    lps = seq.rest_logprobs(result) if result.logprobs is not None else None
                    last = out.end(state, seq.text.rest(result.finish_reason), result.finish_reason,
                                   responses_usage(ids, result, answers), choice_metrics(seq, result), logprobs_of(lps))
                    settle(out.response)
                    settled = True
                    for event in last:
                        yield sse(event)
                    return
            finally:
                if not settled:  # the client left
                    settle(None, output=out.items)
                for s in seqs:
                    s.cancelled = True

        return StreamingResponse(stream_events(), media_type="text/event-stream")

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        stored.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str, request: Request):
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise InvalidRequestError("streaming a stored response back is not served; GET it without stream",
                                      param="stream")
        return stored.get(rid)[0]

    @app.get("/v1/responses/{rid}/input_items")
    async def stored_input_items(rid: str, limit: int = 20, order: str = "desc", after: str | None = None):
        return stored.input_items(rid, limit, order, after)

    return app


def check_tools_text(tools, messages) -> None:
    """Raises InvalidRequestError (param "tools" / "messages") when the tools, or the tool calls of the messages,
    hold text a tokenizer refuses (a lone surrogate: `dflash_trt.api.check_text`), as message contents are checked."""
    from dflash_trt.api import check_text

    calls = [m.get("tool_calls") for m in messages if isinstance(m, dict) and m.get("tool_calls")]
    for value, field in ((tools, "tools"), (calls, "messages")):
        try:
            check_text(json.dumps(value, ensure_ascii=False), f"{field} (a tool's text)")
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), param=field) from None


def log_failure(method: str, path: str, exc: BaseException) -> None:
    """Log a request that failed on the server's side (an answered 500), with its traceback."""
    logger.error("dflash-trt: %s %s failed", method, path, exc_info=exc)


class ServerErrors:
    """ASGI middleware: an exception no handler took (a failed generation, e.g. a RuntimeError from the
    target's forward, or a bug) becomes a 500 with OpenAI's error body ("generation failed: ..."), its
    traceback logged once to the `dflash_trt.serve` logger, and the client's keep-alive connection stays
    open. (Starlette's handler for `Exception` re-raises to the server after answering, and uvicorn then
    closes the connection: the client's next request on it failed with "connection reset".) An exception
    after the response started (a stream under way) is re-raised: only the server can end that response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # answered here: the server keeps serving
            if started:
                raise
            from fastapi.responses import JSONResponse

            log_failure(scope.get("method"), scope.get("path"), exc)
            status, body = _status_of(exc)
            await JSONResponse(body, status_code=status)(scope, receive, send)


class CountErrors:
    """ASGI middleware: each HTTP response with an error status (>= 400) counted in
    `trtllm_request_error_total{http_code}` (`ServerMetrics.request_error`)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def watch(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.request_error(message["status"])
            await send(message)

        await self.app(scope, receive, watch)


class RequireApiKey:
    """ASGI middleware: a request to a /v1 endpoint must carry `Authorization: Bearer <key>` (what the openai
    client sends for its api_key; vLLM's --api-key), else it gets a 401 with OpenAI's error body (code
    "invalid_api_key") before its body is read. The other endpoints (/health, /version, the metrics) stay open
    for probes and scrapers. The key is compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1"):
            await self.app(scope, receive, send)
            return
        import hmac

        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        from fastapi.responses import JSONResponse

        why = "carries no API key" if not given else "carries a wrong API key"
        body = error_body(f"the request {why}; this server requires its key as the header Authorization: Bearer <key> "
                          "(the openai client's api_key)", code="invalid_api_key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 with OpenAI's error body. A request whose
    Content-Length says so is refused before anything reads it; every other body is read here, counted up
    to the limit (chunked transfer encoding, with or without a Content-Length beside it), and handed on
    whole. (A pure ASGI middleware: FastAPI's @app.middleware("http") wraps the receive channel, and the
    endpoints would no longer see a client disconnect; after the body, `receive` is the server's own.)"""

    def __init__(self, app, limit: int, context_len: int):
        self.app, self.limit, self.context_len = app, limit, context_len

    async def refuse(self, scope, receive, send, what: str) -> None:
        from fastapi.responses import JSONResponse

        body = error_body(f"{what} this server's limit of {self.limit} bytes; a prompt must fit the target's "
                          f"context ({self.context_len} tokens) anyway")
        await JSONResponse(body, status_code=413)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = dict(scope.get("headers", ())).get(b"content-length")
        if size is not None and size.isdigit() and int(size) > self.limit:
            await self.refuse(scope, receive, send, f"the request body is {int(size)} bytes, over")
            return
        # count what arrives whatever the headers say (a Transfer-Encoding: chunked beside a small
        # Content-Length is read chunked by the server)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                await self.refuse(scope, receive, send, "the request body passed")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)


#: pydantic error types -> the `code` OpenAI's Responses endpoint gives for the same mistake (an unknown field, a
#: value outside an enum, a required field left out); any other type of a wrong-typed value is "invalid_type"
_RESPONSES_CODES = {"extra_forbidden": "unknown_parameter", "literal_error": "invalid_value", "enum": "invalid_value",
                    "missing": "missing_required_parameter"}


def responses_error_code(error: dict) -> str | None:
    """The `code` of the 400 for a /v1/responses body field that fails validation (pydantic's `error`), as OpenAI's
    Responses endpoint gives it: "unknown_parameter", "invalid_value" (a string outside an enum),
    "missing_required_parameter", or "invalid_type" for a value of the wrong type (pydantic's "..._type" errors, and a union none of whose members
    took it); None for another check's failure (its message says what)."""
    kind = error.get("type", "")
    if kind == "literal_error" and not isinstance(error.get("input"), str):
        return "invalid_type"  # (an enum's values are strings)
    if kind in _RESPONSES_CODES:
        return _RESPONSES_CODES[kind]
    return "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") or kind == "union_tag_invalid" else None


def validation_message(errors: list[dict], path: str = "/v1/chat/completions") -> str:
    """One line from pydantic / FastAPI validation errors: the body that is not JSON or not an object (with an
    example body for the endpoint at `path`), or each bad field (at most 5) with what it must be and what it
    got."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        pos = first.get("loc", ("body", "?"))[-1]
        return (f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')} at character {pos}); "
                "send one JSON object with Content-Type: application/json")
    if tuple(first.get("loc", ())) == ("body",):
        example = {"/v1/completions": '{"prompt": "Hi", "max_tokens": 16}', "/v1/responses": '{"input": "Hi"}'}.get(
            path, '{"messages": [{"role": "user", "content": "Hi"}]}')
        return ("the body is not a JSON object (or not sent as Content-Type: application/json); send one JSON object "
                f"such as {example}")
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        got = e.get("input")
        if e.get("type") == "value_error":  # a validator's own message, which says what it got
            parts.append(f"{where}: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        shown = f" (got {json.dumps(got)[:60]})" if e.get("type") != "missing" and jsonable(got) else ""
        hint = unknown_field_hint(where, path) if e.get("type") == "extra_forbidden" else ""
        parts.append(f"{where}: {e.get('msg')}{shown}{hint}")
    return "invalid request: " + "; ".join(parts)


#: other APIs' request fields (HF generate, vLLM's Python API, TensorRT-LLM's, Anthropic's) -> this server's name
OTHER_FIELD_NAMES = {"max_new_tokens": "max_tokens", "stop_sequences": "stop", "stop_strings": "stop",
                     "stop_words": "stop", "end_id": "stop_token_ids", "random_seed": "seed"}


def unknown_field_hint(name: str, path: str) -> str:
    """For a body field the request at `path` does not have: "; use F" (another API's name for F,
    `OTHER_FIELD_NAMES`), "; did you mean F?" (the closest field name), or ""."""
    import difflib

    model = {"/v1/completions": CompletionRequest, "/v1/responses": ResponsesRequest}.get(path, ChatCompletionRequest)
    fields = list(model.model_fields)
    other = OTHER_FIELD_NAMES.get(name)
    if other is not None and path == "/v1/responses" and other == "max_tokens":
        other = "max_output_tokens"
    if other in fields:
        return f"; use {other}"
    close = difflib.get_close_matches(name, fields, n=1)
    return f"; did you mean {close[0]}?" if close else ""
