"""The Triton model's tensors (`dflash_trt.serve.triton`): the inputs and outputs it declares (`INPUTS`,
`OUTPUTS`), and the TensorRT-LLM backend's conventions it follows, with their checks and the conversions between a
request's tensors and the runtime's values (sampling parameters in; token counts and request metrics out).

Tensor names follow the TensorRT-LLM backend's ensemble (`text_input`, `max_tokens`, `temperature`, `top_p`,
`top_k`, `random_seed`, `stream`, `stop_words` -> `text_output`), so requests to Triton's `/v2/models/NAME/generate` and
`/generate_stream` endpoints written for that ensemble work here (a JSON key that is not one of these
inputs is refused, naming it). Triton's HTTP `/v2/models/NAME/infer` does not serve decoupled models
(it answers 501); tensor clients use gRPC streaming (`ModelStreamInfer`) with the ensemble's shapes: this model
has `max_batch_size: 1` (`MAX_REQUEST_BATCH`), so each input is [1, ...] (a batch dimension first, as the
TensorRT-LLM backend's clients send them: its `end_to_end_grpc_client.py` runs unchanged); a request of several
prompts ([2, 1]) is refused by Triton ("batch-size must be <= 1"): send each its own request, they batch in the
runtime's scheduler. Outputs have the backend's shapes: text [1], numbers [1, 1], output_log_probs [1, 1, tokens]:

    curl -X POST localhost:8000/v2/models/dflash/generate \\
         -d '{"text_input": "What is the capital of France?", "apply_chat_template": true, "max_tokens": 32}'

Inputs (all but text_input optional): text_input STRING [1]; max_tokens INT32 [1] (default 256, or the
room the prompt leaves in the context where that is less);
temperature FP32 [1] (default 0 = greedy: exactly the target's own output); top_p FP32 [1]; top_k
INT32 [1]; seed UINT64 [1] (`random_seed`, its older name in the TensorRT-LLM backend's ensemble, is the same
input: give one, or both equal; as the OpenAI server's `seed`: the same request alone gives the same
sample again; on a CPU, one decoded while other requests share the batch need not, as a batch of several
decodes without drafting there, `max_concurrency`); stream BOOL [1]; stop_words STRING [-1] (an empty one means
none, as in the TensorRT-LLM backend; matched on token ids as the backend matches them: its preprocessing model
tokenizes each word as written, without special tokens and without a space before it (`word_token_ids`), and its
runtime ends the output after the token with which the prompt and output end with one of those sequences, which
may begin in the prompt, whatever min_tokens says (`SamplingParams.stop_token_sequences`); the output keeps the
stop word's tokens, streamed or not, as the backend's executor keeps them and its postprocessing decodes them. So
"of Fr" does not stop "... of France": its tokens as written ("of", " Fr") are not the output's (" of", " France");
send the words as they appear after the text before them, " of France". The OpenAI server, `dflash_trt.serve.app`,
matches its `stop` strings on the text and cuts before them, as OpenAI does); apply_chat_template BOOL
[1] (wrap text_input as one user message in the target's chat template); return_log_probs BOOL [1]
(the TensorRT-LLM backend's name); repetition_penalty FP32 [1] (default 1 = off), presence_penalty and
frequency_penalty FP32 [1] (default 0; over the output tokens, `dflash_trt.runtime.penalties`), bad_words STRING
[-1] (the TensorRT-LLM backend's: token sequences the output never holds, each word tokenized as the backend's
preprocessing does it, as written (`word_token_ids`: "Paris" does not ban " Paris"), a word's last token banned where
the prompt and the output end with the rest of it, as TensorRT-LLM's banBadWords kernel reads the whole sequence (a
word may begin in the prompt: "\nThe" after a chat prompt ending in "\n" bans "The" as the first token;
`SamplingParams.bad_words_read_prompt`); an empty one means none),
min_tokens
INT32 [1] (default 0: no stop token or stop word ends the output before that many tokens; `min_length` INT32 [1],
the TensorRT-LLM backend's older name, is the same input: give one, or both equal); min_p FP32 [1] (default 0 =
off; as the OpenAI server's `min_p`); embedding_bias_words STRING [-1] with embedding_bias_weights FP32 [-1]
(the TensorRT-LLM backend's logit bias: each word's tokens get its weight added to their logits, summed where
words share a token, each word tokenized as the backend's preprocessing does it, with the tokenizer's special
tokens: a BOS the tokenizer adds gets every word's weight too, `embedding_bias`); guided_decoding_guide_type STRING [1] ("json": any JSON object or array, "json_schema",
"regex", "ebnf_grammar") with guided_decoding_guide STRING [1] (the schema, regex or grammar): the TensorRT-LLM
backend's structured output (`guided_decoding`, `dflash_trt.runtime.guided`). The backend's inputs for what this
model does anyway pass only at the values that ask for that (`ENSEMBLE_NEUTRAL`, as tensors or /generate JSON keys,
`TENSOR_NEUTRAL`; another value is an error naming it and what it asks for, `NEUTRAL_ASKS`): beam_width INT32 [1] (1),
num_return_sequences INT32 [1] (1), end_id INT32 [1] (one of the target's EOS ids), pad_id INT32 [1] (any),
length_penalty FP32 [1] (1), prompt_vocab_size INT32 [1] and prompt_table_extra_id UINT64 [1] (any: the backend uses
them only with a prompt table), the tensorrt_llm_bls model's num_draft_tokens INT32 [1] (0: none asked of its draft
model) and use_draft_logits BOOL [1] (false), and the tensorrt_llm model's early_stopping BOOL [1] and
beam_search_diversity_rate FP32 [1] (any: beam search's), runtime_top_p_decay FP32 [1] (1: no decay),
runtime_top_p_min FP32 [1] and runtime_top_p_reset_ids INT32 [1] (any: they act only with a decay).
The backend's inputs for what this model does not do are declared, and pass only empty (no element, or empty
strings), so that a client sending a value gets an error naming it and what it asks for (`UNSUPPORTED`; Triton's own
answer to an undeclared input names no reason): lora_task_id UINT64 [1], lora_weights FP16 [-1, -1], lora_config
INT32 [-1, 3]: LoRA adapters; prompt_embedding_table FP16 [-1, -1]: prompt tuning; draft_input_ids INT32 [-1],
draft_logits FP32 [-1, -1], draft_acceptance_threshold FP32 [1]: drafts from outside (this model drafts with its
own drafter); decoder_text_input STRING [1]: encoder-decoder targets; the tensorrt_llm_bls model's image_input FP16
[-1, 3, -1, -1], image_bytes_input and video_bytes_input UINT8 [-1, -1, -1, -1], image_url_input STRING [1]:
multimodal targets (with num_draft_tokens and use_draft_logits above, every input of that BLS model is declared, so
its clients' requests are answered here too); the tensorrt_llm model's encoder_input_features
FP16 [-1, -1], encoder_output_lengths INT32 [1], cross_attention_mask BOOL [-1, -1], skip_cross_attn_blocks BOOL [1],
mrope_rotary_cos_sin FP32 [-1], mrope_position_deltas INT64 [1]: encoder-decoder and multimodal targets;
context_phase_params UINT8 [-1]: disaggregated serving; retention_token_range_starts, retention_token_range_ends,
retention_token_range_priorities, retention_token_range_durations_ms INT32 [-1], retention_decode_priority,
retention_decode_duration_ms INT32 [1]: KV cache retention; lookahead_window_size, lookahead_ngram_size,
lookahead_verification_set_size INT32 [1]: lookahead decoding; and its token-level inputs, each named with the
ensemble input to send instead (`TOKEN_LEVEL`): input_ids INT32 [-1], input_lengths INT32 [1], request_output_len
INT32 [1], decoder_input_ids INT32 [-1], decoder_input_lengths INT32 [1], stop_words_list and bad_words_list INT32
[2, -1], embedding_bias FP32 [-1], runtime_top_k INT32 [1], runtime_top_p FP32 [1], len_penalty FP32 [1], streaming
BOOL [1], prompt_table_extra_ids UINT64 [-1]. exclude_input_in_output BOOL [1] (default: the model parameter of that name, false unless
set, as in the TensorRT-LLM backend, whose tensorrt_llm model takes the request's value, else its parameter, else
false): false puts the prompt's text before the answer in a whole text_output, as the backend's executor returns the
prompt's tokens before the output's; streamed responses carry only new text either way, as the backend's
(`LlmRequest::createResult` sends the tokens after those already sent). return_num_input_tokens and
return_num_output_tokens BOOL [1] (default false) add num_input_tokens and num_output_tokens INT32 [1] to every
response, as the TensorRT-LLM backend does (`token_counts`): the prompt's tokens, and the tokens of that response's
text_output (streamed: those its text completes, so a stream's responses add up to the output's tokens, as Triton's
OpenAI frontend adds them; a whole text_output that starts with the prompt counts the prompt's tokens too, as the
backend's output_ids hold them). Outputs: text_output STRING [1]; finish_reason STRING [1] ("stop", "length", or
"abort"); acceptance_length FP32 [1] (tau); num_input_tokens, num_output_tokens INT32 [1] (above); batch_index and
sequence_index INT32 [1], declared as the backend's, never sent (the backend sends them only for a request of several
prompts or num_return_sequences > 1, both refused here); with return_log_probs, output_log_probs FP32 [-1] (each
output token's log-probability under the target's raw distribution, `dflash_trt.runtime.logprobs`;
streamed: each response carries its tokens') and cum_log_probs FP32 [1] (their sum, in the last
response); with return_perf_metrics BOOL [1] (the TensorRT-LLM backend's request metrics, in the last response:
`perf_metrics`), arrival_time_ns, first_scheduled_time_ns, first_token_time_ns and last_token_time_ns INT64 [1]
(nanoseconds since the Unix epoch), acceptance_rate FP32 [1], total_accepted_draft_tokens and total_draft_tokens
INT32 [1], cached_tokens INT32 [1] (prompt tokens whose K/V came from the prefix cache), and the TensorRT-LLM
backend's kv_cache_alloc_new_blocks, kv_cache_reused_blocks and kv_cache_alloc_total_blocks INT32 [1] with a block of
one token (this cache keeps tokens, not blocks). A request is
refused with an error response under the OpenAI server's rules (`dflash_trt.serve.protocol`): a prompt
that leaves no room in the context, `max_tokens` beyond it.
return_context_logits and return_generation_logits BOOL [1] (default false) add context_logits FP32 [-1, -1] and
generation_logits FP32 [-1, -1, -1] to the response, the target's raw float32 logits (`logits_outputs`, with
the tensorrt_llm model's shapes: [1, prompt tokens, V] at every prompt position; [1, 1, output tokens, V], each output
token's row the logits it was chosen from, as the verify pass computed them): V floats a position (49,152 for
SmolLM2), so a long prompt's context_logits is large, as in the backend; a request asking for context_logits reads
its whole prompt (no cached prefix). Streamed, as the backend's executor streams them (`LlmRequest::createResult`):
context_logits in every response, and in each response the generation_logits of the tokens whose text it carries
([1, tokens, 1, V], the executor's token-major slice; the slices add up to the whole answer's).
The ensemble has no `stop` input (the tensorrt_llm model's BOOL that cancels a request by id): Triton's /generate
takes a JSON "stop" as a request parameter, so "stop": [...] gets Triton's 400 "parameter 'stop' has invalid type",
as the ensemble's /generate answers it; false passes, true is refused (`NEUTRAL_ASKS`), a string is told to go in
stop_words (the ensemble ignores it).
Triton's JSON frontend converts the values before the model sees them: a `max_tokens` beyond INT32 wraps
(4294967297 arrives as 1), a value of the wrong JSON type is its 500 parse error, and `"stream": true`
sent to `/generate` (not `/generate_stream`) is answered 200 with an error body.
"""

