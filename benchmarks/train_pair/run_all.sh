#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# The full-scale pair on a GPU: the train_pair steps in order, within SECONDS.
#
#   bash benchmarks/train_pair/run_all.sh [SECONDS]      (default 540)
#
# TRAIN_PAIR_SCALE=tiny runs the CPU-sized pipeline (for trying the script).
# Steps a previous run finished (marked by OUTDIR/.done_STEP) are skipped, and
# each training step gets the time left of SECONDS (minus a margin for its final
# evaluation and save) as --time-limit. Exit status 75: time ran out, run the
# same command again to continue. Training needs torch, transformers,
# tokenizers, numpy and safetensors, not vLLM.
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

for f in "$OUTDIR"/logs/*.log; do
  [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f"; }
done
echo "train_pair: exit $status after $((SECONDS - START))s"
exit "$status"
