#!/usr/bin/env bash
# The full-scale pair on the H200, as many steps as fit in one device call.
#
#   bash benchmarks/train_pair/run_h200.sh [SECONDS]      (default 540)
#
# TRAIN_PAIR_SCALE=tiny runs the CPU-sized pipeline (for trying the script).
# Runs the train_pair steps in order, skipping those a previous call finished
# (marked by OUTDIR/.done_STEP), and gives each training step the time left of
# SECONDS (minus a margin for its final evaluation and save) as --time-limit.
# Exit status 75: time ran out, run the same command again (the output folder
# stays on the machine while it is held). Once every step is done, the pair
# (target, drafter, eval_prompts.json, summary.json, logs) comes back as
# $OUT/pair.tgz.* in 15 MB pieces; summary.json and logs/ come back every call.
# Training needs torch, transformers, tokenizers, numpy and safetensors, which
# the bare machine has: no vLLM bundle, and it keeps the bundle's packages out
# of the corpus.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SCALE=${TRAIN_PAIR_SCALE:-full}
OUTDIR=${TRAIN_PAIR_OUT:-build/train_pair/$SCALE}
BUDGET=${1:-540}
MARGIN=60   # a training step may overrun its limit by one step + eval + save
START=$SECONDS
mkdir -p "$OUTDIR"

status=0
for step in corpus tokenizer target continuations drafter; do
  [ -f "$OUTDIR/.done_$step" ] && continue
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt $((MARGIN + 30)) ]; then
    echo "train_pair: ${left}s left, stopping before $step"
    status=75
    break
  fi
  echo "train_pair: $step (${left}s left)"
  python3 -m benchmarks.train_pair "$step" --scale "$SCALE" --out "$OUTDIR" --time-limit $((left - MARGIN))
  rc=$?
  if [ "$rc" -eq 0 ]; then
    touch "$OUTDIR/.done_$step"
  else
    echo "train_pair: $step exited $rc"
    status=$rc
    break
  fi
done

if [ -n "${OUT:-}" ]; then
  cp "$OUTDIR/summary.json" "$OUT/" 2>/dev/null
  cp -r "$OUTDIR/logs" "$OUT/" 2>/dev/null
  if [ "$status" -eq 0 ]; then
    tar -C "$OUTDIR" -czf - target drafter eval_prompts.json summary.json logs \
      | split -b 15M - "$OUT/pair.tgz."
    ls -l "$OUT"/pair.tgz.*
  fi
fi
for f in "$OUTDIR"/logs/*.log; do
  [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f"; }
done
echo "train_pair: exit $status after $((SECONDS - START))s"
exit "$status"
