#!/usr/bin/env python3
"""Runs a command and checks its exit status and that its output (stdout and
stderr together) holds every expected text, so that a test can say what a
demo run must print, not only how it exits.

Usage: expect_check.py STATUS TEXT1[|TEXT2...] COMMAND [ARGS...]
STATUS is the exit status required; TEXTs are separated by '|'."""
import subprocess
import sys


def main():
    want = int(sys.argv[1])
    texts = [t for t in sys.argv[2].split("|") if t]
    proc = subprocess.run(sys.argv[3:], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    sys.stdout.write(proc.stdout)
    ok = True
    if proc.returncode != want:
        print(f"FAIL: exit status {proc.returncode}, expected {want}")
        ok = False
    for t in texts:
        if t not in proc.stdout:
            print(f"FAIL: the output does not say '{t}'")
            ok = False
    if ok:
        print(f"ok: exit status {want} and every expected text")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
