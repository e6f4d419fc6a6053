#!/usr/bin/env python3
"""The README's API page is a program that compiles as is and runs: the
first ```c block under "## The API in one page" is extracted, compiled with
strict warnings against the build's headers and libofl, and run; it must
exit 0 and offload what it pushes.

Usage: check_readme_api.py README CC INCLUDE_DIR BUILD_INCLUDE_DIR LIBOFL_SO [SANITIZE]

SANITIZE: the build's b_sanitize ("none" or absent: none). A sanitized
libofl needs the program built with the same sanitizer: ThreadSanitizer's
runtime, loaded only as libofl's dependency after libc, crashes in a
program that was not built with it."""
import os
import re
import subprocess
import sys
import tempfile

readme, cc, inc, build_inc, lib = sys.argv[1:6]
sanitize = sys.argv[6] if len(sys.argv) > 6 else "none"
san_flags = [] if sanitize in ("", "none") else ["-fsanitize=" + sanitize]
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


text = open(readme).read()
page = text.split("## The API in one page", 1)
block = re.search(r"```c\n(.*?)```", page[1], re.S) if len(page) > 1 else None
ok(block is not None, "the API page has a C block")
src = block.group(1) if block else ""
ok("int main(" in src, "the block is a whole program (has main)")
tmp = tempfile.mkdtemp(prefix="ofl-readme-")
c = os.path.join(tmp, "step.c")
exe = os.path.join(tmp, "step")
with open(c, "w") as f:
    f.write(src)
libdir = os.path.dirname(lib)
comp = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Wpedantic",
                       "-Werror"] + san_flags + ["-I", inc, "-I", build_inc, c, "-o", exe,
                       lib, "-Wl,-rpath," + libdir],
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
    ok("WARN" not in run.stderr, "no warning", run.stderr[-2000:])

print("TAP version 13")
print(f"1..{len(results)}")
for i, (good, what, detail) in enumerate(results, 1):
    print(f"{'ok' if good else 'not ok'} {i} - {what}")
    if not good and detail:
        for line in str(detail).splitlines()[:30]:
            print(f"# {line}")
sys.exit(0 if all(r[0] for r in results) else 1)