from __future__ import annotations

import json

#: The model's inputs and outputs: (name, Triton data type, dims, optional).
INPUTS = (
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("random_seed", "TYPE_UINT64", [1], True),
    ("seed", "TYPE_UINT64", [1], True),
    ("stream", "TYPE_BOOL", [1], True),
    ("stop_words", "TYPE_STRING", [-1], True),
    ("bad_words", "TYPE_STRING", [-1], True),
    ("apply_chat_template", "TYPE_BOOL", [1], True),
    ("return_log_probs", "TYPE_BOOL", [1], True),
    ("return_perf_metrics", "TYPE_BOOL", [1], True),
    ("repetition_penalty", "TYPE_FP32", [1], True),
    ("presence_penalty", "TYPE_FP32", [1], True),
    ("frequency_penalty", "TYPE_FP32", [1], True),
    ("min_tokens", "TYPE_INT32", [1], True),
    ("min_length", "TYPE_INT32", [1], True),
    ("min_p", "TYPE_FP32", [1], True),
    ("embedding_bias_words", "TYPE_STRING", [-1], True),
    ("embedding_bias_weights", "TYPE_FP32", [-1], True),
    ("guided_decoding_guide_type", "TYPE_STRING", [1], True),
    ("guided_decoding_guide", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True),
    # the TensorRT-LLM backend's inputs its clients send as tensors (its end_to_end_grpc_client.py always sends
    # beam_width and num_return_sequences): taken at the values that ask for what this model does (`TENSOR_NEUTRAL`)
    ("beam_width", "TYPE_INT32", [1], True),
    ("num_return_sequences", "TYPE_INT32", [1], True),
    ("end_id", "TYPE_INT32", [1], True),
    ("pad_id", "TYPE_INT32", [1], True),
    ("length_penalty", "TYPE_FP32", [1], True),
    ("prompt_vocab_size", "TYPE_INT32", [1], True),
    ("prompt_table_extra_id", "TYPE_UINT64", [1], True),
    # the target's logits (`logits_outputs`): context_logits / generation_logits
    ("return_context_logits", "TYPE_BOOL", [1], True),
    ("return_generation_logits", "TYPE_BOOL", [1], True),
    # the tensorrt_llm_bls model's draft-model inputs (its speculative decoding with a separate draft model)
    ("num_draft_tokens", "TYPE_INT32", [1], True),
    ("use_draft_logits", "TYPE_BOOL", [1], True),
    # the tensorrt_llm model's sampling inputs that the ensemble does not pass on: beam search's and top-p decay's
    # (not its `stop`, a request that cancels the one with its request id: the ensemble has no such input, and
    # Triton's /generate then takes a JSON "stop" as a request parameter, `check_extra_fields`)
    ("early_stopping", "TYPE_BOOL", [1], True),
    ("beam_search_diversity_rate", "TYPE_FP32", [1], True),
    ("runtime_top_p_decay", "TYPE_FP32", [1], True),
    ("runtime_top_p_min", "TYPE_FP32", [1], True),
    ("runtime_top_p_reset_ids", "TYPE_INT32", [1], True),
    # the TensorRT-LLM backend's inputs for what this model does not do (`UNSUPPORTED`): declared so that a client
    # sending them gets an error naming what is not supported (Triton's own answer to an undeclared input is "unexpected
    # inference input"); sent empty they ask for nothing and pass
    ("lora_task_id", "TYPE_UINT64", [1], True),
    ("lora_weights", "TYPE_FP16", [-1, -1], True),
    ("lora_config", "TYPE_INT32", [-1, 3], True),
    ("prompt_embedding_table", "TYPE_FP16", [-1, -1], True),
    ("draft_input_ids", "TYPE_INT32", [-1], True),
    ("decoder_text_input", "TYPE_STRING", [1], True),
    # the tensorrt_llm_bls model's images and videos (multimodal targets)
    ("image_input", "TYPE_FP16", [-1, 3, -1, -1], True),
    ("image_bytes_input", "TYPE_UINT8", [-1, -1, -1, -1], True),
    ("image_url_input", "TYPE_STRING", [1], True),
    ("video_bytes_input", "TYPE_UINT8", [-1, -1, -1, -1], True),
    # the tensorrt_llm model's (its config.pbtxt; the ensemble does not have them): drafts from outside, encoder /
    # multimodal inputs, disaggregated serving, KV cache retention, lookahead decoding
    ("draft_logits", "TYPE_FP32", [-1, -1], True),
    ("draft_acceptance_threshold", "TYPE_FP32", [1], True),
    ("encoder_input_features", "TYPE_FP16", [-1, -1], True),
    ("encoder_output_lengths", "TYPE_INT32", [1], True),
    ("cross_attention_mask", "TYPE_BOOL", [-1, -1], True),
    ("skip_cross_attn_blocks", "TYPE_BOOL", [1], True),
    ("mrope_rotary_cos_sin", "TYPE_FP32", [-1], True),
    ("mrope_position_deltas", "TYPE_INT64", [1], True),
    ("context_phase_params", "TYPE_UINT8", [-1], True),
    ("retention_token_range_starts", "TYPE_INT32", [-1], True),
    ("retention_token_range_ends", "TYPE_INT32", [-1], True),
    ("retention_token_range_priorities", "TYPE_INT32", [-1], True),
    ("retention_token_range_durations_ms", "TYPE_INT32", [-1], True),
    ("retention_decode_priority", "TYPE_INT32", [1], True),
    ("retention_decode_duration_ms", "TYPE_INT32", [1], True),
    ("lookahead_window_size", "TYPE_INT32", [1], True),
    ("lookahead_ngram_size", "TYPE_INT32", [1], True),
    ("lookahead_verification_set_size", "TYPE_INT32", [1], True),
    # the tensorrt_llm model's token-level inputs (what the ensemble's preprocessing model makes of its text inputs, and
    # its own names for top_k, top_p, length_penalty, stream): this model takes the ensemble's (`TOKEN_LEVEL`)
    ("input_ids", "TYPE_INT32", [-1], True),
    ("input_lengths", "TYPE_INT32", [1], True),
    ("request_output_len", "TYPE_INT32", [1], True),
    ("decoder_input_ids", "TYPE_INT32", [-1], True),
    ("decoder_input_lengths", "TYPE_INT32", [1], True),
    ("stop_words_list", "TYPE_INT32", [2, -1], True),
    ("bad_words_list", "TYPE_INT32", [2, -1], True),
    ("embedding_bias", "TYPE_FP32", [-1], True),
    ("runtime_top_k", "TYPE_INT32", [1], True),
    ("runtime_top_p", "TYPE_FP32", [1], True),
    ("len_penalty", "TYPE_FP32", [1], True),
    ("streaming", "TYPE_BOOL", [1], True),
    ("prompt_table_extra_ids", "TYPE_UINT64", [-1], True),
)
#: the inputs above taken only at a neutral value (`check_extra_fields`), as tensors or /generate JSON keys
TENSOR_NEUTRAL = ("beam_width", "num_return_sequences", "end_id", "pad_id", "length_penalty", "prompt_vocab_size",
                  "prompt_table_extra_id", "num_draft_tokens", "use_draft_logits", "early_stopping",
                  "beam_search_diversity_rate", "runtime_top_p_decay", "runtime_top_p_min", "runtime_top_p_reset_ids")
