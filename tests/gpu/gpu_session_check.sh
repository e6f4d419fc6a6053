#!/usr/bin/env bash
# tools/gpu_session.sh on the stand-in (cudasim): the script a lent GPU
# machine runs ends within its budget, every step bounded, and writes its
# report (the torch step skips: the stand-in cannot host torch, whose own
# CUDA runtime sees no GPU here). Exits 0 when it did, 1 otherwise.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
budget=${GPU_SESSION_BUDGET:-60}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
t0=$(date +%s)
bash "$here/tools/gpu_session.sh" "$out" >/dev/null 2>&1
rc=$?
took=$(($(date +%s) - t0))
fail=0
check() { if eval "$2"; then echo "ok - $1"; else echo "not ok - $1"; fail=1; fi; }
check "exits 0 (got $rc)" '[ "$rc" = 0 ]'
check "ends within its budget: ${took}s of ${budget}s" '[ "$took" -le $((budget + 5)) ]'
check "report written" '[ -s "$out/report.txt" ]'
check "ofl-info ran" 'grep -q "^== info: exit" "$out/report.txt"'
check "the gpu programs ran" 'grep -q "^== gpu_tests: exit" "$out/report.txt"'
check "the report ends" 'grep -q "^done .*s of ${budget}s" "$out/report.txt"'
[ "$fail" = 0 ] || sed 's/^/# /' "$out/report.txt"
exit $fail
