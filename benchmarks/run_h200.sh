#!/usr/bin/env bash
# The GPU session script: run on the H200 from the repo root after the vLLM bundle is
# installed (see ../shared/gpu/README.md). Logs and results go to $OUT.
#   bash benchmarks/run_h200.sh tests|tests-v1|e2e|serving|load|compiles|startup-8b|profile-b1|b1-rounds|serve-headline|profile-8b|bench-ops|bench-attn|bench-ddtree|train-pair [args]
# (tests: pytest arguments; train-pair: seconds for the steps; the others: the
# script's own, see docs/bench_ddtree.md and docs/train_pair.md)
set -uo pipefail
# The bundle's installer travels only with the bundle calls (.gpu/ is not
# tracked); later calls on the same machine find vLLM installed in /tmp/site.
if [ -f .gpu/install.sh ]; then
  source .gpu/install.sh >/dev/null
elif [ -f /tmp/site/.done_vllm ] && [ -f /tmp/site/.done_deps ]; then
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "run_h200.sh: no vLLM bundle on this machine (send .gpu/ first)" >&2
  exit 2
fi
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 \
  VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
# Engine logs of the end-to-end tests, kept with the results.
export DDTREE_E2E_LOG_DIR=${DDTREE_E2E_LOG_DIR:-$OUT/e2e_logs}
# Tiny checkpoints and finished engine results, reused by later e2e runs while the
# machine stays up (keyed by configuration and source files: tests/e2e/engines.py).
export DDTREE_E2E_CACHE_DIR=${DDTREE_E2E_CACHE_DIR:-/tmp/ddtree_e2e_cache}
# Engine configurations started side by side (start-up is mostly CPU: 16 cores).
export DDTREE_E2E_PARALLEL=${DDTREE_E2E_PARALLEL:-5}
# Seconds per command (the device tool allows 600 per call).
LIMIT=${LIMIT:-560}
# pytest in the background of a mode that runs several at once: LOG ARGS...
pytest_to() {
  local log=$1; shift
  # shellcheck disable=SC2086
  timeout $LIMIT python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$log" 2>&1
}
# One summary line (and the failures) per log: PREFIX NAME...
summarize() {
  local prefix=$1; shift
  for name in "$@"; do
    echo "$name: $(grep -E '(passed|failed|error|skipped|no tests ran)' \
      "$OUT/${prefix}_$name.log" | tail -1)"
    grep -E '^(FAILED|ERROR)' "$OUT/${prefix}_$name.log" | head -20
  done
}
# A results folder kept on the machine, back through $OUT as one archive
# (the device tool returns at most 8 files, two folders down) plus its
# report files: DIR.
bring_back() {
  local dir=$1 name
  name=$(basename "$1")
  tar czf "$OUT/$name.tgz" -C "$(dirname "$dir")" "$name" "$name.log"
  for f in rounds.md results.md; do
    [ -f "$dir/$f" ] && cp "$dir/$f" "$OUT/${name}_$f"
  done
  return 0
}
# bench_ddtree.py on the trained pair: NAME MODE ARGS... The output lives in
# /tmp/ddtree_results/NAME while the machine stays up, so a later call resumes
# where a cut one stopped (RESUME: an output brought back into the checkout,
# for a fresh machine); each call brings it back (bring_back).
pair_bench() {
  local name=$1 mode=$2 keep rc P=benchmarks/models/pycode
  shift 2
  keep=/tmp/ddtree_results/$name
  mkdir -p "$keep"
  timeout $LIMIT python3 benchmarks/bench_ddtree.py "$mode" --out "$keep" \
    --target $P/target --drafter $P/drafter --prompts $P/eval_prompts.json \
    ${RESUME:+--resume-from "$RESUME"} --limit-seconds $((LIMIT - 30)) "$@" 2>&1 \
    | tee -a "$keep.log" | grep -v -i warn | tail -40
  rc=${PIPESTATUS[0]}
  bring_back "$keep"
  return "$rc"
}
what=$1; shift
case "$what" in
  tests)
    timeout $LIMIT python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 "$@" \
      2>&1 | tee -a "$OUT/pytest_gpu.log" | grep -v -i warn | tail -40 ;;
  tests-v1)
    # tests/v1 in three pytest processes at once (one after another it takes
    # ~9.5 min, mostly CPU: the heap reference and Triton compiles); each group's
    # log in $OUT/pytest_v1_<group>.log, then one summary line per group.
    declare -A groups=(
      [attention]="tests/v1/attention"
      [builder]="tests/v1/spec_decode/test_dflash_tree_builder.py"
      [rest]="tests/v1/sample tests/v1/spec_decode/test_ddtree_config.py \
tests/v1/spec_decode/test_ddtree_inputs.py tests/v1/spec_decode/test_ddtree.py \
tests/v1/test_sm90_compile.py"
    )
    pids=()
    for g in "${!groups[@]}"; do
      # shellcheck disable=SC2086
      pytest_to "$OUT/pytest_v1_$g.log" "$@" ${groups[$g]} &
      pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    summarize pytest_v1 "${!groups[@]}"
    exit $rc ;;
  e2e)
    # The end-to-end modules side by side: the offline DDTree module, then
    # TREE_ATTN's (reusing its reference engines), next to the serve module.
    # Logs in $OUT/pytest_e2e_<module>.log; one summary line each.
    run_e2e() { pytest_to "$OUT/pytest_e2e_$(basename "${@: -1}" .py).log" "$@"; }
    ( run_e2e "$@" tests/e2e/test_ddtree_llm.py; first=$?
      run_e2e "$@" tests/e2e/test_tree_attn_llm.py || exit 1
      exit $first ) &
    chain=$!
    run_e2e "$@" tests/e2e/test_ddtree_serve.py &
    serve=$!
    rc=0
    wait $chain || rc=1
    wait $serve || rc=1
    summarize pytest_e2e test_ddtree_llm test_tree_attn_llm test_ddtree_serve
    exit $rc ;;
  serving)
    # tests/e2e/test_ddtree_serving.py alone (~6.5 min with 9 engines side by
    # side); its measured lines (tokens compared, p-values, preemptions, blocks)
    # also go to $DDTREE_E2E_LOG_DIR/serving_report.log.
    DDTREE_E2E_PARALLEL=${SERVING_PARALLEL:-9} pytest_to \
      "$OUT/pytest_e2e_serving.log" -s "$@" tests/e2e/test_ddtree_serving.py
    rc=$?
    grep -E 'passed|failed|^(FAILED|ERROR)' "$OUT/pytest_e2e_serving.log" | tail -20
    exit $rc ;;
  load)
    # tests/e2e/test_ddtree_load.py alone: one device call. Its time budget is
    # what this call has left (the install counted), at most 540 s; the module
    # shortens its streams to fit and keeps its summary as each phase ends.
    left=$((590 - SECONDS))
    export DDTREE_LOAD_SECONDS=${DDTREE_LOAD_SECONDS:-300}
    export DDTREE_LOAD_BUDGET_S=${DDTREE_LOAD_BUDGET_S:-$(( left - 25 < 540 ? left - 25 : 540 ))}
    timeout $left python3 -m pytest -q -p no:cacheprovider -rfE -s "$@" \
      tests/e2e/test_ddtree_load.py > "$OUT/pytest_e2e_load.log" 2>&1
    rc=$?
    grep -E '^\[load|: \{|passed|failed|^(FAILED|ERROR)' "$OUT/pytest_e2e_load.log" | tail -40
    exit $rc ;;
  compiles)
    # tests/e2e/test_ddtree_compiles.py: two servers at vLLM's defaults (~2.5 min
    # to start), the traffic twice, then the Triton variants met after ready.
    pytest_to "$OUT/pytest_e2e_compiles.log" -s "$@" tests/e2e/test_ddtree_compiles.py
    rc=$?
    grep -E 'after ready|kernel|passed|failed|^(FAILED|ERROR)' \
      "$OUT/pytest_e2e_compiles.log" | tail -40
    exit $rc ;;
  startup-8b)
    # tests/e2e/test_ddtree_startup_memory.py alone: DDTree engines on Qwen3-8B
    # shapes (dummy weights) under vLLM's memory profiling and defaults, one at
    # a time (~2 min each), then a batch of 64 and a single request.
    pytest_to "$OUT/pytest_e2e_startup_8b.log" -s "$@" tests/e2e/test_ddtree_startup_memory.py
    rc=$?
    grep -E 'ddtree-|passed|failed|^(FAILED|ERROR)' "$OUT/pytest_e2e_startup_8b.log" | tail -20
    exit $rc ;;
  profile-b1)
    # The trained pair at batch 1 under vLLM's defaults, one config after
    # another in this command (configs: the argument, default below).
    timeout $LIMIT python3 benchmarks/profile_step.py --out "$OUT/profile_b1_defaults" \
      --pair benchmarks/models/pycode --settings defaults \
      --configs "${1:-dflash,ddtree-32,ddtree-auto}" --batch 1 --max-tokens 256 \
      --timing-repeats 2 --limit-seconds $((LIMIT - 20)) 2>&1 \
      | tee "$OUT/profile_b1_defaults.log" | grep -v -i warn | tail -30 ;;
  b1-rounds)
    # The batch-1 target: the pair under vLLM's defaults (multiprocess engine,
    # fresh prompts), DFlash and DDTree auto in fresh processes, ROUNDS rounds
    # (medians in rounds.md). NUMA_BIND=1 adds vLLM's own --numa-bind (the
    # placement test; give it its own OUT_NAME); the configs: the argument.
    pair_bench "${OUT_NAME:-bench_b1_rounds}" e2e \
      --configs "${1:-dflash,ddtree-auto}" --batches 1 --temperatures 0 \
      --num-prompts 16 --rounds "${ROUNDS:-3}" \
      ${NUMA_BIND:+--engine-arg numa_bind=true}
    exit $? ;;
  serve-headline)
    # Issue 17's headline: vllm serve + vllm bench serve, DFlash and DDTree auto,
    # concurrency 1 / 8 / 32 / 64, T=0 and 1, under vLLM's defaults. ROUNDS=N:
    # N fresh servers per config, alternating order (medians in rounds.md).
    # INTERLEAVE=S: the configs' servers side by side, S alternating slices
    # per cell (bench_ddtree.py serve --interleave). PIN_CPUS=LIST: every
    # server on the same CPUs once up, the load clients on the others
    # (--pin-cpus; a measurement control, labelled in the setup).
    pair_bench "${OUT_NAME:-bench_serve_headline}" serve \
      --configs "${1:-dflash,ddtree-auto}" --batches "${BATCHES:-1,8,32,64}" \
      --temperatures 0,1 ${ROUNDS:+--rounds $ROUNDS} \
      ${INTERLEAVE:+--interleave $INTERLEAVE} ${PIN_CPUS:+--pin-cpus $PIN_CPUS}
    exit $? ;;
  profile-8b)
    # Qwen3-8B shapes (dummy weights), batch 1: the step of budgets 127 and 255
    # against DFlash's, by kernel category, and the unprofiled wall per step
    # whose ratio to DFlash's the 8B step targets are about (the target lines
    # themselves: bench-ddtree cost --configs dflash,ddtree-127,ddtree-255).
    timeout $LIMIT python3 benchmarks/profile_step.py --out "$OUT/profile_8b_b1" \
      --configs "${1:-dflash,ddtree-127,ddtree-255}" --batch 1 \
      --limit-seconds $((LIMIT - 20)) 2>&1 \
      | tee "$OUT/profile_8b_b1.log" | grep -v -i warn | tail -40
    exit "${PIPESTATUS[0]}" ;;
  bench-ops)
    timeout $LIMIT python3 benchmarks/bench_tree_ops.py --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/bench_tree_ops.log" | tail -30 ;;
  bench-attn)
    timeout $LIMIT python3 benchmarks/bench_tree_attn.py --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/bench_tree_attn.log" | tail -40 ;;
  bench-ddtree)
    timeout $LIMIT python3 benchmarks/bench_ddtree.py "$@" 2>&1 \
      | tee -a "$OUT/bench_ddtree.log" | tail -40 ;;
  train-pair)
    # The pending train_pair steps that fit (benchmarks/train_pair/run_h200.sh).
    OUT=$OUT timeout $LIMIT bash benchmarks/train_pair/run_h200.sh \
      "${1:-$((LIMIT - 20))}" 2>&1 | tee -a "$OUT/train_pair.log" | tail -30 ;;
  *)
    echo "usage: $0 tests|tests-v1|e2e|serving|load|compiles|startup-8b|profile-b1|b1-rounds|serve-headline|profile-8b|bench-ops|bench-attn|bench-ddtree|train-pair [args]" >&2
    exit 2 ;;
esac