#: the tensorrt_llm model's token-level inputs -> the ensemble input this model takes instead (`UNSUPPORTED`)
TOKEN_LEVEL = {"input_ids": "text_input", "input_lengths": "text_input", "request_output_len": "max_tokens",
               "decoder_input_ids": "decoder_text_input", "decoder_input_lengths": "decoder_text_input",
               "stop_words_list": "stop_words", "bad_words_list": "bad_words",
               "embedding_bias": "embedding_bias_words with embedding_bias_weights", "runtime_top_k": "top_k",
               "runtime_top_p": "top_p", "len_penalty": "length_penalty", "streaming": "stream",
               "prompt_table_extra_ids": "prompt_table_extra_id"}
#: the TensorRT-LLM backend's inputs (its tensorrt_llm model's; the ensemble has all but draft_input_ids) for what this
#: model does not do -> what they ask for; only an empty value (no element, or empty strings) passes
#: (`check_unsupported_inputs`): lora_task_id names an adapter whatever its value, so it is refused whenever given
UNSUPPORTED = {"lora_task_id": "LoRA adapters", "lora_weights": "LoRA adapters", "lora_config": "LoRA adapters",
               "prompt_embedding_table": "prompt tuning (a prompt embedding table)",
               "draft_input_ids": "drafts from outside (this model drafts with its own drafter)",
               "decoder_text_input": "encoder-decoder targets (a decoder prompt)",
               **{name: "multimodal targets (the tensorrt_llm_bls model's images and videos)" for name in (
                   "image_input", "image_bytes_input", "image_url_input", "video_bytes_input")},
               "draft_logits": "drafts from outside (this model drafts with its own drafter)",
               "draft_acceptance_threshold": "drafts from outside (this model drafts with its own drafter)",
               **{name: "encoder-decoder and multimodal targets" for name in (
                   "encoder_input_features", "encoder_output_lengths", "cross_attention_mask",
                   "skip_cross_attn_blocks", "mrope_rotary_cos_sin", "mrope_position_deltas")},
               "context_phase_params": "disaggregated serving (a context phase run elsewhere)",
               **{name: "KV cache retention priorities" for name in (
                   "retention_token_range_starts", "retention_token_range_ends", "retention_token_range_priorities",
                   "retention_token_range_durations_ms", "retention_decode_priority", "retention_decode_duration_ms")},
               **{name: "lookahead decoding (this model drafts with its own drafter)" for name in (
                   "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")},
               **{name: f"the tensorrt_llm model's token-level input (this model takes the ensemble's: send {ensemble})"
                  for name, ensemble in TOKEN_LEVEL.items()}}
