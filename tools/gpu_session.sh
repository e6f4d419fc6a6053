#!/usr/bin/env bash
# ofl on a machine with a GPU, in one call that ends within a budget: what
# can only be checked there.
#
# For a lent GPU machine (CUDA toolkit, meson, ninja, python3 with torch;
# perhaps no Criterion, no MPI, no network), where one command may run 10
# minutes and a session has 15 minutes of GPU time in all. Everything runs
# under one budget (GPU_SESSION_BUDGET seconds, default 540): each step gets
# the smaller of its own limit and what is left (less a reserve for the
# report), a step that fails or times out does not stop the next, and the
# script exits 0 before the budget is spent. Steps, most telling first:
#   1. nvidia-smi and ofl-info (which runtime, driver and GPU ofl sees);
#   2. the build: a tree carried prebuilt from a CPU machine (both are
#      x86-64: `meson setup build-gpu -Dbuildtype=release && ninja -C
#      build-gpu`, then carry build-gpu) is only brought up to date, and
#      configured again where it does not build or run there (a tree
#      configured beside Criterion, liburing or MPI links them); else it
#      is configured and built with -j16 under its own timeout;
#   3. the gpu test programs by name (tests/gpu: the pipeline schedule, the
#      copy bandwidth, the stager, NCCL where built);
#   4. compute-sanitizer --tool memcheck on the pipeline schedule test;
#   5. the demo's CUDA path without MPI: 1F1B and interleaved, bit-identical
#      with and without offload;
#   6. ofl.torch on CUDA (tests/gpu/test_torch_cuda.py: offload_activations
#      and the Megatron markers bitwise, peak memory, the stager after a side
#      stream, forward_record in a captured graph);
#   7. the copy bench against plain cudaMemcpyAsync;
#   8. the peers bench (bench/peers/peers.py) at its defaults, the clients'
#      wheels installed from a carried folder (see peers_run below).
# Everything goes to OUTDIR/report.txt (a step's whole output to its own
# file beside it).
#
# Usage: tools/gpu_session.sh [OUTDIR]   (default: $OUT, else gpu-report)
# Environment: GPU_SESSION_BUDGET (seconds, default 540),
#   GPU_SESSION_BUILD (the build tree, default build-gpu),
#   GPU_SESSION_SKIP="sanitizer bench ..." leaves steps out (names as in the
#   report: info build gpu_tests sanitizer demo torch bench peers).
set -u
start=$(date +%s)
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-gpu-report}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${GPU_SESSION_BUILD:-$here/build-gpu}
budget=${GPU_SESSION_BUDGET:-540}
reserve=10
report="$out/report.txt"
: >"$report"

say() { printf '%s\n' "$*" | tee -a "$report"; }
skip() { case " ${GPU_SESSION_SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
left() { echo $((budget - reserve - ($(date +%s) - start))); }

# step NAME SECONDS COMMAND...: runs it under the smaller of SECONDS and the
# budget left, whole output to NAME.txt, its last 40 lines and exit status
# to the report. A step the budget has no room for is reported as skipped.
step() {
  local name=$1 secs=$2
  shift 2
  if skip "$name"; then
    say "== $name: skipped (GPU_SESSION_SKIP)"
    return 0
  fi
  local room
  room=$(left)
  [ "$secs" -gt "$room" ] && secs=$room
  if [ "$secs" -lt 5 ]; then
    say "== $name: skipped (budget spent: ${budget}s)"
    return 0
  fi
  say ""
  say "== $name ($(date -u +%H:%M:%S), at most ${secs}s): $*"
  timeout -k 5 "$secs" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.txt" >>"$report"
  say "== $name: exit $rc$([ "$rc" = 124 ] && echo " (timed out after ${secs}s)")"
  return 0
}

say "ofl GPU session, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?'), budget ${budget}s"
say "$(nvidia-smi -L 2>&1 | head -4)"
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4)"
say "nvcc: $(nvcc --version 2>&1 | tail -n 2 | head -n 1)"

