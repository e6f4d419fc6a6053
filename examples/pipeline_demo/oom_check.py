#!/usr/bin/env python3
"""Checks a --preset oom run on a device without a baseline of its own (a
GPU): runs it, reads the model it chose and the offload run's state
checksum, runs the same model without the preset under a second environment
(a larger device), and requires its baseline and offload checksums to equal
the first run's.

Usage: oom_check.py SMALL_MEMORY LARGE_MEMORY DEMO [ARGS...]
(the memories are CUDASIM_DEVICE_MEMORY values of the test stand-in)."""
import os
import re
import subprocess
import sys


# A run takes seconds; under a sanitizer setup on a loaded machine minutes
# (OFLTEST_SLOW: how much slower the setup runs, as for the tests' deadlines).
TIMEOUT = 600 * float(os.environ.get("OFLTEST_SLOW", "1") or 1)


def run(cmd, memory):
    env = dict(os.environ, CUDASIM_DEVICE_MEMORY=memory)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=env, timeout=TIMEOUT)
    sys.stdout.write(p.stdout)
    return p.returncode, p.stdout


def main():
    small, large, demo, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    rc, out = run([demo, "--preset", "oom"] + args, small)
    m = re.search(r"preset oom: .*?hidden (\d+), seq (\d+), (\d+) layer\(s\), "
                  r"(\d+) microbatches", out)
    c = re.search(r"state checksum .*?: offload ([0-9a-f]{16})", out)
    if rc != 0 or m is None or c is None or "out of device memory at iteration" not in out:
        print("FAIL: the --preset oom run (exit %d) did not report its model, "
              "its out-of-memory baseline and its checksum" % rc)
        return 1
    h, s, l, mb = m.groups()
    rc2, out2 = run([demo, "--hidden", h, "--seq", s, "--layers", l,
                     "--microbatches", mb, "--vpp", "1"] + args, large)
    c2 = re.search(r"state checksum .*?: baseline ([0-9a-f]{16}), offload ([0-9a-f]{16})", out2)
    if rc2 != 0 or c2 is None:
        print("FAIL: the run without the preset (exit %d) printed no checksums" % rc2)
        return 1
    want = c.group(1)
    if c2.group(1) != want or c2.group(2) != want:
        print("FAIL: the preset's offload run %s, the same model on a larger "
              "device: baseline %s, offload %s" % (want, c2.group(1), c2.group(2)))
        return 1
    print("ok: the --preset oom offload run matches the same model's baseline "
          "on a larger device bit for bit (checksum %s)" % want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
