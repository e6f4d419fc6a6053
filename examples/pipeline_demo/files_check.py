#!/usr/bin/env python3
"""Runs a command and checks that it wrote the given files.

Removes each file first, runs the command, and passes when it exits 0 and
every file exists and is not empty. Used for the demo's outputs: the traces
OFL_TRACE_FILE asks for (one per run: the second device's file gets .1
before .json) and the memory CSV written next to --memory-png when no
--memory-csv is given.

Usage: files_check.py FILE[,FILE...] COMMAND [ARGS...]"""
import os
import subprocess
import sys


def main():
    files = sys.argv[1].split(",")
    for f in files:
        if os.path.exists(f):
            os.remove(f)
    rc = subprocess.call(sys.argv[2:])
    if rc != 0:
        print(f"FAIL: the command exited {rc}")
        return 1
    missing = [f for f in files
               if not os.path.exists(f) or os.path.getsize(f) == 0]
    for f in missing:
        print(f"FAIL: {f} was not written")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
