#!/usr/bin/env python3
"""`./ofl.sh demo` starts fast: in a fresh build directory it builds the
demo and what it needs (libofl), not the tests, benches or the Python
extension, with meson's and ninja's output in a log file rather than on the
terminal. Runs `OFL_BUILD_DIR=<tmp> ./ofl.sh demo --help` (the demo prints
its usage and exits).

Usage: check_ofl_sh_demo.py SOURCE_ROOT"""
import os
import shutil
import subprocess
import sys
import tempfile

root = sys.argv[1]
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


tmp = tempfile.mkdtemp(prefix="ofl-sh-demo-")
build = os.path.join(tmp, "build")
env = dict(os.environ, OFL_BUILD_DIR=build, OFL_NO_TORCH_INSTALL="1")
proc = subprocess.run([os.path.join(root, "ofl.sh"), "demo", "--help"],
                      cwd=root, env=env, capture_output=True, text=True,
                      timeout=900)
out = proc.stdout + proc.stderr
ok(proc.returncode == 0, "ofl.sh demo --help exits 0", out[-2000:])
ok("usage:" in proc.stdout, "the demo ran (its usage printed)", out[-2000:])
ok("The Meson build system" not in out and "Found ninja" not in out
   and "[1/" not in out, "no meson or ninja output on the terminal",
   out[-2000:])
lines = [l for l in out.splitlines() if l.strip()]
usage_at = next((i for i, l in enumerate(lines) if l.startswith("usage:")),
                len(lines))
ok(usage_at <= 2, "at most 2 lines before the demo's first",
   "\n".join(lines[:usage_at + 1])[-2000:])
log = os.path.join(build, "meson-logs", "ofl-demo-build.log")
ok(os.path.exists(log) and log in out,
   "the build's output is in a log file, whose path is said", out[-1000:])
demo = [os.path.join(build, "examples", n)
        for n in ("ofl_pipeline_demo", "ofl_pipeline_demo_single")]
ok(any(os.access(d, os.X_OK) for d in demo), "the demo was built")
built = []
for sub in ("tests", "bench", "python"):
    for dirpath, _, files in os.walk(os.path.join(build, sub)):
        # (the stand-in's soname links are made at configure time)
        built += [os.path.join(dirpath, f) for f in files
                  if (f.endswith(".o") or ".so" in f)
                  and not os.path.islink(os.path.join(dirpath, f))]
ok(not built, "no test, bench or Python extension object was built",
   "\n".join(built[:20]))
shutil.rmtree(tmp, ignore_errors=True)

print("TAP version 13")
print(f"1..{len(results)}")
for i, (good, what, detail) in enumerate(results, 1):
    print(f"{'ok' if good else 'not ok'} {i} - {what}")
    if not good and detail:
        for line in str(detail).splitlines()[:20]:
            print(f"# {line}")
sys.exit(0 if all(r[0] for r in results) else 1)
