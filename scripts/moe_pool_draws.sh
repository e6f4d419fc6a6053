#!/usr/bin/env bash
# The MoE pool benchmark (bench/ofl_bench_moe_pool) over many draws: one
# line per seed with each pool's backend calls in the counted iterations and
# its bytes held / peak in use, then how many runs made any call and the
# worst ratio. For issue 25's "0 calls on every draw, held / peak <= 1.3".
#
# Usage: scripts/moe_pool_draws.sh BACKEND [FIRST [LAST [PARALLEL]]]
#   BACKEND: host, cuda (a GPU, or the stand-in with
#   LD_LIBRARY_PATH=BUILD/tests/cudasim); seeds FIRST..LAST (default 1..20),
#   PARALLEL runs at a time (default 1: concurrent runs share the copy
#   engines and change the timing that placement depends on).
# Environment: BUILD (default build), MOE_TIMEOUT (seconds a run, 120).
set -u
backend=${1:?usage: scripts/moe_pool_draws.sh BACKEND [FIRST [LAST [PARALLEL]]]}
first=${2:-1}
last=${3:-20}
par=${4:-1}
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
bin=$build/bench/ofl_bench_moe_pool
[ -x "$bin" ] || { echo "moe_pool_draws: $bin not built" >&2; exit 2; }
tmp=$(mktemp -d)
# stopped from outside (a timeout): the runs still going stop too
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
trap 'exit 143' TERM INT

running=0
for s in $(seq "$first" "$last"); do
  OFL_BENCH_SEED=$s timeout -k 3 "${MOE_TIMEOUT:-120}" "$bin" "$backend" \
    >"$tmp/$s.txt" 2>&1 &
  running=$((running + 1))
  if [ "$running" -ge "$par" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

printf '%-6s %-22s %-22s %-16s %s\n' seed "activations a/f ratio" "offload-host a/f ratio" "device a/f, pinned a/f" "wrong bytes"
calls=0 runs=0 failed=0 wrongruns=0 worst=0
for s in $(seq "$first" "$last"); do
  f=$tmp/$s.txt
  runs=$((runs + 1))
  line() { # pool name -> "allocs/frees ratio"
    sed -n "s/.*pool $1 *backend allocs *\([0-9]*\) frees *\([0-9]*\).*held\/peak \([0-9.]*\).*/\1\/\2 \3/p" "$f" | head -1
  }
  a=$(line activations)
  h=$(line offload-host)
  wrong=$(sed -n 's/.*wrong bytes \([0-9]*\).*/\1/p' "$f" | head -1)
  # the device's own counts (on cuda: cudaMalloc/cudaFree, cudaHostRegister/
  # cudaHostUnregister or cudaHostAlloc/cudaFreeHost)
  d=$(sed -n 's/.*device allocs \([0-9]*\) frees \([0-9]*\), pinned allocs \([0-9]*\) frees \([0-9]*\).*/\1\/\2 \3\/\4/p' "$f" | head -1)
  if [ -z "$a" ] || [ -z "$h" ] || [ -z "$wrong" ]; then
    failed=$((failed + 1))
    printf '%-6s run failed: %s\n' "$s" "$(grep -v '^\[' "$f" | tail -n 1)"
    continue
  fi
  printf '%-6s %-22s %-22s %-16s %s\n' "$s" "$a" "$h" "${d:--}" "$wrong"
  n=$(echo "$a $h ${d:-0/0 0/0}" | awk '{n = 0; for (i = 1; i <= 6; i++) if (i != 2 && i != 4) { split($i, x, "/"); n += x[1] + x[2] } print n}')
  [ "$n" -gt 0 ] && calls=$((calls + 1))
  [ "$wrong" -gt 0 ] && wrongruns=$((wrongruns + 1))
  worst=$(echo "$a $h $worst" | awk '{m = $5; if ($2 > m) m = $2; if ($4 > m) m = $4; print m}')
done
echo "moe_pool_draws $backend: $runs runs (seeds $first-$last, $par at a time), $calls with a backend call in the counted iterations, $wrongruns with wrong bytes, $failed failed; worst held/peak $worst"
[ "$failed" -eq 0 ] && [ "$wrongruns" -eq 0 ]
