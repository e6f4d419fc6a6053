#!/usr/bin/env python3
"""The README's C quick start is examples/minimal/minimal.c, a program that
compiles as is and offloads in steady state: the file is compiled with strict
warnings against the build's headers and libofl and run; it must exit 0,
offload in every iteration after the warmup, and warn about nothing. The
README must name the file, show a part of it as it is (a ```c block whose
lines are consecutive lines of the file) and the output it prints (a block
equal to this run's stdout).

Usage: check_readme_api.py README EXAMPLE_C CC INCLUDE_DIR BUILD_INCLUDE_DIR
                           LIBOFL_SO [SANITIZE]

SANITIZE: the build's b_sanitize ("none" or absent: none). A sanitized
libofl needs the program built with the same sanitizer: ThreadSanitizer's
runtime, loaded only as libofl's dependency after libc, crashes in a
program that was not built with it."""
import os
import re
import subprocess
import sys
import tempfile

readme, example, cc, inc, build_inc, lib = sys.argv[1:7]
sanitize = sys.argv[7] if len(sys.argv) > 7 else "none"
san_flags = [] if sanitize in ("", "none") else ["-fsanitize=" + sanitize]
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


text = open(readme).read()
src = open(example).read()
blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
ok("int main(" in src, "the example is a whole program (has main)")
rel = "examples/minimal/" + os.path.basename(example)
ok(rel in text, "the README names " + rel)
ok(any(lang == "c" and body.strip() and body in src for lang, body in blocks),
   "the README's C block is " + rel + " as it is (a part of it)",
   "no ```c block of README.md is consecutive lines of the file")
tmp = tempfile.mkdtemp(prefix="ofl-minimal-")
exe = os.path.join(tmp, "minimal")
libdir = os.path.dirname(lib)
comp = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Wpedantic",
                       "-Werror"] + san_flags + ["-I", inc, "-I", build_inc,
                       example, "-o", exe, lib, "-Wl,-rpath," + libdir],
                      capture_output=True, text=True)
ok(comp.returncode == 0, "it compiles with -Wall -Wextra -Wpedantic -Werror",
   comp.stderr[-3000:])
if comp.returncode == 0:
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    ok(run.returncode == 0, "it runs and exits 0",
       (run.stdout + run.stderr)[-3000:])
    m = re.search(r"offloaded (\d+) bytes in (\d+) tensors", run.stdout)
    ok(m is not None and int(m.group(1)) > 0,
       "it offloads what it pushes (offloaded bytes > 0)", run.stdout[-2000:])
    steady = [int(b) for i, b in re.findall(
        r"^iteration (\d+): offloaded (\d+) bytes$", run.stdout, re.M)]
    ok(len(steady) > 0 and all(b > 0 for b in steady),
       "every iteration after the warmup offloads (steady state)",
       run.stdout[-2000:])
    ok("WARN" not in run.stderr, "no warning", run.stderr[-2000:])
    ok(any(lang in ("", "text") and body == run.stdout
           for lang, body in blocks),
       "the README shows the output it prints",
       "no plain ``` block of README.md equals this run's stdout:\n"
       + run.stdout)

print("TAP version 13")
print(f"1..{len(results)}")
for i, (good, what, detail) in enumerate(results, 1):
    print(f"{'ok' if good else 'not ok'} {i} - {what}")
    if not good and detail:
        for line in str(detail).splitlines()[:30]:
            print(f"# {line}")
sys.exit(0 if all(r[0] for r in results) else 1)
