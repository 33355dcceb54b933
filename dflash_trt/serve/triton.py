"""A Triton Inference Server model (Python backend) that serves the DFlash runtime: `TritonPythonModel`.

A model repository (`dflash_trt.serve.triton_repository.write_model_repository`) holds `NAME/1/model.py`, two
lines importing `TritonPythonModel` from here, so the package must be importable by the Python that runs Triton's
Python-backend stub. The model is decoupled: with `stream` true it sends one response per text delta, then a final
one with the statistics; otherwise one response. Requests that arrive together decode as one batch
(`dflash_trt.serve.scheduler`). Its inputs and outputs, and the TensorRT-LLM backend's conventions it follows:
`dflash_trt.serve.triton_tensors`; its model parameters (config.pbtxt `parameters`):
`dflash_trt.serve.triton_repository`.

A request whose gRPC stream is cancelled, or whose `/generate_stream` client (with `stream` true) closes its
connection, is marked cancelled by Triton (`response_sender.is_cancelled()`, Triton 23.10+); the model polls that
every CANCEL_POLL_S and aborts it at its next tokens (finish_reason "abort"), or while its prompt is still read.
Triton's HTTP frontend (2.51) notices a closed connection only when it writes to it: a streaming client's leaving
counts from the next response sent to it (a long prompt is read to its end first), and a request answered in one
response (`stream` false, on `/generate` or `/generate_stream`) is never marked: it runs to its end (its
max_tokens) after its client left, holding a row of the batch. HTTP clients that may leave should stream, or bound
max_tokens. `finalize` (the model unloaded) aborts what is left and joins the
generation thread. Triton unloads a decoupled model only once its streams have ended, and on SIGTERM it
waits for open connections for `--exit-timeout-secs` and then exits at once (status 1) without telling the
model: a stream still generating then is cut, so drain the server (or let its clients leave) before stopping it.

Source of the backend API: Triton's python_backend README ("Decoupled mode", `TritonPythonModel`,
`pb_utils.InferenceResponse`, `get_response_sender`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from dflash_trt.serve.triton_repository import (whole_number_parameter, bool_parameter, check_parameters,
                                                load_from_parameters, missing_inputs, prefix_cache_bytes)
from dflash_trt.serve.triton_tensors import (DEFAULT_MAX_TOKENS, TENSOR_NEUTRAL, UNSUPPORTED, check_extra_fields,
                                             check_unsupported_inputs, embedding_bias, guided_decoding, logits_outputs,
                                             min_tokens, perf_metrics, renamed_input, token_counts, utf8_text,
                                             word_token_ids)

#: how often the model asks Triton whether a request in progress was cancelled (seconds)
CANCEL_POLL_S = 0.5


class TritonPythonModel:
    """Triton's Python-backend entry point (decoupled). See the module docstring; its tensors:
    `dflash_trt.serve.triton_tensors`, its parameters: `dflash_trt.serve.triton_repository`."""

    def initialize(self, args: dict) -> None:
        from dflash_trt.runtime.decode_batch import DecodeBatch
        from dflash_trt.serve.scheduler import Scheduler

        config = json.loads(args["model_config"])
        missing = missing_inputs(config)
        if missing:
            print(f"dflash-trt: warning: this model's config.pbtxt lacks the inputs {missing} (written by an older "
                  "dflash-trt): requests cannot set them; rebuild the bundle (dflash-trt build) or rewrite the model "
                  "with dflash_trt.serve.triton_repository.write_model_repository", file=sys.stderr, flush=True)
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        check_parameters(params)  # all of them before loading anything
        # a request without exclude_input_in_output takes this (tensorrtllm_backend's parameter; empty: false)
        self.exclude_input_default = bool_parameter(params, "exclude_input_in_output")
        batch_size = whole_number_parameter(params, "max_batch_size", 8)
        chunk = whole_number_parameter(params, "prefill_chunk_size", None)
        self.pipe = load_from_parameters(params, Path(args["model_repository"]))
        for line in self.pipe.warnings:  # a bundle's altered files that the runtime does not load (into Triton's log)
            print(f"dflash-trt: warning: {line}", file=sys.stderr, flush=True)
        mode = params.get("mode") or "dflash"
        engine = self.pipe.engine
        cache_bytes = prefix_cache_bytes(params)
        if cache_bytes is not None:
            from dflash_trt.runtime.prefix_cache import PrefixCache

            engine.prefix_cache = PrefixCache(cache_bytes)
        self.scheduler = Scheduler(lambda: DecodeBatch(engine, mode, chunk), batch_size)
        self._tokenizer_lock = threading.Lock()
        self._live: dict[int, tuple] = {}  # id(sequence) -> (sequence, its response sender), until its final response
        self._live_lock = threading.Lock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellation, name="dflash-cancel-watch", daemon=True)
        self._watcher.start()

    def _watch_cancellation(self) -> None:
        """Every CANCEL_POLL_S, ask Triton whether each request in progress was cancelled (its client gone: a
        gRPC stream cancelled, an HTTP connection closed; `response_sender.is_cancelled()`, Triton 23.10+), and
        abort those (finish_reason "abort" at their next tokens, or before they start when still queued)."""
        while not self._closing.wait(CANCEL_POLL_S):
            with self._live_lock:
                live = list(self._live.values())
            for seq, sender in live:
                try:
                    if sender.is_cancelled():
                        seq.cancelled = True
                except Exception:  # noqa: BLE001 - its final response went out meanwhile: nothing to cancel
                    pass

    def _decode(self, ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.pipe.decode(ids)

    def execute(self, requests) -> None:
        import triton_python_backend_utils as pb_utils

        for request in requests:
            sender = request.get_response_sender()
            try:
                seq, stream = self._sequence(request, sender, pb_utils)
            except Exception as exc:  # noqa: BLE001 - a bad request gets its error; the model keeps serving
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            with self._live_lock:
                self._live[id(seq)] = (seq, sender)
            self.scheduler.submit([seq])
        return None

    def _sequence(self, request, sender, pb_utils):
        """The Sequence for one request, its callbacks bound to the request's response sender."""
        import numpy as np

        from dflash_trt.errors import ConfigError, InvalidRequestError
        from dflash_trt.serve.protocol import fit_context
        from dflash_trt.runtime.stop_text import StopText
        from dflash_trt.serve.scheduler import Sequence

        def scalar(name, default):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return default if t is None else t.as_numpy().reshape(-1)[0]

        def vector(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else list(t.as_numpy().reshape(-1))

        arrival_ns, arrival = time.time_ns(), time.perf_counter()  # the queue time counts from here
        given = {name: scalar(name, None) for name in TENSOR_NEUTRAL}
        check_extra_fields({**json.loads(request.parameters() or "{}"),
                            **{name: value.item() for name, value in given.items() if value is not None}},
                           self.pipe.engine.eos_token_ids)
        check_unsupported_inputs({name: (None if (t := pb_utils.get_input_tensor_by_name(request, name)) is None
                                         else t.as_numpy()) for name in UNSUPPORTED})
        raw = scalar("text_input", None)
        if raw is None:
            raise InvalidRequestError("text_input is required: the prompt text")
        text = utf8_text(raw, "text_input")
        if not text:
            raise InvalidRequestError("text_input is empty; give some text")
        def words(name) -> tuple[str, ...]:
            """A STRING [-1] input's words; an empty one means none, as in the TensorRT-LLM backend (its example
            request sends "stop_words": "", "bad_words": "")."""
            texts = (utf8_text(w, name) for w in vector(name) or ())
            return tuple(t for t in texts if t)

        with self._tokenizer_lock:
            if bool(scalar("apply_chat_template", False)):
                if not getattr(self.pipe.tokenizer, "chat_template", None):
                    raise ConfigError("apply_chat_template: the target has no chat template; send plain text")
                ids = self.pipe.encode_chat(text)
            else:
                ids = self.pipe.encode(text)
            # each word as the backend's preprocessing tokenizes it: special tokens on (a BOS gets the weight too)
            bias = embedding_bias(vector("embedding_bias_words"), vector("embedding_bias_weights"), self.pipe.tokenizer)
            # as the backend's preprocessing tokenizes them (`word_token_ids`): the runtime stops where the prompt and
            # output end with a stop word's tokens (kept in the output), and bans each bad word's last token where the
            # prompt and output end with the rest (TensorRT-LLM's banBadWords reads the whole sequence)
            stop_ids, bad = [word_token_ids(words(name), self.pipe.tokenizer, name) for name in ("stop_words",
                                                                                                 "bad_words")]
        from dflash_trt.runtime.sampling import SamplingParams

        seed = renamed_input("seed", scalar("seed", None), "random_seed", scalar("random_seed", None))
        log_probs = bool(scalar("return_log_probs", False))
        perf = bool(scalar("return_perf_metrics", False))
        given = scalar("max_tokens", None)  # as the OpenAI server: the prompt must leave room, max_tokens fit it
        max_tokens = fit_context(len(ids), None if given is None else int(given), self.pipe.engine.context_len,
                                 "text_input")
        if given is None:  # the default, cut to the room the prompt leaves
            max_tokens = min(max_tokens, DEFAULT_MAX_TOKENS)
        params = SamplingParams(temperature=float(scalar("temperature", 0.0)), top_p=float(scalar("top_p", 1.0)),
                                top_k=int(scalar("top_k", 0)), max_tokens=max_tokens,
                                seed=seed, logprobs=0 if log_probs else None,
                                repetition_penalty=float(scalar("repetition_penalty", 1.0)),
                                presence_penalty=float(scalar("presence_penalty", 0.0)),
                                frequency_penalty=float(scalar("frequency_penalty", 0.0)),
                                min_tokens=min_tokens(scalar("min_tokens", None), scalar("min_length", None)),
                                min_p=float(scalar("min_p", 0.0)), logit_bias=bias, bad_words=bad or None,
                                bad_words_read_prompt=True,
                                stop_token_sequences=stop_ids or None,
                                return_context_logits=bool(scalar("return_context_logits", False)),
                                return_generation_logits=bool(scalar("return_generation_logits", False)),
                                guided=guided_decoding(scalar("guided_decoding_guide_type", None),
                                                       scalar("guided_decoding_guide", None)))
        if params.guided is not None:  # compiled here (cached), not on the generation thread
            self.pipe.engine.grammars.compile(params.guided)
        stream = bool(scalar("stream", False))
        # the TensorRT-LLM backend's exclude_input_in_output false (its default): the whole (not streamed) text_output
        # starts with the prompt, as its executor returns the prompt's tokens before the output's and its
        # postprocessing decodes them all; streamed responses carry only new tokens either way (the executor's
        # LlmRequest::createResult)
        with_input = not bool(scalar("exclude_input_in_output", self.exclude_input_default)) and not stream
        count_input = bool(scalar("return_num_input_tokens", False))
        count_output = bool(scalar("return_num_output_tokens", False))
        counted = [0]  # output tokens counted in the responses sent so far (`token_counts`)

        # the shapes of the TensorRT-LLM backend's outputs, which its clients index: text [batch] (its
        # end_to_end_grpc_client.py reads `text_output[0].decode()`), numbers [batch, 1] (`[0][0]`), log-probabilities
        # [batch, beam, tokens]; Triton's /generate JSON gives a one-element tensor as its value either way
        def text_tensor(name, value):
            return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))

        def number(name, value, dtype):
            return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

        def log_prob_tensors(lps) -> list:
            """output_log_probs of `lps` (TokenLogprobs), none when empty (Triton's JSON has no empty arrays)."""
            if not lps:
                return []
            return [pb_utils.Tensor("output_log_probs", np.array([[[lp.logprob for lp in lps]]], dtype=np.float32))]

        def counts(tokens: int) -> list:
            """num_input_tokens / num_output_tokens where the request asks for them (`token_counts`); `tokens`: the
            output tokens the output has so far (those before are counted in earlier responses)."""
            sent, counted[0] = counted[0], max(counted[0], tokens)
            return [number(name, value, np.int32) for name, value in token_counts(
                len(ids), counted[0] - sent, with_input and sent == 0, count_input, count_output).items()]

        def logits_tensors(context, generation) -> list:
            """context_logits / generation_logits where asked for (`logits_outputs`; streamed: the backend's shapes)."""
            return [pb_utils.Tensor(name, value) for name, value in
                    logits_outputs(context, generation, streamed=stream).items()]

        def on_text(delta, lps=None, logits=None):
            # streamed as the backend's executor streams them (`LlmRequest::createResult`): the prompt's logits in
            # every response, each token's generation logits in the response that carries its text
            tokens = seq.text.sent_tokens(counted[0]) if count_output else 0
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                text_tensor("text_output", delta), *log_prob_tensors(lps), *counts(tokens),
                *logits_tensors(seq.context_logits, logits)]))

        def on_done(result, error):
            with self._live_lock:
                self._live.pop(id(seq), None)
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if error is not None:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"generation failed: {error}")), flags=final)
                return
            if result is None:  # cancelled before it ran
                sender.send(flags=final)
                return
            # a stop word's tokens are the output's last ones (the runtime keeps them, as the backend's executor does)
            out = seq.text.rest(result.finish_reason) if stream else result.text
            if with_input:
                out = self._decode(ids) + out
            tensors = [text_tensor("text_output", out), text_tensor("finish_reason", result.finish_reason),
                       number("acceptance_length", result.metrics.acceptance_length, np.float32),
                       *counts(len(result.token_ids))]
            if result.logprobs is not None:
                tensors += log_prob_tensors(seq.rest_logprobs(result))
                tensors.append(number("cum_log_probs", sum(lp.logprob for lp in result.logprobs), np.float32))
            # streamed: the prompt's logits again, and those of the tokens this response's text completes
            tensors += logits_tensors(result.context_logits,
                                      seq.rest_logits(result) if stream else result.generation_logits)
            if perf:
                tensors += [number(name, value, dtype) for name, (value, dtype)
                            in perf_metrics(result.metrics, seq.queue_time_s, arrival_ns).items()]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=final)

        seq = Sequence(ids, params, StopText(self._decode, min_tokens=params.min_tokens),
                       on_text if stream else None, on_done, arrival=arrival)
        return seq, stream

    def finalize(self) -> None:
        """Before Triton unloads the model (a server stopping): the requests in progress and the queued ones
        end as aborts, each with its final response (finish_reason "abort"), and the generation thread is
        joined, so that no thread of this model runs on while the stub shuts down."""
        self._closing.set()
        self.scheduler.close()
        self._watcher.join(timeout=10)
