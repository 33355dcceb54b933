#!/usr/bin/env bash
# Fine-tune the GPU-trained default drafter on this 2-core CPU (`train-drafter --init DIR`): the
# recipe that made the drafter shipped from 2026-11-29 to commit c3a862d from the one shipped at commit
# 3dc696f (build_scripts/train_default_drafter_gpu.sh on one H200: 19,654 samples, 369 steps). Its
# stage 4 is the base of build_scripts/finetune_default_drafter_gpu.sh, which made the drafter
# shipped now.
#
#   base    the drafter of commit 3dc696f, read with `git show` (needs this git checkout)
#   data    the target's greedy responses to 4,072 prompts of the built-in corpus, with features
#           (float32, batch 64; about 1 h single-threaded, 4.3 GB in $WORK/data)
#   stage 1 687 steps on the first 1,024 samples (4 sequences x 64 anchors per step, lr 3e-4)
#   stage 2 641 steps on all 4,072 samples from stage 1 (same settings)
#   stage 3 561 steps on 4,096 samples from stage 2, loss decay gamma 2 instead of the paper's 7
#           (more weight on the first drafts; session 6: from stage 2's weights, ~120 steps with
#           gamma 2 raised a held-out teacher-forced acceptance by 0.016 / 0.007 on code / chat
#           prompts where gamma 7 gave +0.004 / -0.003; the full 561 steps +0.042 / +0.041)
#   stage 4 814 steps on the same samples from stage 3 (same settings, gamma 2; session 7: the
#           evaluation's tau 1.463 / 1.284 -> 1.505 / 1.319; the drafter shipped at commit c3a862d)
#   eval    tau + greedy parity on the held-out HumanEval / MT-Bench subsets (40 + 40 prompts)
# About 5 h in all on this 2-core CPU, one thread (data ~1 h, stages of ~50-65 min each at 4-5 s
# per step, eval ~15 min): OVER issue 5's 4 h budget since stage 4 was added; the shipped run took
# 56 + 56 + 48 + 68 min of training on a machine shared with other work. Every step keeps its state in
# $WORK: rerunning continues (data per batch, training per checkpoint, a stage after CHUNK_MIN
# minutes) until it prints "fine-tuned drafter written".
#
# The shipped run fitted each stage's schedule to a time budget (`--train-minutes 75`, 55, 48, 62) on
# a machine shared with other work; this script fixes the step counts it reached instead, so it
# reruns the same recipe on any machine, not bit for bit the same weights (the first 25 steps of
# the budget-fitted runs had a longer warmup).
#
# Usage: build_scripts/finetune_default_drafter_cpu.sh
#   WORK=/path OUT=/path CHUNK_MIN=60 PYTHON=.venv/bin/python build_scripts/finetune_default_drafter_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source build_scripts/common.sh
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${WORK:-$HOME/.cache/dflash-trt/finetune-smollm2-b16}
OUT=${OUT:-$WORK/stage4/drafter}  # the GPU fine-tune reads it as INIT
CHUNK_MIN=${CHUNK_MIN:-60}
BASE_COMMIT=3dc696f
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
cli() { "$PYTHON" -c 'from dflash_trt.cli import main; main()' "$@"; }
mkdir -p "$WORK/base" "$WORK/stage1" "$WORK/stage2" "$WORK/stage3" "$WORK/stage4"
drafter_from_git "$BASE_COMMIT" "$WORK/base"
# one data cache for all stages (stage 1 uses its first 1,024 samples; stage 3 adds one batch of 24)
ln -sfn "$WORK/data" "$WORK/stage1/data"
ln -sfn "$WORK/data" "$WORK/stage2/data"
ln -sfn "$WORK/data" "$WORK/stage3/data"
ln -sfn "$WORK/data" "$WORK/stage4/data"
common=(--anchors 64 --seqs-per-step 4 --lr 3e-4 --checkpoint-every 50 --export-dtype bfloat16
  --time-limit-min "$CHUNK_MIN")
cli train-drafter --out "$WORK/stage2/drafter" --work-dir "$WORK" --init "$WORK/base" --max-samples 4072 --data-only

stage() {  # stage NAME INIT SAMPLES EPOCHS OUT [EXTRA FLAGS...]
  local resume=() log
  [ -f "$WORK/$1/run/checkpoint.pt" ] && resume=(--resume)
  [ -f "$5/config.json" ] && return 0
  log=$(mktemp)
  cli train-drafter --out "$5" --work-dir "$WORK/$1" --init "$2" --max-samples "$3" --epochs "$4" \
    "${common[@]}" "${resume[@]}" "${@:6}" | tee "$log"
  grep -q "wrote trained drafter" "$log" || { echo "training paused: rerun $0 to continue"; exit 0; }
}
stage stage1 "$WORK/base" 1024 2.68359375 "$WORK/stage1/drafter"
stage stage2 "$WORK/stage1/drafter" 4072 0.62966 "$WORK/stage2/drafter"
stage stage3 "$WORK/stage2/drafter" 4096 0.5478515625 "$WORK/stage3/drafter" --gamma 2
stage stage4 "$WORK/stage3/drafter" 4096 0.794921875 "$WORK/stage4/drafter" --gamma 2
"$PYTHON" -m dflash_trt.training.evaluate --drafter "$WORK/stage4/drafter" --num-prompts 40 --max-tokens 128 \
  --out "$WORK/stage4/drafter" --cache "$WORK/eval_cache.json"
if [ "$OUT" != "$WORK/stage4/drafter" ]; then
  rm -rf "$OUT.tmp" && cp -r "$WORK/stage4/drafter" "$OUT.tmp" && rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
fi
echo "fine-tuned drafter written to $OUT"
