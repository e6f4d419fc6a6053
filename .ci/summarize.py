#!/usr/bin/env python3
"""Prints "N passed, M failed[, K skipped]" from meson's testlog.json (or
several, added up): one line
per backend pass ("host: ...", "cudasim: ..."; a test's pass is its suite,
tests in neither suite count with the host pass) and the total line last.

A TAP test counts each of its "ok"/"not ok" lines; any other test counts once.
A TAP test that failed as a whole (crash, timeout, bad exit) with no failing
line counts one failure more, so a crash after passing subtests still fails.
A log with no test that passed or failed exits 1: a run that ran nothing has
not passed.

Before the counts, each failed test gets a few lines of why: its failing TAP
lines and the diagnostics under them, or Criterion's failed assertions with
their messages (the end of a CI log is what a reader gets first; meson's own
error logs come long before it)."""
import json
import re
import sys

TAP_LINE = re.compile(r"^(not ok|ok)\b(.*)$")
WHY_MAX = 6  # lines of why per failed test


def why(stdout):
    """The lines that say why a test failed: its "not ok" TAP lines with what
    follows them, the "#" diagnostics (the pool property test's) or the YAML
    block of Criterion's TAP output (each failed assertion's file:line and
    message), and a plain Criterion run's "Assertion Failed" lines."""
    out, under = [], False
    skip = {"---", "...", "failures:"}
    for line in (stdout or "").splitlines():
        text = line.strip()
        if text.startswith("not ok") or text.startswith("[FAIL]") or \
                "Assertion Failed" in text:
            out.append(text)
            under = True
        elif under and (line.startswith(" ") or text.startswith("#") or
                        text.startswith("[----]")):
            body = text.lstrip("#").strip()
            if body.startswith("[----]"):
                body = body[len("[----]"):].strip()
            if body.startswith("- "):
                body = body[2:].rstrip("|+ ").strip()
            if body and body not in skip and not body.startswith("assertions:"):
                out.append("  " + body)
        else:
            under = False
    return out[:WHY_MAX]


PASSES = ("host", "cudasim")
counts = {p: [0, 0, 0] for p in PASSES}  # passed, failed, skipped
lines = []
failures = []  # (name, result, why lines) of each failed test
for path in sys.argv[1:]:  # several logs (setups of one run) add up
    try:
        lines += open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        print(f"no test log: {exc}", file=sys.stderr)
        print("0 passed, 1 failed")
        sys.exit(1)
for line in lines:
    if not line.strip():
        continue
    t = json.loads(line)
    # meson writes the suites into the name: "ofl:unit+cudasim+pool / name"
    head = t.get("name", "").split(" / ")[0]
    suites = set(head.split(":")[-1].split("+"))
    c = counts["cudasim" if "cudasim" in suites else "host"]
    result = t.get("result", "")
    good = result in ("OK", "EXPECTEDFAIL")
    subs = [TAP_LINE.match(l) for l in (t.get("stdout") or "").splitlines()]
    subs = [m for m in subs if m]
    if not good and result != "SKIP":
        failures.append((t.get("name", "?"), result, why(t.get("stdout"))))
    if not subs:
        if good:
            c[0] += 1
        elif result == "SKIP":
            c[2] += 1
        else:
            c[1] += 1
        continue
    sub_fail = 0
    for m in subs:
        if "# SKIP" in m.group(2).upper():
            c[2] += 1
        elif m.group(1) == "ok":
            c[0] += 1
        else:
            c[1] += 1
            sub_fail += 1
    if not good and result != "SKIP" and sub_fail == 0:
        c[1] += 1


def fmt(p, f, s):
    line = f"{p} passed, {f} failed"
    return line + (f", {s} skipped" if s else "")


for name, result, lines_why in failures:
    print(f"failed: {name} ({result})")
    for line in lines_why:
        print(f"  {line}")
for name in PASSES:
    if any(counts[name]):
        print(f"{name}: " + fmt(*counts[name]))
passed, failed, skipped = (sum(c[i] for c in counts.values()) for i in range(3))
if passed + failed == 0:
    # a run that ran nothing has not passed (a build without tests, a
    # filter that matches no test)
    print("no test ran: the log has no passed or failed test", file=sys.stderr)
print(fmt(passed, failed, skipped))
sys.exit(1 if failed or passed + failed == 0 else 0)
