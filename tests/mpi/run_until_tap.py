#!/usr/bin/env python3
"""Runs an mpirun command whose TAP result is complete before the job ends,
and decides the outcome from the TAP alone.

Used where a rank dies on purpose: Open MPI's MPI_Finalize on the survivors
then sometimes waits forever for the dead rank (a known limitation of its
runtime), and mpirun's exit status depends on that race. The survivors'
results are printed before MPI_Finalize, so once every planned test line is
in, the job gets GRACE seconds to end and is then stopped.

Usage: run_until_tap.py GRACE_SECONDS COMMAND [ARGS...]"""
import os
import re
import signal
import subprocess
import sys
import time


def main():
    grace = float(sys.argv[1])
    proc = subprocess.Popen(sys.argv[2:], stdout=subprocess.PIPE,
                            start_new_session=True, text=True)
    planned, seen, failed, bailed = None, 0, 0, False
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = re.match(r"^1\.\.(\d+)", line)
        if m:
            planned = int(m.group(1))
        elif re.match(r"^not ok\b", line):
            seen += 1
            failed += 1
        elif re.match(r"^ok\b", line):
            seen += 1
        elif line.startswith("Bail out!"):
            bailed = True
        if planned is not None and seen >= planned:
            break
    deadline = time.monotonic() + grace
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        print(f"# the job did not end within {grace:g} s after its results "
              "(MPI_Finalize after a rank died); stopping it")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                pass
    ok = planned is not None and seen == planned and failed == 0 and \
        not bailed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
