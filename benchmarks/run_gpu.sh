#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# GPU tests and benchmarks by name, from the repo root of a checkout on a GPU machine
# with vLLM 0.26.0 and this package installed (`pip install ".[test]"`):
#
#   bash benchmarks/run_gpu.sh MODE [args]
#
# MODE: tests|tests-v1|e2e|serving|patched|load|compiles|startup-8b|profile-b1|b1-rounds|
#       serve|embed|embed-check|serve-8b|record-8b|oracle-8b|trace-8b|plain-8b|diagnose-8b|mixed-8b|profile-8b|bench-ops|top-search|bench-attn|bench-ddtree|train-pair
# (tests: pytest arguments; train-pair: seconds for the steps; the others: the
# script's own, see benchmarks/README.md). OUT: where logs and results go (default
# build/gpu_results); LIMIT: seconds a mode may run (default 3600).
set -uo pipefail
# One host, engines started by their own processes (as the recorded results ran).
export VLLM_WORKER_MULTIPROC_METHOD=${VLLM_WORKER_MULTIPROC_METHOD:-spawn} \
  VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0} \
  VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1} PYTHONUNBUFFERED=1
OUT=${OUT:-build/gpu_results}
LIMIT=${LIMIT:-3600}
mkdir -p "$OUT"
# Engine logs of the end-to-end tests, kept with the results.
export DDTREE_E2E_LOG_DIR=${DDTREE_E2E_LOG_DIR:-$OUT/e2e_logs}
# Tiny checkpoints and finished engine results, reused by later e2e runs
# (keyed by configuration and source files: tests/e2e/engines.py).
export DDTREE_E2E_CACHE_DIR=${DDTREE_E2E_CACHE_DIR:-build/ddtree_e2e_cache}
# Engine configurations started side by side (start-up is mostly CPU).
export DDTREE_E2E_PARALLEL=${DDTREE_E2E_PARALLEL:-5}
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
# bench_ddtree.py on the trained pair: NAME MODE ARGS..., output in $OUT/NAME.
# RESUME: an earlier output folder whose finished cells are kept (--resume-from).
pair_bench() {
  local name=$1 mode=$2 P=benchmarks/models/pycode
  shift 2
  timeout $LIMIT python3 benchmarks/bench_ddtree.py "$mode" --out "$OUT/$name" \
    --target $P/target --drafter $P/drafter --prompts $P/eval_prompts.json \
    ${RESUME:+--resume-from "$RESUME"} --limit-seconds $((LIMIT - 30)) "$@" 2>&1 \
    | tee -a "$OUT/$name.log" | grep -v -i warn | tail -40
  return "${PIPESTATUS[0]}"
}
what=${1:-}; shift || true
case "$what" in
  tests)
    timeout $LIMIT python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 "$@" \
      2>&1 | tee -a "$OUT/pytest_gpu.log" | grep -v -i warn | tail -40 ;;
  tests-v1)
    # tests/v1 in three pytest processes at once (mostly CPU: the heap reference
    # and Triton compiles); each group's log in $OUT/pytest_v1_<group>.log.
    declare -A groups=(
      [attention]="tests/v1/attention"
      [builder]="tests/v1/spec_decode/test_dflash_tree_builder.py"
      [rest]="tests/v1/sample tests/v1/spec_decode/test_ddtree_config.py \
tests/plugins/test_ddtree_engine_config.py \
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
    # The offline DDTree module, then TREE_ATTN's (reusing its reference
    # engines), next to the serve module; logs in $OUT/pytest_e2e_<module>.log.
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
    # tests/e2e/test_ddtree_serving.py (9 engines side by side); its measured
    # lines also go to $DDTREE_E2E_LOG_DIR/serving_report.log.
    DDTREE_E2E_PARALLEL=${SERVING_PARALLEL:-9} pytest_to \
      "$OUT/pytest_e2e_serving.log" -s "$@" tests/e2e/test_ddtree_serving.py
    rc=$?
    grep -E 'passed|failed|^(FAILED|ERROR)' "$OUT/pytest_e2e_serving.log" | tail -20
    exit $rc ;;
  patched)
    # The offline, serving-path and serve modules against vLLM with the upstream
    # series applied and no plugin (tests/upstream/patched_vllm.py builds it in
    # PATCHED), side by side; logs in $OUT/pytest_patched_<module>.log. The
    # serving module's memory-profiling engine waits for the others to end
    # (tests/e2e/engines.py: gpu_share), so give the mode LIMIT=1200 or more.
    PATCHED=${PATCHED:-build/patched_vllm}
    rm -rf "$PATCHED"
    python3 -m tests.upstream.patched_vllm "$PATCHED" > "$OUT/patched_vllm.log" 2>&1 \
      || { tail -20 "$OUT/patched_vllm.log"; exit 1; }
    export DDTREE_E2E_PATCHED_VLLM=$PATCHED
    pids=()
    for module in test_ddtree_llm test_ddtree_serving test_ddtree_serve; do
      parallel=5
      [ $module = test_ddtree_serving ] && parallel=${SERVING_PARALLEL:-7}
      DDTREE_E2E_PARALLEL=$parallel pytest_to "$OUT/pytest_patched_$module.log" -s \
        "$@" "tests/e2e/$module.py" &
      pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    summarize pytest_patched test_ddtree_llm test_ddtree_serving test_ddtree_serve
    exit $rc ;;
  load)
    # tests/e2e/test_ddtree_load.py: the module shortens its streams to fit
    # DDTREE_LOAD_BUDGET_S and keeps its summary as each phase ends.
    export DDTREE_LOAD_SECONDS=${DDTREE_LOAD_SECONDS:-300}
    export DDTREE_LOAD_BUDGET_S=${DDTREE_LOAD_BUDGET_S:-$((LIMIT - 25))}
    pytest_to "$OUT/pytest_e2e_load.log" -s "$@" tests/e2e/test_ddtree_load.py
    rc=$?
    grep -E '^\[load|: \{|passed|failed|^(FAILED|ERROR)' "$OUT/pytest_e2e_load.log" | tail -40
    exit $rc ;;
  compiles)
    # Two servers at vLLM's defaults, the traffic twice, then the Triton
    # variants met after ready.
    pytest_to "$OUT/pytest_e2e_compiles.log" -s "$@" tests/e2e/test_ddtree_compiles.py
    rc=$?
    grep -E 'after ready|kernel|passed|failed|^(FAILED|ERROR)' \
      "$OUT/pytest_e2e_compiles.log" | tail -40
    exit $rc ;;
  startup-8b)
    # DDTree engines on Qwen3-8B shapes (dummy weights) under vLLM's memory
    # profiling and defaults, one at a time, then a batch of 64 and one request.
    pytest_to "$OUT/pytest_e2e_startup_8b.log" -s "$@" tests/e2e/test_ddtree_startup_memory.py
    rc=$?
    grep -E 'ddtree-|passed|failed|^(FAILED|ERROR)' "$OUT/pytest_e2e_startup_8b.log" | tail -20
    exit $rc ;;
  profile-b1)
    # The trained pair at batch 1 under vLLM's defaults, one config after
    # another (configs: the argument).
    timeout $LIMIT python3 benchmarks/profile_step.py --out "$OUT/profile_b1_defaults" \
      --pair benchmarks/models/pycode --settings defaults \
      --configs "${1:-dflash,ddtree-32,ddtree-auto}" --batch 1 --max-tokens 256 \
      --timing-repeats 2 --limit-seconds $((LIMIT - 20)) 2>&1 \
      | tee "$OUT/profile_b1_defaults.log" | grep -v -i warn | tail -30
    exit "${PIPESTATUS[0]}" ;;
  b1-rounds)
    # The pair under vLLM's defaults at batch 1, each config in fresh processes,
    # ROUNDS rounds (medians in rounds.md). NUMA_BIND=1 adds vLLM's --numa-bind.
    pair_bench "${OUT_NAME:-b1_rounds}" e2e \
      --configs "${1:-dflash,ddtree-auto}" --batches 1 --temperatures 0 \
      --num-prompts 16 --rounds "${ROUNDS:-3}" \
      ${NUMA_BIND:+--engine-arg numa_bind=true}
    exit $? ;;
  serve)
    # vllm serve + vllm bench serve on the pair under vLLM's defaults, T=0 and 1.
    # ROUNDS=N: N fresh servers per config, alternating order. INTERLEAVE=S: the
    # servers side by side, S alternating slices per cell. PIN_CPUS=LIST: every
    # server on the same CPUs once up (a measurement control, labelled).
    pair_bench "${OUT_NAME:-serve}" serve \
      --configs "${1:-none,dflash,ddtree-auto-adaptive,ddtree-1024-adaptive}" --batches "${BATCHES:-1,8,32,64}" \
      --temperatures 0,1 ${ROUNDS:+--rounds $ROUNDS} \
      ${INTERLEAVE:+--interleave $INTERLEAVE} ${PIN_CPUS:+--pin-cpus $PIN_CPUS}
    exit $? ;;
  embed)
    # The trained pair embedded in Qwen3-8B's shapes (about 16 GB in EMBED_DIR;
    # kept if made from the same pair, configs and options); args:
    # embed_pair.py's own (e.g. --vocab full).
    timeout $LIMIT python3 benchmarks/embed_pair.py --out "${EMBED_DIR:-build/pycode-8b}" \
      "$@" 2>&1 | tee "$OUT/embed_pair.log" | tail -5
    exit "${PIPESTATUS[0]}" ;;
  embed-check)
    # The embedded pair against the pair under vLLM: greedy output and DFlash's
    # acceptance (four offline engines side by side).
    timeout $LIMIT python3 benchmarks/embed_pair_check.py \
      --embedded "${EMBED_DIR:-build/pycode-8b}" --out "$OUT/embed_check" "$@" 2>&1 \
      | tee "$OUT/embed_check.log" | grep -v -i warn | tail -8
    exit "${PIPESTATUS[0]}" ;;
  serve-8b)
    # vllm serve + vllm bench serve on the embedded pair (Qwen3-8B shapes) under
    # vLLM's defaults, the configs' servers side by side, each with a fixed KV
    # cache (KV_GIB, default 6). Output in $OUT/${OUT_NAME:-serve_8b}.
    # BUDGET_TRACE=1: DDTree servers record the adaptive budget's decisions
    # (bench_ddtree.py --budget-trace; a diagnostic that costs host time);
    # BUDGET_TRACE=CONFIGS: only those servers (next to unrecorded ones).
    # STEP_TRACE=1: every server records its engine steps (step_recorder.py).
    P=${EMBED_DIR:-build/pycode-8b}
    if grep -q '"vocab_mode": "full"' "$P/embedding.json" 2>/dev/null \
        && [ "${TEMPERATURES:-0,1}" != 0 ]; then
      echo "serve-8b: $P has the full vocabulary, exact at T=0 only: set TEMPERATURES=0" >&2
      exit 2
    fi
    timeout $LIMIT python3 benchmarks/bench_ddtree.py serve --out "$OUT/${OUT_NAME:-serve_8b}" \
      --target $P/target --drafter $P/drafter \
      --prompts benchmarks/models/pycode/eval_prompts.json \
      --configs "${1:-none,dflash,ddtree-auto-adaptive}" --batches "${BATCHES:-1,8,32,64}" \
      --temperatures "${TEMPERATURES:-0,1}" --interleave "${INTERLEAVE:-2}" \
      --num-prompts "${NUM_PROMPTS:-16}" --min-waves "${MIN_WAVES:-4}" \
      --max-prompts "${MAX_PROMPTS:-256}" \
      --engine-arg kv_cache_memory_bytes=$(( ${KV_GIB:-6} << 30 )) \
      $(case "${BUDGET_TRACE:-0}" in 0) ;; 1) echo --budget-trace ;;
        *) echo --budget-trace "$BUDGET_TRACE" ;; esac) \
      $([ "${STEP_TRACE:-0}" != 0 ] && echo --step-trace) \
      ${RESUME:+--resume-from "$RESUME"} --limit-seconds $((LIMIT - 30)) 2>&1 \
      | tee -a "$OUT/${OUT_NAME:-serve_8b}.log" | grep -v -i warn | tail -40
    exit "${PIPESTATUS[0]}" ;;
  record-8b)
    # The real-size record: the embedded pair (written unless EMBED_DIR holds
    # it), then serve-8b's groups one after another, DFlash in each (ratios
    # across groups go through it). Three 8B servers fit 80 GB, four 139 GB.
    # Each group may run LIMIT seconds; output in $OUT/record_<group>.
    P=${EMBED_DIR:-build/pycode-8b}
    bash "$0" embed || exit $?
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    # The default in every group; a cap of 1024 beside it where a fourth
    # server fits.
    if [ "${mem:-0}" -ge 120000 ]; then
      groups=("none,dflash,dflash-schedule,ddtree-auto-adaptive" "dflash,ddtree-auto-adaptive,ddtree-1024-adaptive")
    else
      groups=("none,dflash,ddtree-auto-adaptive" "dflash,dflash-schedule,ddtree-auto-adaptive")
    fi
    rc=0
    for i in "${!groups[@]}"; do
      OUT_NAME=record_$((i + 1)) NUM_PROMPTS=${NUM_PROMPTS:-32} EMBED_DIR=$P \
        bash "$0" serve-8b "${groups[$i]}" || rc=1
    done
    exit $rc ;;
  oracle-8b)
    # The oracle row at real size: DDTree's default next to every constant
    # budget of its ladder, per cell, in one in-process engine
    # (budget_oracle.py). PHASES (C:T:N,...; default the record's cells),
    # BUDGETS (default the ladder), ROUNDS (default 2, order alternated);
    # output in $OUT/${OUT_NAME:-oracle_8b}.
    P=${EMBED_DIR:-build/pycode-8b}
    name=${OUT_NAME:-oracle_8b}
    timeout $LIMIT python3 benchmarks/budget_oracle.py "$OUT/$name" \
      --target $P/target --drafter $P/drafter --kv-gib ${KV_GIB:-6} \
      ${PHASES:+--phases "$PHASES"} ${BUDGETS:+--budgets "$BUDGETS"} \
      --rounds ${ROUNDS:-2} --limit-seconds $((LIMIT - 30)) 2>&1 \
      | tee "$OUT/$name.log" | grep -v -i warn | tail -30
    exit "${PIPESTATUS[0]}" ;;
  trace-8b)
    # The adaptive budget's decisions step by step at real size (the embedded
    # pair, in-process engines), then no speculation over the same phases:
    # PHASES (C:T:N,...), output in $OUT/${OUT_NAME:-trace_8b}. CONFIGS
    # (default "adaptive none") runs them in that order; each config may run
    # LIMIT seconds.
    P=${EMBED_DIR:-build/pycode-8b}
    name=${OUT_NAME:-trace_8b}
    rc=0
    for config in ${CONFIGS:-adaptive none}; do
      timeout $LIMIT python3 benchmarks/trace_budget.py $config "$OUT/$name" \
        --target $P/target --drafter $P/drafter --kv-gib ${KV_GIB:-6} \
        --phases "${PHASES:-64:1:256,32:1:128,64:0:256}" 2>&1 \
        | tee "$OUT/${name}_$config.log" | grep -v -i warn | tail -30
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    # The configs' engine steps side by side, by phase.
    python3 benchmarks/step_recorder.py --phases "$OUT/$name" ${CONFIGS:-adaptive none} \
      2>&1 | tee "$OUT/${name}_steps.md" | tail -40
    exit $rc ;;
  plain-8b)
    # A plain step (every step of an adaptive DDTree engine verifies nothing)
    # against no speculation's, at real size (the embedded pair, in-process
    # engines, T=1, batches of 64 and 32), with a profile at 64: ROUNDS
    # (default "A") rounds of CONFIGS (default none,plain; "tree" verifies
    # TREE_BUDGET-node trees at every step), JOINS new prompts before each
    # timed step (default 0), output in $OUT/${OUT_NAME:-plain_8b}. Each
    # config may run LIMIT seconds.
    P=${EMBED_DIR:-build/pycode-8b}
    name=${OUT_NAME:-plain_8b}
    rc=0
    for round in ${ROUNDS:-A}; do
      for config in $(echo "${CONFIGS:-none,plain}" | tr , ' '); do
        timeout $LIMIT python3 benchmarks/plain_step_overhead.py $config "$OUT/$name" \
          $round --target $P/target --drafter $P/drafter --kv-gib ${KV_GIB:-6} \
          --batches ${BATCHES:-64,32,64,32} --profile-batch 64 \
          --joins ${JOINS:-0} --tree-budget ${TREE_BUDGET:-3} 2>&1 \
          | tee "$OUT/${name}_${config}_$round.log" | grep -v -i warn | tail -3
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      done
    done
    exit $rc ;;
  diagnose-8b)
    # plain-8b, then trace-8b (the default's budget against no speculation
    # under continuous arrivals, every Triton compile timed), each engine
    # allowed a cold start: output in $OUT/plain_8b and $OUT/trace_8b.
    rc=0
    LIMIT=${PLAIN_LIMIT:-300} bash "$0" plain-8b || rc=1
    LIMIT=${TRACE_LIMIT:-420} PHASES=${PHASES:-64:0:128,64:1:256,32:1:128,64:1:256} \
      bash "$0" trace-8b || rc=1
    exit $rc ;;
  mixed-8b)
    # Steps with a prompt chunk at real size: no speculation, plain DDTree
    # steps and 3-node trees at every step, one request ending and one new
    # prompt joining before each timed step (plain-8b's engines, with a
    # profile at 64); JOINS=0 times the same steps without prompts. Output in
    # $OUT/mixed_8b, round J<joins>.
    joins=${JOINS:-1}
    OUT_NAME=mixed_8b CONFIGS=${CONFIGS:-none,plain,tree} ROUNDS=J$joins JOINS=$joins \
      BATCHES=${BATCHES:-64,32} bash "$0" plain-8b
    exit $? ;;
  profile-8b)
    # Qwen3-8B shapes (dummy weights), batch 1: the steps of budgets 127 and 255
    # against DFlash's, by kernel category.
    timeout $LIMIT python3 benchmarks/profile_step.py --out "$OUT/profile_8b_b1" \
      --configs "${1:-dflash,ddtree-127,ddtree-255}" --batch 1 \
      --limit-seconds $((LIMIT - 20)) 2>&1 \
      | tee "$OUT/profile_8b_b1.log" | grep -v -i warn | tail -40
    exit "${PIPESTATUS[0]}" ;;
  bench-ops)
    timeout $LIMIT python3 benchmarks/bench_tree_ops.py --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/bench_tree_ops.log" | tail -30 ;;
  top-search)
    # The tree builder's top-token search: compile time (cold Triton cache)
    # and speed per builder copy, e.g. --builder old=FILE --builder new=FILE.
    timeout $LIMIT python3 benchmarks/bench_top_search.py --out "$OUT/top_search" "$@" \
      2>&1 | tee "$OUT/bench_top_search.log" | grep -v -i warn | tail -30
    exit "${PIPESTATUS[0]}" ;;
  bench-attn)
    timeout $LIMIT python3 benchmarks/bench_tree_attn.py --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/bench_tree_attn.log" | tail -40 ;;
  bench-ddtree)
    timeout $LIMIT python3 benchmarks/bench_ddtree.py "$@" 2>&1 \
      | tee -a "$OUT/bench_ddtree.log" | tail -40 ;;
  train-pair)
    # The train_pair steps not yet done (benchmarks/train_pair/run_all.sh).
    timeout $LIMIT bash benchmarks/train_pair/run_all.sh "${1:-$((LIMIT - 20))}" \
      2>&1 | tee -a "$OUT/train_pair.log" | tail -30 ;;
  *)
    echo "usage: $0 tests|tests-v1|e2e|serving|patched|load|compiles|startup-8b|profile-b1|b1-rounds|serve|embed|embed-check|serve-8b|record-8b|oracle-8b|trace-8b|plain-8b|diagnose-8b|mixed-8b|profile-8b|bench-ops|top-search|bench-attn|bench-ddtree|train-pair [args]" >&2
    exit 2 ;;
esac
