#!/usr/bin/env python3
"""Reads the JSON, CSV and text that ofl wrote for a fixed summary with
Python's json and csv modules and compares every value with the tables
below, computed here independently. Usage: check_summary_formats.py WRITER"""
import csv
from decimal import ROUND_HALF_EVEN, Decimal
import io
import json
import subprocess
import sys

CELLS = [
    (0, "attn_norm", 1048576), (0, 'core "attn"', 3670016),
    (0, "back\\slash", 1), (1, "comma,name", 9223372036854775808),
    (1, " lead and trail ", 12345), (1, "caf\u00e9", 2097152),
    (3, "attn_norm", 5),
]
NRANKS = 4


def expected():
    # strcmp order is the order of the UTF-8 bytes
    names = sorted({n for _, n, _ in CELLS}, key=lambda n: n.encode())
    m = [[0] * len(names) for _ in range(NRANKS)]
    for r, n, b in CELLS:
        m[r][names.index(n)] += b
    return names, m


def main():
    out = subprocess.run([sys.argv[1]], check=True, capture_output=True).stdout
    parts = out.decode("utf-8").split("\f")
    assert len(parts) == 3, f"expected 3 parts, got {len(parts)}"
    names, m = expected()
    bad = 0

    def check(cond, what):
        nonlocal bad
        if not cond:
            print(f"not ok: {what}")
            bad += 1

    j = json.loads(parts[0])
    check(j["nranks"] == NRANKS, "json nranks")
    check(j["groups"] == names, f"json groups {j['groups']} != {names}")
    check(j["bytes"] == m, "json bytes matrix")
    check(j["rank_totals"] == [sum(row) for row in m], "json rank totals")
    check(j["group_totals"] == [sum(col) for col in zip(*m)],
          "json group totals")
    check(j["total"] == sum(map(sum, m)), "json total")
    check(j["unit"] == "bytes", "json unit")

    rows = list(csv.reader(io.StringIO(parts[1], newline="")))
    check(rows[0] == ["rank"] + names + ["total"], f"csv header {rows[0]}")
    for r in range(NRANKS):
        want = [str(r)] + [str(v) for v in m[r]] + [str(sum(m[r]))]
        check(rows[1 + r] == want, f"csv row {r}: {rows[1 + r]} != {want}")
    cols = [sum(col) for col in zip(*m)]
    check(rows[-1] == ["total"] + [str(v) for v in cols] +
          [str(sum(cols))], f"csv total row {rows[-1]}")
    check(len(rows) == NRANKS + 2, "csv row count")

    text = parts[2].splitlines()
    check(text[1].strip() == "Activation Offload Summary (MB)", "text title")
    check(len(text) == 3 + 2 + NRANKS + 3, "text line count")
    for r in range(NRANKS):
        line = text[5 + r]
        check(line.startswith(f"Rank {r} "), f"text row label {line!r}")
        mb = Decimal(sum(m[r])) / Decimal(2**20)
        want = str(mb.quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN))
        check(line.split()[-1] == want, f"text row {r} total {want}")
    print("ok" if bad == 0 else f"{bad} failures")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
