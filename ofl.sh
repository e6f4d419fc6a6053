#!/usr/bin/env bash
# ofl: the one script. Installs what the project needs on a fresh Debian
# machine, configures and builds, then runs a task.
#
#   ./ofl.sh demo [args]   the main job: the multi-rank pipeline demo
#   ./ofl.sh test          every test (unit, mpi, C++ headers); ends "N passed, M failed"
#   ./ofl.sh asan | tsan | valgrind   the tests under a sanitizer or valgrind
#   ./ofl.sh sanitizer-builds   compile the sanitizer builds only (gcc asan, tsan; clang asan)
#   ./ofl.sh soak          thousands of drawn workloads and the full interrupt sweep
#   ./ofl.sh bench         the benchmarks
#   ./ofl.sh setup         install packages and configure only
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
BUILD="${OFL_BUILD_DIR:-build}"
QUIET_OPTS=()
# The sanitizer builds: debug (-O0 -g), -Werror as every build of ofl.sh.
ASAN_MESON=(-Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug
  -Dtests=true -Dexamples=true -Dbench=true)
TSAN_MESON=(-Db_sanitize=thread -Db_lundef=false -Dbuildtype=debug
  -Dtests=true -Dexamples=true -Dbench=true)

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Loopback-only, no interactive prompts from OpenMPI in containers.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
export OMPI_MCA_rmaps_base_oversubscribe=1

PACKAGES=(meson ninja-build pkg-config gcc g++ python3 python3-dev libcriterion-dev
  libopenmpi-dev openmpi-bin liburing-dev fio gnuplot-nox valgrind cmake)

log() { printf 'ofl.sh: %s\n' "$*" >&2; }