OUTPUTS = (
    ("text_output", "TYPE_STRING", [1]),
    ("finish_reason", "TYPE_STRING", [1]),
    ("num_output_tokens", "TYPE_INT32", [1]),
    ("acceptance_length", "TYPE_FP32", [1]),
    ("output_log_probs", "TYPE_FP32", [-1]),
    ("cum_log_probs", "TYPE_FP32", [1]),
    # return_context_logits / return_generation_logits (`logits_outputs`)
    ("context_logits", "TYPE_FP32", [-1, -1]),
    ("generation_logits", "TYPE_FP32", [-1, -1, -1]),
    ("arrival_time_ns", "TYPE_INT64", [1]),
    ("first_scheduled_time_ns", "TYPE_INT64", [1]),
    ("first_token_time_ns", "TYPE_INT64", [1]),
    ("last_token_time_ns", "TYPE_INT64", [1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
    ("cached_tokens", "TYPE_INT32", [1]),
    # the TensorRT-LLM backend's KV cache block counts (its clients read them with return_perf_metrics): this cache
    # keeps tokens, so a block here is one token (`perf_metrics`)
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    ("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    # return_num_input_tokens / return_num_output_tokens (`token_counts`)
    ("num_input_tokens", "TYPE_INT32", [1]),
    # the TensorRT-LLM backend's, sent only for a request of several prompts or num_return_sequences > 1, which this model
    # refuses: declared (its clients may request them), never sent
    ("batch_index", "TYPE_INT32", [1]),
    ("sequence_index", "TYPE_INT32", [1]),
)
#: the outputs `return_perf_metrics` adds (`perf_metrics`)
PERF_OUTPUTS = tuple(name for name, *_ in OUTPUTS[OUTPUTS.index(("arrival_time_ns", "TYPE_INT64", [1])):
                                                    OUTPUTS.index(("num_input_tokens", "TYPE_INT32", [1]))])
DEFAULT_MAX_TOKENS = 256
#: config.pbtxt's max_batch_size: 1, as the TensorRT-LLM backend's models have one (> 0), so that tensor clients send
#: its shapes, [1, 1] (a batch dimension first); a request holding several prompts ([2, 1]) is refused by Triton
#: itself ("batch-size must be <= 1"): each prompt is its own request, and requests batch in the runtime's scheduler
MAX_REQUEST_BATCH = 1


#: inputs of the TensorRT-LLM backend's ensemble that this model does not have, with the values that ask for what
#: it does anyway (None: any value); `end_id` is checked against the target's
#: EOS ids; `id` is the request id of Triton's JSON requests
ENSEMBLE_NEUTRAL = {"id": None, "pad_id": None, "beam_width": (1,), "num_return_sequences": (1,), "length_penalty": (1,),
                    # the backend's executor ignores it ("prompt_vocab_size is unused by executor", its model.py)
                    "prompt_vocab_size": None,
                    # its prompt table's id (multimodal KV cache reuse): used only with a prompt_embedding_table, which
                    # is refused unless empty (`UNSUPPORTED`)
                    "prompt_table_extra_id": None,
                    # the tensorrt_llm model's request that cancels the one with its request id (`stop` true); not an
                    # input here (nor of the ensemble), so Triton's /generate hands a JSON "stop" over as a parameter
                    "stop": (False,),
                    # the tensorrt_llm_bls model's draft model: 0 draft tokens (none asked of it), no draft logits
                    "num_draft_tokens": (0,), "use_draft_logits": (False,),
                    # beam search's, with beam_width 1 without effect
                    "early_stopping": None, "beam_search_diversity_rate": None,
                    # top-p decay: off at 1 (TensorRT-LLM's default); the floor and the reset ids act only with a decay
                    "runtime_top_p_decay": (1,), "runtime_top_p_min": None, "runtime_top_p_reset_ids": None}
#: what another value of an ENSEMBLE_NEUTRAL input asks for (its error names it)
NEUTRAL_ASKS = {"beam_width": "beam search (this model decodes one sequence per request)",
                "num_return_sequences": "several sequences per request (send the request again: requests batch in the "
                                        "runtime)",
                "end_id": "an end token other than the target's EOS",
                "length_penalty": "beam search's length penalty",
                "stop": "cancelling the request with its request id (close the stream or cancel the gRPC call instead)",
                "num_draft_tokens": "draft tokens from the tensorrt_llm_bls model's draft model (this model drafts "
                                    "with its own drafter)",
                "use_draft_logits": "the tensorrt_llm_bls model's draft-model logits (this model drafts with its own "
                                    "drafter)",
                "runtime_top_p_decay": "top-p decay"}


def check_extra_fields(extra: dict, eos_token_ids) -> None:
    """Refuse the JSON keys of a `/generate` request that are not this model's inputs (Triton hands them over as
    request parameters), unless they are TensorRT-LLM ensemble inputs holding the value that asks for what this
    model does anyway (`ENSEMBLE_NEUTRAL`; `end_id` one of the target's EOS ids): a typo such as `temprature` had
    been ignored, giving greedy output.

    Raises:
        InvalidRequestError: one error: the unknown fields, with this model's inputs; each ensemble input at another
            value, with that value, what it asks for (`NEUTRAL_ASKS`) and the values that pass.
    """
    from dflash_trt.errors import InvalidRequestError

    bad, other = [], []
    if isinstance(extra.get("stop"), str):  # OpenAI's stop strings, sent as this model's stop_words
        raise InvalidRequestError(f"stop {json.dumps(extra['stop'])}: this model's stop strings are stop_words (a "
                                  'list of strings: {"stop_words": [...]}, as the TensorRT-LLM backend\'s ensemble '
                                  "takes them); stop is the tensorrt_llm model's cancel flag (false or left out)")
    for key, value in extra.items():
        if key == "end_id" and not isinstance(value, bool) and value in tuple(eos_token_ids):
            continue
        if key in ENSEMBLE_NEUTRAL and (ENSEMBLE_NEUTRAL[key] is None or any(_same(value, v) for v in ENSEMBLE_NEUTRAL[key])):
            continue
        (other if key in NEUTRAL_ASKS else bad).append(key)
    parts = []
    if bad:
        known = ", ".join(name for name, *_ in INPUTS)
        parts.append(f"unknown field(s) {sorted(bad)}: this model's inputs are {known} (a typo, or a TensorRT-LLM "
                     "ensemble input this model does not implement); remove or correct them")
    for key in sorted(other):
        neutral = (f"the target's EOS id ({' or '.join(map(str, eos_token_ids))})" if key == "end_id" else
                   " or ".join(json.dumps(v) for v in ENSEMBLE_NEUTRAL[key]))
        parts.append(f"{key} {json.dumps(extra[key])} asks for {NEUTRAL_ASKS[key]}, which this model does not do; "
                     f"send {neutral}, or leave {key} out")
    if parts:
        raise InvalidRequestError("; ".join(parts))


def _same(value, neutral) -> bool:
    """`value == neutral`, where a bool equals only a bool (true is not a beam width of 1)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def perf_metrics(metrics, queue_time_s: float, arrival_ns: int) -> dict[str, tuple[float | int, str]]:
    """The `return_perf_metrics` outputs of a finished request: {output name: (value, numpy dtype name)}.

    Args:
        metrics: the request's `RequestMetrics` (times in seconds from the start of its prefill).
        queue_time_s: seconds from its arrival to its admission into the batch (`Sequence.queue_time_s`).
        arrival_ns: the wall clock (`time.time_ns()`) when the model received it.
    Returns:
        arrival_time_ns, first_scheduled_time_ns (arrival + queue time), first_token_time_ns (+ time to first
        token) and last_token_time_ns (+ the request's whole time), in ns since the Unix epoch (int64); the drafts
        accepted / verified (`total_accepted_draft_tokens` / `total_draft_tokens`, int32) and their ratio
        `acceptance_rate` (float32; 0 when nothing was drafted, as the TensorRT-LLM backend reports it);
        `cached_tokens` (int32); the TensorRT-LLM backend's `kv_cache_alloc_new_blocks`, `kv_cache_reused_blocks` and
        `kv_cache_alloc_total_blocks` (int32) with a block of one token (this cache keeps tokens): the positions the
        request wrote, read from the prefix cache, and both.
    """
    scheduled = arrival_ns + round(queue_time_s * 1e9)
    return {"arrival_time_ns": (arrival_ns, "int64"), "first_scheduled_time_ns": (scheduled, "int64"),
            "first_token_time_ns": (scheduled + round(metrics.time_to_first_token_s * 1e9), "int64"),
            "last_token_time_ns": (scheduled + round(metrics.total_time_s * 1e9), "int64"),
            "acceptance_rate": (metrics.acceptance_rate, "float32"),
            "total_accepted_draft_tokens": (metrics.accepted_tokens, "int32"),
            "total_draft_tokens": (metrics.drafted_tokens, "int32"),
            "cached_tokens": (metrics.cached_tokens, "int32"),
            # one token a block: the prompt and output positions it wrote (new), those it read from the cache (reused)
            "kv_cache_alloc_new_blocks": (metrics.prompt_tokens - metrics.cached_tokens + metrics.completion_tokens,
                                          "int32"),
            "kv_cache_reused_blocks": (metrics.cached_tokens, "int32"),
            "kv_cache_alloc_total_blocks": (metrics.prompt_tokens + metrics.completion_tokens, "int32")}


def token_counts(prompt_tokens: int, new_tokens: int, with_prompt: bool, count_input: bool,
                 count_output: bool) -> dict[str, int]:
    """The token counts of one response, as the TensorRT-LLM backend sends them (its tensorrt_llm model's
    `return_num_input_tokens` / `return_num_output_tokens`: in every response of the request, INT32 [1, 1]).

    Args:
        prompt_tokens: the prompt's tokens (after the chat template, where applied).
        new_tokens: the output tokens this response adds (streamed: those whose text its text_output completes,
            `StopText.sent_tokens`; the last response: the rest), so that a stream's responses add up to the output's
            tokens, as Triton's OpenAI frontend adds them up.
        with_prompt: the response's text_output starts with the prompt (a whole answer with exclude_input_in_output
            false): its tokens count as output too, as the backend's executor returns them in output_ids.
        count_input / count_output: the request's return_num_input_tokens / return_num_output_tokens.
    Returns:
        {"num_input_tokens": ..., "num_output_tokens": ...}, each only where asked for.
    """
    out = {}
    if count_input:
        out["num_input_tokens"] = prompt_tokens
    if count_output:
        out["num_output_tokens"] = new_tokens + (prompt_tokens if with_prompt else 0)
    return out


def renamed_input(name: str, value, old_name: str, old_value) -> int | None:
    """A request's value of an input the TensorRT-LLM backend renamed (`min_length` -> `min_tokens`, `random_seed`
    -> `seed`): the one given, as int, None when neither is.

    Raises:
        InvalidRequestError: both given, with different values.
    """
    from dflash_trt.errors import InvalidRequestError

    if value is not None and old_value is not None and int(value) != int(old_value):
        raise InvalidRequestError(f"{name} ({value}) and {old_name} ({old_value}) differ; they are the same input "
                                  f"({old_name} its older name): give one of them")
    value = value if value is not None else old_value
    return None if value is None else int(value)


def min_tokens(given, min_length) -> int:
    """A request's min_tokens: its `min_tokens` input or `min_length` (the TensorRT-LLM backend's older name for
    it), 0 when it has neither.

    Raises:
        InvalidRequestError: both given, with different values.
    """
    value = renamed_input("min_tokens", given, "min_length", min_length)
    return 0 if value is None else value


def check_unsupported_inputs(given: dict) -> None:
    """Refuse the TensorRT-LLM backend's inputs for what this model does not do (`UNSUPPORTED`: LoRA, prompt tuning,
    drafts from outside, a decoder prompt) unless empty: no element, or only empty strings (a client that always
    sends the tensor and leaves it empty asks for nothing).

    Args:
        given: input name -> its value (a numpy array, or None when the request lacks it).
    Raises:
        InvalidRequestError: naming each input given a value and what it asks for, and the fix.
    """
    import numpy as np

    from dflash_trt.errors import InvalidRequestError

    def empty(value) -> bool:
        flat = np.asarray(value).reshape(-1)
        return all(isinstance(v, (bytes, str)) and not v for v in flat)  # no element, or only empty strings

    refused = [name for name, value in given.items() if value is not None and not empty(value)]
    if refused:
        what = "; ".join(f"{name}: {UNSUPPORTED[name]}" for name in refused)
        raise InvalidRequestError(f"this model does not support {what} (the TensorRT-LLM backend's input"
                                  f"{'s' if len(refused) > 1 else ''}); leave {', '.join(refused)} out, or send "
                                  f"{'them' if len(refused) > 1 else 'it'} empty")


def embedding_bias(words, weights, tokenizer) -> dict[int, float] | None:
    """A request's logit bias from the TensorRT-LLM backend's `embedding_bias_words` / `embedding_bias_weights`
    inputs, as the backend's preprocessing model builds its EMBEDDING_BIAS row (its `_get_embedding_bias`): each word
    is tokenized with `tokenizer.encode(word)`, the tokenizer's special tokens ON (unlike the stop and bad words,
    `word_token_ids`), and its weight added to each of its tokens' logits, once per occurrence, summed where words
    share a token. So with a tokenizer that adds a BOS (Llama's), every word, an empty one too, adds its weight to
    the BOS token's logit as well; with one that adds none (SmolLM2's), an empty word adds nothing. None when neither
    input is given.

    Args:
        words: the words (str or UTF-8 bytes), or None. weights: one number per word, or None.
        tokenizer: the target's (a Hugging Face tokenizer: `encode(text)` -> token ids).
    Raises:
        InvalidRequestError: one input given without the other, lengths that differ, a word that is not UTF-8, a
            weight that is not finite, or a token's sum outside [-100, 100] (`SamplingParams.logit_bias`' range),
            naming the word.
    """
    import math

    from dflash_trt.errors import InvalidRequestError

    if words is None and weights is None:
        return None
    if words is None or weights is None:
        given, missing = ("embedding_bias_words", "embedding_bias_weights") if weights is None else (
            "embedding_bias_weights", "embedding_bias_words")
        raise InvalidRequestError(f"{given} needs {missing} beside it: one weight per word")
    words = [utf8_text(w, "embedding_bias_words") for w in words]
    weights = [float(w) for w in weights]
    if len(words) != len(weights):
        raise InvalidRequestError(f"embedding_bias_words has {len(words)} word(s) and embedding_bias_weights "
                                  f"{len(weights)} weight(s); give one weight per word")
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights):
        if not math.isfinite(weight):
            raise InvalidRequestError(f"embedding_bias_weights: the weight of {word!r} is {weight}; give a finite "
                                      "number")
        for token in tokenizer.encode(word):
            bias[token] = bias.get(token, 0.0) + weight
            if abs(bias[token]) > 100:
                raise InvalidRequestError(f"embedding_bias_words: the token {token} of {word!r} gets a bias of "
                                          f"{bias[token]:g}, outside [-100, 100] (a sum over the words holding it)")
    return bias


#: the TensorRT-LLM backend's guided_decoding_guide_type values -> the GuidedDecoding field the guide goes to
GUIDE_TYPES = {"json": "json", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
#: what guide type "json" (no guide) admits: a JSON object or array, as TensorRT-LLM's guided decoder compiles it
#: (XGrammar's builtin JSON grammar, whose root is an object or an array; tensorrtllm_backend's
#: docs/guided_decoding.md shows "[2025]" for it), written as a schema so that the runtime's bound on whitespace
#: between tokens holds (`dflash_trt.runtime.guided.MAX_WHITESPACE`; the builtin grammar has none)
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'


def guided_decoding(guide_type, guide):
    """A request's GuidedDecoding from the TensorRT-LLM backend's guided_decoding_guide_type / guided_decoding_guide
    inputs (str or UTF-8 bytes, or None when absent): "json" (any JSON object or array, `ANY_JSON_SCHEMA`; no guide),
    "json_schema", "regex", "ebnf_grammar" (each with its guide); None when neither is given.

    Raises:
        InvalidRequestError: a guide without a type, a type other than those four, "json" with a guide,
            another type without one, or a value that is not UTF-8.
    """
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.guided import GuidedDecoding

    def text(value, name):
        return None if value is None else utf8_text(value, name)

    guide_type, guide = text(guide_type, "guided_decoding_guide_type"), text(guide, "guided_decoding_guide")
    if not guide_type:
        if guide:
            raise InvalidRequestError("guided_decoding_guide needs guided_decoding_guide_type beside it (one of "
                                      f"{', '.join(GUIDE_TYPES)})")
        return None
    if guide_type not in GUIDE_TYPES:
        raise InvalidRequestError(f"guided_decoding_guide_type {guide_type!r} is not one of {', '.join(GUIDE_TYPES)}")
    if guide_type == "json":
        if guide:
            raise InvalidRequestError('guided_decoding_guide_type "json" means any JSON object or array and takes no '
                                      'guide; for a schema use "json_schema"')
        return GuidedDecoding(json=ANY_JSON_SCHEMA)
    if not guide:
        raise InvalidRequestError(f'guided_decoding_guide_type "{guide_type}" needs guided_decoding_guide (the '
                                  f"{'JSON schema' if guide_type == 'json_schema' else guide_type.replace('_', ' ')})")
    return GuidedDecoding(**{GUIDE_TYPES[guide_type]: guide})


def utf8_text(value, name: str) -> str:
    """A STRING tensor's element as text: UTF-8 bytes decoded (Triton passes a request's bytes on unchecked, from
    gRPC or from a JSON string), anything else as str.

    Raises:
        InvalidRequestError: bytes that are not UTF-8, naming the input `name` and where they stop being UTF-8.
    """
    from dflash_trt.errors import InvalidRequestError

    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"{name} is not UTF-8 text (byte {exc.start}: {exc.reason}); send it as UTF-8") from None


def word_token_ids(words, tokenizer, name: str) -> tuple[tuple[int, ...], ...]:
    """The token id sequences of `words` as the TensorRT-LLM backend's preprocessing model makes them of its
    stop_words / bad_words inputs (its `_to_word_list_format`): each word tokenized as written
    (`tokenizer.encode(word, add_special_tokens=False)`: no BOS, no space added before it), a word of no tokens
    left out.

    Args:
        words: the words (str). tokenizer: the target's (a Hugging Face tokenizer).
        name: the input they came in ("stop_words", "bad_words"), which an error names.
    Returns:
        the sequences, in order (for `SamplingParams.stop_token_sequences` / `bad_words`).
    Raises:
        InvalidRequestError: more than `dflash_trt.runtime.penalties.MAX_BAD_WORDS` words (each is matched at every
            verify position), naming `name`; checked before any is tokenized.
    """
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.penalties import MAX_BAD_WORDS

    words = list(words)
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequestError(f"{name} holds {len(words)} words; give at most {MAX_BAD_WORDS}")
    return tuple(ids for ids in (tuple(tokenizer.encode(w, add_special_tokens=False)) for w in words) if ids)


def logits_outputs(context_logits, generation_logits, streamed: bool = False) -> dict:
    """The `context_logits` / `generation_logits` outputs of a response, as the TensorRT-LLM backend's tensorrt_llm
    model sends them (its `convert_response`; the executor's `LlmRequest::createResult`): {name: float32 numpy
    array}: context_logits [1, prompt tokens, V]; generation_logits [1, 1, output tokens, V] (batch, beam, tokens),
    each output token's row the logits it was chosen from, or, `streamed`, the rows of the tokens that response
    carries as [1, tokens, 1, V] (the executor keeps a streamed request's generation logits token-major, [tokens,
    beam, V], and the backend puts a batch dimension before them). Each only where the request asked for it (not
    None) and it holds a token (Triton's JSON has no empty arrays).

    Args:
        context_logits: [prompt tokens, V] float tensor, or None. generation_logits: [tokens, V], or None.
    """
    out = {}
    if context_logits is not None and context_logits.numel():
        out["context_logits"] = context_logits.float().numpy()[None]
    if generation_logits is not None and generation_logits.numel():
        rows = generation_logits.float().numpy()
        out["generation_logits"] = rows[None, :, None] if streamed else rows[None, None]
    return out
