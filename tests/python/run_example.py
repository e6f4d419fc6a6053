#!/usr/bin/env python3
"""Runs one of examples/torch/*.py as a user would (host backend, CPU) and
checks what it says: exit 0 and every "...: yes" line it prints. Exits 77
(skipped) when torch cannot be imported.

Usage: run_example.py SCRIPT [ARGS...]"""
import re
import subprocess
import sys

try:
    import torch  # noqa: F401
except ImportError:
    print("torch is not importable: skipped")
    sys.exit(77)

run = subprocess.run([sys.executable] + sys.argv[1:], capture_output=True, text=True,
                     timeout=280)
sys.stdout.write(run.stdout)
sys.stderr.write(run.stderr)
checks = re.findall(r"^(.*): (yes|no|NO.*)$", run.stdout, re.M)
if run.returncode != 0 or not checks or any(v != "yes" for _, v in checks):
    print("FAILED: exit %d; %s" % (run.returncode,
                                   ", ".join("%s: %s" % c for c in checks) or "no check line"))
    sys.exit(1)
sys.exit(0)
