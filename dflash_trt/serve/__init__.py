"""Serving: an OpenAI-compatible HTTP server with trtllm-serve's endpoints and metrics (`dflash-trt serve`).

- `protocol`: the OpenAI request bodies and their mapping onto `SamplingParams`;
- `scheduler`: the generation thread (in-flight batching over the engine, streaming, stop strings);
- `metrics`: Prometheus metrics and iteration stats under trtllm-serve's names;
- `app`: the FastAPI app (`create_app`).

FastAPI, uvicorn and prometheus-client come with the `serve` extra and are imported here only.
"""
