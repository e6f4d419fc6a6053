#!/usr/bin/env python3
"""Runs the demo under mpirun with one rank leaving early (--die-at) and
checks that the others give up within their --timeout instead of hanging.

Passes when the job ends within BUDGET seconds with a non-zero status and a
surviving rank said which wait it gave up on (EXPECT in its output). A job
still running after BUDGET is stopped (its process group) and fails: that
is the hang this test is about. Open MPI's mpirun, with
orte_abort_on_non_zero_status 0, does not stop the job when the dying rank
exits, so only the survivors' own deadline can end it.

Usage: die_check.py BUDGET_SECONDS EXPECT COMMAND [ARGS...]"""
import os
import signal
import subprocess
import sys
import time


def main():
    budget = float(sys.argv[1])
    expect = sys.argv[2]
    t0 = time.monotonic()
    proc = subprocess.Popen(sys.argv[3:], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=3)
                break
            except subprocess.TimeoutExpired:
                pass
        out = proc.stdout.read() if proc.stdout else ""
        sys.stdout.write(out)
        print(f"FAIL: the job still ran after {budget:g} s: a rank hangs "
              "on the one that left")
        return 1
    took = time.monotonic() - t0
    sys.stdout.write(out)
    if proc.returncode == 0:
        print("FAIL: the job exited 0 although a rank left early")
        return 1
    if expect not in out:
        print(f"FAIL: no surviving rank reported '{expect}'")
        return 1
    print(f"ok: exit status {proc.returncode} after {took:.1f} s, "
          f"a survivor reported '{expect}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
