#!/usr/bin/env bash
# A separate virtual environment with vLLM's `speculators` library (the reference reader and writer of the
# speculators checkpoint format), for the interop tests in tests/models/test_speculators_interop.py:
#
#   build_scripts/speculators_venv.sh [VENV]      # default /tmp/speculators-venv (~1 minute, CPU torch)
#   SPECULATORS_PYTHON=/tmp/speculators-venv/bin/python .venv/bin/pytest tests/models/test_speculators_interop.py
#
# Kept out of the project's .venv: speculators 0.9.0 pins transformers >= 5.0 and pulls datasets, openai,
# torchaudio and torchvision. Its model and converter code import none of the last two, so they are left out
# (`--no-deps`, then what `import speculators` needs; hs-connectors also with --no-deps).
set -euo pipefail
VENV=${1:-/tmp/speculators-venv}
python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q"
$PIP --upgrade pip
$PIP torch==2.13.0 "transformers==$(.venv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo 5.14.1)"
$PIP --no-deps speculators==0.9.0 hs-connectors==0.9.0
$PIP pydantic pydantic-settings loguru safetensors "numpy<2.5" rich tqdm click typer huggingface-hub psutil protobuf \
    httpx aiohttp openai "datasets>=4,<=5.1"
"$VENV/bin/python" -c "from speculators.models.dflash import DFlashDraftModel; from speculators.convert.dflash.converter import DFlashConverter; print('speculators ready:', '$VENV/bin/python')"
