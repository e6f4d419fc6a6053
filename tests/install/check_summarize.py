#!/usr/bin/env python3
""".ci/summarize.py, which makes ofl.sh's closing line, counts what a run
ran and nothing else: a log with no test (a build without tests, a filter
that matched none) is a failure, a missing log is a failure, TAP subtests
count one by one, a crash after passing subtests fails, and several logs
add up.

Usage: check_summarize.py SOURCE_ROOT"""
import json
import os
import subprocess
import sys
import tempfile

root = sys.argv[1]
script = os.path.join(root, ".ci", "summarize.py")
tmp = tempfile.mkdtemp(prefix="ofl-summarize-")
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


def log(name, tests):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        for t in tests:
            f.write(json.dumps(t) + "\n")
    return path


def run(*paths):
    p = subprocess.run([sys.executable, script, *paths], capture_output=True, text=True)
    return p.returncode, p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""


empty = log("empty.json", [])
rc, last = run(empty)
ok(rc != 0 and last == "0 passed, 0 failed", "an empty log fails", (rc, last))
rc, last = run(os.path.join(tmp, "missing.json"))
ok(rc != 0 and last == "0 passed, 1 failed", "a missing log fails", (rc, last))
skipped = log("skipped.json", [{"name": "ofl:python+host / a", "result": "SKIP", "stdout": ""}])
rc, last = run(skipped)
ok(rc != 0 and last.startswith("0 passed, 0 failed"), "only skipped tests fail", (rc, last))
good = log("good.json", [
    {"name": "ofl:unit+host / a", "result": "OK", "stdout": "ok 1 - x\nok 2 - y\n"},
    {"name": "ofl:unit+cudasim / b", "result": "OK", "stdout": ""}])
rc, last = run(good)
ok(rc == 0 and last == "3 passed, 0 failed", "subtests count one by one", (rc, last))
crash = log("crash.json", [{"name": "ofl:unit+host / c", "result": "FAIL", "stdout": "ok 1 - x\n"}])
rc, last = run(crash)
ok(rc != 0 and last == "1 passed, 1 failed", "a crash after passing subtests fails", (rc, last))
rc, last = run(good, crash)
ok(rc != 0 and last == "4 passed, 1 failed", "several logs add up", (rc, last))
# what failed, and why, comes before the counts: a Criterion assertion with
# its message, a TAP line with its diagnostic
said = log("said.json", [
    {"name": "ofl:unit+host / crit", "result": "FAIL",
     "stdout": "[----] x.c:12: Assertion Failed\n[----]   \n[----]   raised after 0 iterations\n"
               "[FAIL] auto_plan::raise: (1.00s)\n"},
    {"name": "ofl:unit+host / tap", "result": "FAIL",
     "stdout": "ok 1 - a\nnot ok 2 - draw 32\n# pool activations: 1 backend calls\n"},
    {"name": "ofl:unit+host / fine", "result": "OK", "stdout": "ok 1 - b\n"},
    {"name": "ofl:unit+host / crit_tap", "result": "FAIL",
     "stdout": "ok - s::passes  (0.00s)\nnot ok - s::fails  (0.00s)\n  ---\n  assertions: 1\n"
               "  failures:\n  - crt.c:2: |+\n      Assertion failed: held 4194304\n  ...\n"}])
p = subprocess.run([sys.executable, script, said], capture_output=True, text=True)
out = p.stdout.splitlines()
ok(p.returncode != 0 and out[-1] == "3 passed, 3 failed", "the counts stay last", out[-1:])
ok("failed: ofl:unit+host / crit (FAIL)" in out and
   "    raised after 0 iterations" in out and
   "  [FAIL] auto_plan::raise: (1.00s)" in out, "a Criterion failure says why", out)
ok("failed: ofl:unit+host / tap (FAIL)" in out and "  not ok 2 - draw 32" in out and
   "    pool activations: 1 backend calls" in out, "a TAP failure says why", out)
ok("failed: ofl:unit+host / crit_tap (FAIL)" in out and "  not ok - s::fails  (0.00s)" in out and
   "    crt.c:2:" in out and "    Assertion failed: held 4194304" in out,
   "a Criterion failure in TAP says where and why", out)
ok(not any("fine" in line or "passes" in line for line in out), "what passed is not listed", out)

print("TAP version 13")
print(f"1..{len(results)}")
for i, (g, what, detail) in enumerate(results, 1):
    print(f"{'ok' if g else 'not ok'} {i} - {what}")
    if not g:
        print(f"# {detail}")
sys.exit(0 if all(r[0] for r in results) else 1)
