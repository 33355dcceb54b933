#!/usr/bin/env bash
# The CPU recipe for a default drafter: a 2-layer, block-16 DFlash drafter for the embedded
# SmolLM2-135M-Instruct, trained on this project's built-in prompt corpus with responses written by
# the target itself, into $WORK/drafter (tau ~1.2). It made the drafter shipped until 2026-11-29; the
# shipped one now comes from build_scripts/train_default_drafter_gpu.sh (one GPU, 20x the data).
#
# Runs on a 2-core CPU in resumable chunks: every step keeps its state in $WORK, so rerunning this
# script continues where the last chunk stopped (data generation per 64-prompt batch, training per
# checkpoint). Each chunk stops after $CHUNK_MIN minutes of training (default 60); the whole build
# is about 1 h of data generation + 1 h of training + 15 min of evaluation on an idle 2-core CPU
# (single-threaded processes; the CPU was shared with other work when the shipped drafter was made).
#
# The drafter shipped until 2026-11-29 was exported at step 526 of the 640-step schedule (the
# session that made it ran out of time), hence --max-steps 526; drop it to run the whole schedule.
# Rerunning after "paused" continues from the last checkpoint (bitwise the same weights on CPU).
#
# Usage: build_scripts/train_default_drafter.sh            (rerun until it prints "wrote trained drafter")
#   WORK=/path/to/work CHUNK_MIN=60 PYTHON=.venv/bin/python build_scripts/train_default_drafter.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${WORK:-$HOME/.cache/dflash-trt/train-smollm2-b16}
OUT=${OUT:-$WORK/drafter}
CHUNK_MIN=${CHUNK_MIN:-60}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1

resume=()
[ -f "$WORK/run/checkpoint.pt" ] && resume=(--resume)
log=$(mktemp)
"$PYTHON" -c 'from dflash_trt.cli import main; main()' train-drafter \
  --out "$OUT" --work-dir "$WORK" \
  --num-layers 2 --block-size 16 --init target --draft-vocab-size 8192 --soft-weight 0.5 \
  --max-samples 1024 --max-new-tokens 128 --epochs 2.5 --anchors 32 --seqs-per-step 4 --lr 6e-4 \
  --checkpoint-every 25 --export-dtype bfloat16 --time-limit-min "$CHUNK_MIN" \
  --max-steps 526 "${resume[@]}" | tee "$log"
if grep -q "wrote trained drafter" "$log"; then
  # acceptance figures beside the checkpoint: tau (trained vs untrained, same shape) + greedy parity
  "$PYTHON" -c 'from dflash_trt.cli import main; main()' init-drafter \
    --target "$("$PYTHON" -c 'from dflash_trt.models.default import default_target_path as p; print(p())')" \
    --out "$WORK/untrained-2layer-b16" --num-layers 2 --block-size 16 --mask-token-id 16 --force
  "$PYTHON" -m dflash_trt.training.evaluate --drafter "$OUT" --drafter "$WORK/untrained-2layer-b16" \
    --num-prompts 40 --max-tokens 96 --out "$OUT" --cache "$WORK/eval_cache.json"
else
  echo "training paused: rerun $0 to continue"
fi
