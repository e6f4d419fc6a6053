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

print("TAP version 13")
print(f"1..{len(results)}")
for i, (g, what, detail) in enumerate(results, 1):
    print(f"{'ok' if g else 'not ok'} {i} - {what}")
    if not g:
        print(f"# {detail}")
sys.exit(0 if all(r[0] for r in results) else 1)
