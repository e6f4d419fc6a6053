#!/usr/bin/env python3
"""Runs a demo command whose plan offloads nothing and checks that the
demo's own activation peak (pool bytes in use less its own tensors, sampled
whenever saved activations grow) equals the manager's ledger on every rank
that prints both. Without copies the ledger is exact, reruns included, so a
difference is a peak one of them does not see (a recompute's transient).

Usage: peak_check.py COMMAND [ARGS...]"""
import re
import subprocess
import sys

# The demo prints MiB with 3 decimals, the ledger with 4.
TOLERANCE_MIB = 0.0006


def main():
    proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        print(f"FAIL: exit status {proc.returncode}")
        return 1
    pairs = re.findall(r"demo activation peak rank (\d+): ([\d.]+) MiB measured.*"
                       r"the manager's ledger: ([\d.]+) MiB", proc.stdout)
    if not pairs:
        print("FAIL: no 'demo activation peak ... the manager's ledger' line")
        return 1
    if re.search(r"=offload \(", proc.stdout):
        print("FAIL: the plan offloads a group; this check needs no copies")
        return 1
    ok = True
    for rank, demo, ledger in pairs:
        d, l = float(demo), float(ledger)
        good = abs(d - l) <= TOLERANCE_MIB
        print(f"{'ok' if good else 'FAIL'}: rank {rank}: the demo's peak {d:.3f} MiB, "
              f"the ledger's {l:.4f} MiB")
        ok = ok and good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