build_tree() {
  if [ -f "$build/build.ninja" ]; then
    # carried prebuilt: brought up to date; a tree configured where other
    # libraries were found (Criterion, liburing, MPI) does not build or
    # run here: it is configured again
    ninja -C "$build" -j16 && "$build/tools/ofl-info" >/dev/null 2>&1 && return 0
    echo "the carried $build does not build or run here: configuring it again"
    rm -rf "$build"
  fi
  meson setup "$build" "$here" -Dbuildtype=release && ninja -C "$build" -j16
}
export -f build_tree
export build here
step build 300 bash -c build_tree

step info 30 "$build/tools/ofl-info"

gpu_tests() {
  local names
  names=$(meson test -C "$build" --list --suite gpu --no-rebuild 2>/dev/null |
    awk '{print $NF}' | sed 's/^ofl://' | grep '^gpu_' | grep -v '^gpu_torch_cuda$')
  # (meson's --list prints "ofl:gpu / NAME" in 1.0 and "gpu - ofl:NAME" in
  # later ones; an empty list would run every test)
  [ -n "$names" ] || { echo "no gpu tests listed"; return 1; }
  # shellcheck disable=SC2086
  meson test -C "$build" --no-rebuild --print-errorlogs --logbase gpu-session $names
}
export -f gpu_tests
step gpu_tests 150 bash -c gpu_tests

if command -v compute-sanitizer >/dev/null 2>&1 && [ -x "$build/tests/gpu/gpu_pipeline_schedule" ]; then
  step sanitizer 90 env OFL_BACKEND=cuda compute-sanitizer --tool memcheck \
    --error-exitcode 3 "$build/tests/gpu/gpu_pipeline_schedule"
else
  say "== sanitizer: not run (compute-sanitizer or the test program missing)"
fi

demo_runs() {
  local demo="$build/examples/ofl_pipeline_demo_single" args
  for args in "--stages 4 --stage 0 --microbatches 8 --layers 2" \
              "--stages 2 --stage 0 --microbatches 8 --vpp 2 --layers 1"; do
    echo "-- $demo --backend cuda $args --hidden 1024 --seq 1024 --iters 3 --check-memory"
    # shellcheck disable=SC2086
    "$demo" --backend cuda $args --hidden 1024 --seq 1024 --iters 3 --check-memory 2>&1 |
      grep -v '^\['
    echo "-- exit ${PIPESTATUS[0]}"
  done
}
export -f demo_runs
step demo 120 bash -c demo_runs
[ -f "$out/demo.txt" ] &&
  say "== demo: $(grep -c 'with and without offload: yes' "$out/demo.txt") of 2 runs bit-identical"

if python3 -c 'import torch' >/dev/null 2>&1; then
  step torch 150 env OFL_LIBRARY="$build/libofl.so" PYTHONPATH="$here/python:$build/python" \
    OFL_DEBUG=WARN python3 "$here/tests/gpu/test_torch_cuda.py"
else
  say "== torch: not run (torch is not importable)"
fi

step bench 60 "$build/bench/ofl_bench_gpu"

# The peers bench at its defaults (bench/peers/peers.py: Megatron-Core's
# GPTModel and a Llama decoder, each method in its own process). The GPU
# machine has no network: the clients' wheels travel in GPU_SESSION_WHEELS
# (default gpu-wheels/, an ignored folder made on a CPU machine with
# `pip download --no-deps megatron-core torchtune "torchao<0.16" -d
# gpu-wheels` and carried) and are installed from there when they do not
# import. A client that is still missing makes its rows say so.
peers_run() {
  local wheels=${GPU_SESSION_WHEELS:-$here/gpu-wheels}
  if ! python3 -c 'import megatron.core, torchtune' >/dev/null 2>&1 && [ -d "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --find-links "$wheels" \
      megatron-core torchtune "torchao<0.16" || echo "-- the carried wheels did not install"
  fi
  env OFL_LIBRARY="$build/libofl.so" PYTHONPATH="$here/python:$build/python" \
    OFL_DEBUG=WARN python3 "$here/bench/peers/peers.py" --out "$out/peers.md"
}
export -f peers_run
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  step peers 300 bash -c peers_run
else
  say "== peers: not run (no torch with a CUDA device here; the CPU smoke is a test: python_peers_smoke)"
fi

say ""
say "done $(date -u +%H:%M:%S), $(($(date +%s) - start))s of ${budget}s"
exit 0
