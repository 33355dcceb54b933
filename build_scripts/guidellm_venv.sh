#!/usr/bin/env bash
# A separate virtual environment with GuideLLM (vLLM project's load generator for OpenAI-compatible servers:
# concurrency and rate sweeps, TTFT / ITL / TPOT distributions), for tests/serve/test_guidellm_interop.py and
# for load tests of `dflash-trt serve` (README "Serving"):
#
#   build_scripts/guidellm_venv.sh [VENV]      # default /tmp/guidellm-venv (~1-2 minutes, CPU torch, ~1.5 GB)
#   GUIDELLM=/tmp/guidellm-venv/bin/guidellm .venv/bin/pytest tests/serve/test_guidellm_interop.py
#
# Kept out of the project's .venv: guidellm 0.8.1 pulls datasets, sanic, uvloop and its own pins. torch is
# pinned to the CPU wheel first (an unpinned torch would pull a multi-GB CUDA build).
set -euo pipefail
VENV=${1:-/tmp/guidellm-venv}
python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q"
$PIP --upgrade pip
$PIP torch==2.13.0 guidellm==0.8.1
"$VENV/bin/guidellm" --version
echo "guidellm ready: $VENV/bin/guidellm"
