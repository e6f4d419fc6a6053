#!/usr/bin/env bash
# ofl on a machine with a GPU, in one call: what can only be checked there.
#
# For a GPU machine that has the CUDA toolkit, meson, ninja and python3 with
# torch, and perhaps no Criterion, no MPI and no network (the unit suites and
# the MPI demo are then not built; everything below is). It builds a release
# tree (build-gpu), then runs, each step bounded by a timeout:
#   1. ofl-info (which runtime, driver and GPU ofl sees);
#   2. the gpu test suite (tests/gpu and the demo's kernels against the CPU);
#   3. bench/ofl_bench_gpu (copies through ofl against plain cudaMemcpyAsync,
#      pinned allocation against cudaHostAlloc);
#   4. the demo without MPI on the GPU: 1F1B and interleaved, bit-identity
#      with and without offload, then bench/ofl_bench_overlap (step time with
#      offload / without where copies and compute are comparable);
#   5. the python tests and the hook bench (host backend; torch on the CPU).
# Everything goes to OUTDIR/report.txt (a step's whole output to its own
# file; eight files in all). Exits 0; the report says what failed.
#
# Usage: tools/gpu_session.sh [OUTDIR]   (default: $OUT, else gpu-report)
# Environment: GPU_SESSION_SKIP="python overlap" leaves steps out.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-gpu-report}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
build="$here/build-gpu"
report="$out/report.txt"
: >"$report"

say() { printf '%s\n' "$*" | tee -a "$report"; }
skip() { case " ${GPU_SESSION_SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }

# step NAME SECONDS COMMAND...: runs it, whole output to NAME.txt, its last
# 60 lines and exit status to the report.
step() {
  local name=$1 secs=$2
  shift 2
  say ""
  say "== $name ($(date -u +%H:%M:%S)): $*"
  if [ "$(type -t "$1")" = function ]; then
    "$@" >"$out/$name.txt" 2>&1 # (a shell function: no timeout)
  else
    timeout "$secs" "$@" >"$out/$name.txt" 2>&1
  fi
  local rc=$?
  tail -n 60 "$out/$name.txt" >>"$report"
  say "== $name: exit $rc$([ "$rc" = 124 ] && echo " (timed out after ${secs}s)")"
  return 0
}

say "ofl GPU session, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')"
say "$(nvidia-smi -L 2>&1 | head -4)"
say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4)"
say "nvcc: $(nvcc --version 2>&1 | tail -n 2 | head -n 1)"

configure() {
  if [ -d "$build" ]; then
    meson setup --reconfigure "$build" "$here" -Dbuildtype=release
  else
    meson setup "$build" "$here" -Dbuildtype=release
  fi && ninja -C "$build"
}
step build 900 configure

step info 60 "$build/tools/ofl-info"
step gpu_suite 600 meson test -C "$build" --suite gpu --no-rebuild --print-errorlogs
step bench_gpu 300 "$build/bench/ofl_bench_gpu"

demo="$build/examples/ofl_pipeline_demo_single"
{
  for args in "--stages 4 --stage 0 --microbatches 8 --layers 2" \
              "--stages 4 --stage 3 --microbatches 8 --layers 2" \
              "--stages 2 --stage 0 --microbatches 8 --vpp 2 --layers 1"; do
    echo "-- $demo --backend cuda $args --hidden 1024 --seq 1024 --iters 4 --check-memory"
    # shellcheck disable=SC2086
    timeout 200 "$demo" --backend cuda $args --hidden 1024 --seq 1024 --iters 4 \
      --check-memory 2>&1 | grep -v '^\[' 
    echo "-- exit ${PIPESTATUS[0]}"
  done
} >"$out/demo.txt" 2>&1
say ""
say "== demo: $(grep -c 'with and without offload: yes' "$out/demo.txt") of 3 runs bit-identical"
grep -E "^ofl pipeline demo: backend|^ofl_pipeline_demo_single|^step time|bit-identical|GPU memory in use|^-- |^[0-9]+ +[0-9.]+Mi" "$out/demo.txt" >>"$report"

skip overlap || step overlap 590 "$build/bench/ofl_bench_overlap" "$demo"

if ! skip python && python3 -c 'import torch' >/dev/null 2>&1; then
  export OFL_LIBRARY="$build/libofl.so" PYTHONPATH="$here/python:$build/python"
  {
    OFL_BACKEND=host python3 "$here/tests/python/test_torch.py" 2>&1 | tail -n 15
    OFL_BACKEND=host python3 "$here/bench/bench_torch_hooks.py" 2>&1
  } >"$out/python.txt" 2>&1
  say ""
  say "== python (host backend)"
  tail -n 30 "$out/python.txt" >>"$report"
fi
say ""
say "done $(date -u +%H:%M:%S)"
exit 0