install_packages() {
  # A machine without apt (a lent GPU machine, say) builds with what it has:
  # meson leaves out what it does not find (Criterion: the unit tests; MPI:
  # the multi-rank demo, which then runs as one process, see demo below).
  if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
    log "no apt on this machine: building with what is installed"
    return 0
  fi
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  if ! { $sudo apt-get update -qq && \
         $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
    log "could not install ${missing[*]} (offline?): building with what is installed"
  fi
}

# configure DIR [meson options...]: creates or reconfigures a build directory.
configure() {
  local dir="$1"; shift
  if [ -f "$dir/build.ninja" ]; then
    meson configure "$dir" -Dwerror=true "$@" >/dev/null
  else
    meson setup "$dir" -Dwerror=true "$@"
  fi
}

build() {
  local dir="$1"; shift
  install_packages
  configure "$dir" "$@"
  ninja -C "$dir"
}

# build_quiet DIR LOG TARGET...: configures DIR (with the meson options in
# QUIET_OPTS) and builds only TARGETs (and
# what they need), meson's and ninja's output going to LOG; on failure the
# end of LOG is shown. A TARGET may be A|B: the first of them that DIR
# defines; targets DIR does not define are left out.
build_quiet() {
  local dir="$1" log="$2"; shift 2
  install_packages
  mkdir -p "$(dirname "$log")"
  if ! configure "$dir" "${QUIET_OPTS[@]}" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    log "configuring $dir failed; the whole output is in $log"
    return 1
  fi
  local known targets=()
  known="$(ninja -C "$dir" -t targets all 2>/dev/null | cut -d: -f1)"
  local alt t
  for alt in "$@"; do
    for t in ${alt//|/ }; do
      if grep -qxF "$t" <<<"$known"; then targets+=("$t"); break; fi
    done
  done
  log "building ${targets[*]} and what they need (output: $log)"
  if ! ninja -C "$dir" "${targets[@]}" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    log "building ${targets[*]} failed; the whole output is in $log"
    return 1
  fi
}

# The python suite (tests/python: ofl.torch) needs torch and numpy; installed
# from PyPI only when not importable (the Linux wheel and its CUDA libraries
# are large: about 2-3 minutes on a fast link). The tests use the build
# tree's libofl (OFL_LIBRARY), python/ from the source tree and the C
# extension ofl._ext that the build compiles into build/python/ofl (from
# python/ofl/meson.build, with python3-dev's headers), so the ofl package
# itself needs no install, nor meson-python (which `pip install ./python`
# fetches into its isolated build environment). OFL_NO_TORCH_INSTALL=1 skips
# this (the python suite then reports itself skipped).
install_torch() {
  [ "${OFL_NO_TORCH_INSTALL:-0}" = 1 ] && return 0
  if ! python3 -c 'import torch, numpy' >/dev/null 2>&1; then
    log "installing torch and numpy for the python tests (pip)"
    python3 -m pip install -q torch numpy || {
      log "torch install failed: the python tests will be skipped"; return 0; }
  fi
  # the real clients of tests/python/test_client_*.py, each only when it is
  # not importable (about 2 minutes for all of them beside an installed
  # torch); torchtune 0.6.1 imports with torchao up to 0.15
  local pkgs=""
  python3 -c 'import megatron.core' >/dev/null 2>&1 || pkgs="$pkgs megatron-core"
  python3 -c 'import torchtune.training' >/dev/null 2>&1 || pkgs="$pkgs torchtune torchao<0.16"
  python3 -c 'import transformers' >/dev/null 2>&1 || pkgs="$pkgs transformers"
  if [ -n "$pkgs" ]; then
    log "installing$pkgs for the client tests (pip)"
    # shellcheck disable=SC2086
    python3 -m pip install -q $pkgs || log "client install failed: their tests will be skipped"
  fi
}

# summarize DIR [SETUP]: one line "N passed, M failed" from meson's test log
# (a test setup writes testlog-SETUP.json).
summarize() {
  python3 "$here/.ci/summarize.py" "$1/meson-logs/testlog${2:+-$2}.json"
}

run_tests() {
  local dir="$1" setup="${2:-}"; shift 2 || true
  local rc=0
  # The totals come from this run's log only: a run that writes none (a
  # build configured without tests: meson's "No tests defined.") must not
  # report the last run's counts.
  rm -f "$dir/meson-logs/testlog${setup:+-$setup}.json"
  if [ -n "$setup" ]; then
    meson test -C "$dir" --setup "$setup" --print-errorlogs "$@" || rc=$?
  else
    meson test -C "$dir" --print-errorlogs "$@" || rc=$?
  fi
  summarize "$dir" "$setup" || rc=1
  return $rc
}

# sanitizer_tests DIR SETUP WHAT PYTHON_SELECTION... -- [ARGS...]: the C
# suites under SETUP, then PYTHON_SELECTION under SETUP_python (the
# interpreter with the sanitizer's runtime preloaded), and one line adding
# both up. ARGS (meson test's: test names, --suite ...) select within the C
# setup, and the python part is left out then: a name of one part would
# match nothing in the other.
sanitizer_tests() {
  local dir="$1" setup="$2" what="$3"; shift 3
  local py=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do py+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  local rc=0
  run_tests "$dir" "$setup" "$@" || rc=$?
  [ $# -gt 0 ] && return $rc
  install_torch
  log "$what (setup ${setup}_python)"
  run_tests "$dir" "${setup}_python" "${py[@]}" || rc=$?
  python3 "$here/.ci/summarize.py" "$dir/meson-logs/testlog-$setup.json" \
    "$dir/meson-logs/testlog-${setup}_python.json" || rc=1
  return $rc
}

task="${1:-help}"
[ $# -gt 0 ] && shift
case "$task" in
  setup)
    install_packages
    configure "$BUILD"
    ;;
  demo)
    # The main job: the pipeline demo on 4 ranks (OFL_DEMO_RANKS to change),
    # writing the memory curves next to the build. Only the demo, the
    # library and the demo's GPU module (where nvcc is) are built, quietly:
    # the tests, benches and the Python extension wait for `./ofl.sh test`.
    demo_log="$BUILD/meson-logs/ofl-demo-build.log"
    demo_target=examples/ofl_pipeline_demo_single
    command -v mpirun >/dev/null 2>&1 && demo_target="examples/ofl_pipeline_demo|$demo_target"
    # The demo needs the examples: a build directory configured without them
    # (an install's -Dexamples=false) is configured with them again.
    QUIET_OPTS=(-Dexamples=true)
    build_quiet "$BUILD" "$demo_log" "$demo_target" examples/libofl_demo_kernels_cuda.so
    out="$here/$BUILD"
    case "$BUILD" in /*) out="$BUILD" ;; esac
    if [ ! -x "$BUILD/examples/ofl_pipeline_demo" ] && [ ! -x "$BUILD/examples/ofl_pipeline_demo_single" ]; then
      log "the demo was not built in $BUILD; meson's and ninja's output is in $demo_log"
      exit 1
    fi
    if command -v mpirun >/dev/null 2>&1 && [ -x "$BUILD/examples/ofl_pipeline_demo" ]; then
      exec mpirun -n "${OFL_DEMO_RANKS:-4}" --oversubscribe \
        "$BUILD/examples/ofl_pipeline_demo" \
        --memory-csv "$out/demo-memory.csv" --memory-png "$out/demo-memory.png" "$@"
    fi
    # Without MPI: one process runs the first stage's schedule of the same
    # pipeline, the other stages' messages generated (ofl_pipeline_demo_single).
    if command -v mpirun >/dev/null 2>&1; then
      log "mpirun is here but meson found no MPI library to build the multi-rank demo with (see $demo_log): running stage 0 of ${OFL_DEMO_RANKS:-4} in one process (ofl_pipeline_demo_single)"
    else
      log "no mpirun here: running stage 0 of ${OFL_DEMO_RANKS:-4} in one process (ofl_pipeline_demo_single)"
    fi
    exec "$BUILD/examples/ofl_pipeline_demo_single" --stages "${OFL_DEMO_RANKS:-4}" --stage 0 \
      --memory-csv "$out/demo-memory.csv" --memory-png "$out/demo-memory.png" "$@"
    ;;
  test)
    # Every test needs the tests, the examples (the demo suite) and the
    # benches (their smoke tests) built: options an install may have
    # switched off in this directory are switched on again.
    build "$BUILD" -Dtests=true -Dexamples=true -Dbench=true
    install_torch
    run_tests "$BUILD" "" "$@"
    ;;
  asan)
    # The C suites under ASan+UBSan, then the python suite (ofl.torch: its
    # tests, the client tests and the load loops) against the same
    # instrumented libofl and extension, libasan preloaded into Python.
    build build-asan "${ASAN_MESON[@]}"
    sanitizer_tests build-asan asan "the python suite under AddressSanitizer" \
      --suite python --no-suite install -- "$@"
    ;;
  tsan)
    # The TAP suites under ThreadSanitizer, then the python tests that drive
    # the copy workers (the load loops, the hooks' suite, the stager) with
    # libtsan preloaded into Python.
    build build-tsan "${TSAN_MESON[@]}"
    sanitizer_tests build-tsan tsan "the python tests that drive the copy workers under ThreadSanitizer" \
      python_load_loop python_torch python_stager -- "$@"
    ;;
  sanitizer-builds)
    # What CI compiles beside the tests: the asan and tsan builds at their
    # own -O0 with -Werror, where gcc warns about what -O2 does not show
    # (format truncation, for one). Their suites: ./ofl.sh asan | tsan.
    build build-asan "${ASAN_MESON[@]}"
    build build-tsan "${TSAN_MESON[@]}"
    # and clang's view of the same code, where clang is installed
    if command -v clang >/dev/null 2>&1 && command -v clang++ >/dev/null 2>&1; then
      CC=clang CXX=clang++ build build-clang-asan "${ASAN_MESON[@]}"
    else
      log "no clang here: the clang build is left out"
    fi
    ;;
  valgrind)
    build "$BUILD"
    run_tests "$BUILD" valgrind --no-suite mpi "$@"
    ;;
  soak)
    # Long randomized runs, counted: the pool property test over
    # OFL_SOAK_DRAWS (default 2000) drawn workloads on the host backend
    # (strict mode) and on the cudasim stand-in, at the CI subset's sizes
    # (OFL_SOAK_SIZE=full: up to 4 MiB tensors and 96 MiB an iteration,
    # about 30 s a draw here), then the interrupt sweep of ofl.torch at every
    # line event (the hooks in ofl._ext, the stager, the disk
    # checkpoint). Each part prints what ran and what failed, by kind; the
    # last line adds them up.
    build "$BUILD" -Dtests=true -Dexamples=true -Dbench=true
    install_torch
    draws="${OFL_SOAK_DRAWS:-2000}" seed="${OFL_SOAK_SEED:-1}"
    export OFL_SOAK_SIZE="${OFL_SOAK_SIZE:-small}"
    prop="$BUILD/tests/unit/pipeline/test_pipeline_pool_property"
    soak_dir="$BUILD/meson-logs/soak"
    mkdir -p "$soak_dir"
    passed=0 failed=0
    count_tap() { # LOG: adds its ok / not ok lines to the totals
      local p f
      p=$(grep -c '^ok ' "$1" || true); f=$(grep -c '^not ok ' "$1" || true)
      passed=$((passed + p)); failed=$((failed + f))
    }
    for be in host cudasim; do
      log "pool property soak on $be: $draws draws ($OFL_SOAK_SIZE) from seed $seed (log: $soak_dir/pool-$be.log)"
      if [ "$be" = host ]; then
        env OFL_BACKEND=host OFLTEST_BACKEND=host OFL_STRICT=1 OFL_DEBUG=NONE \
          OFL_SOAK_DRAWS="$draws" OFL_SOAK_SEED="$seed" "$prop" >"$soak_dir/pool-$be.log" 2>&1 || true
      else
        env OFL_BACKEND=cuda OFLTEST_BACKEND=cuda LD_LIBRARY_PATH="$BUILD/tests/cudasim" \
          OFL_DEBUG=NONE OFL_SOAK_DRAWS="$draws" OFL_SOAK_SEED="$seed" "$prop" >"$soak_dir/pool-$be.log" 2>&1 || true
      fi
      grep '^# draws' "$soak_dir/pool-$be.log" | sed "s/^# /  $be: /" || echo "  $be: no count line (see the log)"
      count_tap "$soak_dir/pool-$be.log"
    done
    log "interrupt sweep at every line event: the hooks (ofl._ext), the stager and the disk checkpoint (log: $soak_dir/sweep.log)"
    OFL_SWEEP_FULL=1 meson test -C "$BUILD" -v --no-rebuild --timeout-multiplier 8 \
      python_interrupt_sweep python_stager_sweep \
      >"$soak_dir/sweep.log" 2>&1 || true
    grep -E 'swept [0-9]+ injection points' "$soak_dir/sweep.log" | sed 's/^/  /' || true
    for t in python_interrupt_sweep python_stager_sweep; do
      if grep -Eq "ofl:[a-z+]* / $t +OK" "$soak_dir/sweep.log"; then
        passed=$((passed + 1))
      else
        failed=$((failed + 1)); echo "  $t: not passed (see the log)"
      fi
    done
    echo "soak: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
    ;;
  bench)
    build build-release -Dbuildtype=release
    for b in build-release/bench/ofl_bench_*; do
      if [ -f "$b" ] && [ -x "$b" ]; then
        echo "== $(basename "$b")"
        "$b" "$@"
      fi
    done
    ;;
  help|-h|--help)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    ;;
  *)
    log "unknown task '$task' (demo, test, asan, tsan, valgrind, sanitizer-builds, soak, bench, setup)"
    exit 2
    ;;
esac
