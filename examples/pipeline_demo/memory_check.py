#!/usr/bin/env python3
"""Runs the demo with --memory-png in a fresh directory and checks what it
says and writes: it prints where the CSV and the PNG went (the PNG when
gnuplot is installed), and the CSV holds, for each run, samples on a time
axis from that run's steady state (steady_seconds: the warmup negative, the
steady state from 0), so the two runs line up in the picture.

Usage: memory_check.py COMMAND [ARGS...] (the demo; --memory-png is added)"""
import csv
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    out = tempfile.mkdtemp(prefix="ofl-demo-memory-")
    png = os.path.join(out, "memory.png")
    csv_path = os.path.join(out, "memory.csv")
    proc = subprocess.run(sys.argv[1:] + ["--memory-png", png],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    sys.stdout.write(proc.stdout)
    fails = []
    if proc.returncode != 0:
        fails.append(f"exit status {proc.returncode}")
    if f"memory over time (CSV): {csv_path}" not in proc.stdout:
        fails.append("the CSV's path is not printed")
    if shutil.which("gnuplot"):
        if f"memory over time (PNG): {png}" not in proc.stdout:
            fails.append("the PNG's path is not printed")
        if not os.path.exists(png) or os.path.getsize(png) == 0:
            fails.append("no PNG written")
    rows = []
    if os.path.exists(csv_path):
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
    if not rows or "steady_seconds" not in rows[0]:
        fails.append("the CSV has no steady_seconds column")
    for run in ("baseline", "offload"):
        t = [float(r["steady_seconds"]) for r in rows if r.get("run") == run]
        if not t or min(t) >= 0 or max(t) <= 0:
            fails.append(f"{run}: samples do not span the warmup (< 0) and "
                         f"the steady state (> 0)")
    shutil.rmtree(out, ignore_errors=True)
    for f in fails:
        print(f"FAIL: {f}")
    if not fails:
        print("ok: paths printed, CSV on steady-state time axes")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
