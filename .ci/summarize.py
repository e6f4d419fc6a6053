#!/usr/bin/env python3
"""Prints one line "N passed, M failed[, K skipped]" from meson's testlog.json.

A TAP test counts each of its "ok"/"not ok" lines; any other test counts once.
A TAP test that failed as a whole (crash, timeout, bad exit) with no failing
line counts one failure more, so a crash after passing subtests still fails."""
import json
import re
import sys

TAP_LINE = re.compile(r"^(not ok|ok)\b(.*)$")

passed = failed = skipped = 0
try:
    lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
except OSError as exc:
    print(f"no test log: {exc}", file=sys.stderr)
    print("0 passed, 1 failed")
    sys.exit(1)
for line in lines:
    if not line.strip():
        continue
    t = json.loads(line)
    result = t.get("result", "")
    good = result in ("OK", "EXPECTEDFAIL")
    subs = [TAP_LINE.match(l) for l in (t.get("stdout") or "").splitlines()]
    subs = [m for m in subs if m]
    if not subs:
        if good:
            passed += 1
        elif result == "SKIP":
            skipped += 1
        else:
            failed += 1
        continue
    sub_fail = 0
    for m in subs:
        if "# SKIP" in m.group(2).upper():
            skipped += 1
        elif m.group(1) == "ok":
            passed += 1
        else:
            failed += 1
            sub_fail += 1
    if not good and result != "SKIP" and sub_fail == 0:
        failed += 1
line = f"{passed} passed, {failed} failed"
if skipped:
    line += f", {skipped} skipped"
print(line)
sys.exit(1 if failed else 0)
