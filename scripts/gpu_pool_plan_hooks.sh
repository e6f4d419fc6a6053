#!/usr/bin/env bash
# On a lent GPU, after tools/gpu_session.sh has built its tree (default
# build-gpu): the MoE pools' backend calls and held/peak, the auto plan's
# peaks against its memory targets, and the ofl.torch hooks' cost. Each
# check runs under its own timeout and a failing one does not stop the
# next; everything goes to stdout.
#   1. issue 25: the MoE pool workload on the cuda backend (real cudaMalloc
#      and cudaHostRegister calls in the counted iterations, held/peak);
#   2. issue 26: the demo's auto plan on the cuda backend (real copies and
#      timing events): a roomy target first (the plan's all/none peaks),
#      then targets between them, each against --offload all;
#   3. issue 22: the ofl.torch hook bench on this machine's quiet cores
#      (host backend, CPU tensors).
# Not by default (name them in GPU_CHECK_ONLY):
#   seeds: issue 25's MoE workload over draws GPU_CHECK_SEEDS (default
#      "1 40"), GPU_CHECK_PAR at a time (4), through scripts/moe_pool_draws.sh;
#   planbench: issue 26's benchmark (bench/ofl_bench_auto_plan.py, host
#      backend with an emulated link) on this machine's quiet cores,
#      --iters 8 --repeat 3 --jobs GPU_CHECK_PAR, its PNG to $OUT (or
#      the current folder);
#   steps: issue 22's per-saved-tensor step bench alone (--step-only),
#      twice.
# Usage: scripts/gpu_pool_plan_hooks.sh [BUILD] [SECONDS]  (SECONDS: the budget
# for all, default 240). GPU_CHECK_ONLY="pool plan hooks" (the default)
# picks checks; they run in the order pool, seeds, plan, planbench, steps,
# hooks; GPU_CHECK_ITERS the demo's
# iterations (6), GPU_CHECK_HIDDEN its hidden size and sequence (256),
# GPU_CHECK_BACKEND its backend (cuda).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build-gpu}
budget=${2:-240}
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
run() { # run SECONDS COMMAND...: under the smaller of SECONDS and what is left
  local s=$1
  shift
  local l
  l=$(left)
  [ "$s" -gt "$l" ] && s=$l
  if [ "$s" -lt 5 ]; then
    echo "-- skipped (budget spent): $*"
    return 0
  fi
  echo "-- $(date -u +%H:%M:%S) at most ${s}s: $*"
  timeout -k 3 "$s" "$@" 2>&1 | grep -v '^\['
  echo "-- exit ${PIPESTATUS[0]}"
}

only=" ${GPU_CHECK_ONLY:-pool plan hooks} "
if [[ $only == *" pool "* ]]; then
echo "== issue 25: MoE pools on cuda"
run 60 "$build/bench/ofl_bench_moe_pool" cuda
fi

if [[ $only == *" seeds "* ]]; then
echo "== issue 25: MoE pools on cuda, many draws"
read -r sfirst slast <<<"${GPU_CHECK_SEEDS:-1 40}"
BUILD=$build run 200 "$here/scripts/moe_pool_draws.sh" cuda "$sfirst" "$slast" "${GPU_CHECK_PAR:-4}"
fi

if [[ $only == *" plan "* ]]; then
echo "== issue 26: auto plan on cuda"
demo="$build/examples/ofl_pipeline_demo_single"
shape=(--backend "${GPU_CHECK_BACKEND:-cuda}" --stages 4 --stage 0 --microbatches 8 --layers 2
       --hidden "${GPU_CHECK_HIDDEN:-256}" --seq "${GPU_CHECK_HIDDEN:-256}" --iters "${GPU_CHECK_ITERS:-6}" --check-memory)
roomy=$(mktemp)
run 40 "$demo" "${shape[@]}" --offload auto --memory-target 100000 | tee "$roomy"
# "all offloaded X, none Y" of the plan line
read -r all none < <(sed -n 's/.*all offloaded \([0-9.]*\), none \([0-9.]*\).*/\1 \2/p' "$roomy" | head -1)
run 40 "$demo" "${shape[@]}" --offload all | grep -E 'step time|bit-identical|ledger|^0 '
if [ -n "${all:-}" ] && [ -n "${none:-}" ]; then
  for k in 0 1 2 3; do
    t=$(awk -v a="$all" -v n="$none" -v k="$k" 'BEGIN { printf "%.2f", a + (n - a) * (k + 0.5) / 4 }')
    echo "- target $t MiB (all offloaded $all, none $none)"
    OFL_DEBUG=INFO run 40 "$demo" "${shape[@]}" --offload auto --memory-target "$t" |
      grep -E 'step time|bit-identical|predicted peak|within the memory target|ledger|^ +0 |solved again|auto plan, iteration'
  done
else
  echo "no plan line in the roomy run"
fi
fi

if [[ $only == *" planbench "* ]]; then
echo "== issue 26: the auto plan bench (host backend, emulated link, quiet cores)"
run 240 python3 "$here/bench/ofl_bench_auto_plan.py" "$build/examples/ofl_pipeline_demo_single" \
  --iters 8 --repeat 3 --jobs "${GPU_CHECK_PAR:-4}" --out "${OUT:-.}/ofl_bench_auto_plan.png"
fi

if [[ $only == *" steps "* ]]; then
echo "== issue 22: per saved tensor on a small GPT step (host backend, quiet cores), twice"
for k in 1 2; do
  run 60 env OFL_LIBRARY="$build/libofl.so" OFL_DEBUG=WARN OFL_BACKEND=host \
    PYTHONPATH="$here/python:$build/python" python3 "$here/bench/bench_torch_hooks.py" --step-only
done
fi

if [[ $only == *" hooks "* ]]; then
echo "== issue 22: ofl.torch hooks (host backend, quiet cores)"
run 90 env OFL_LIBRARY="$build/libofl.so" OFL_DEBUG=WARN OFL_BACKEND=host \
  python3 "$here/bench/bench_torch_hooks.py"
fi
echo "== done after $(($(date +%s) - start))s"
