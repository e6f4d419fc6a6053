#!/usr/bin/env python3
"""ofl-info is a check: it exits 1, saying why first (on stderr, before the
report), for an invalid OFL_* value (the library's rules, the offload
fraction's [0, 1] included), an unknown OFL_* variable (naming the closest
known one), and a backend asked for by name that is not available; a valid
configuration exits 0."""
import json
import os
import subprocess
import sys

exe = sys.argv[1]
backend = os.environ.get("OFLTEST_BACKEND", "host")
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


def run(extra, *args):
    env = dict(os.environ)
    env.update(extra)
    return subprocess.run([exe, *args], capture_output=True, text=True,
                          env=env)


good = run({})
ok(good.returncode == 0 and "error" not in good.stderr,
   "the pass's own configuration: exit 0, no error", good.stderr[-1500:])

bad = run({"OFL_BACKEND": "gpu"})
ok(bad.returncode == 1, "OFL_BACKEND=gpu: exit 1", bad.stderr[-1500:])
ok(bad.stderr.startswith("ofl-info: error: OFL_BACKEND='gpu' is invalid")
   and "auto|host|cuda" in bad.stderr,
   "OFL_BACKEND=gpu: the first line says which value and what it takes",
   bad.stderr[-1500:])

frac = run({"OFL_OFFLOAD_FRACTION": "1.5"}, "--json")
try:
    info = json.loads(frac.stdout)
except ValueError as e:
    info = {}
    ok(False, "--json output parses with a problem", str(e))
cfg = {v["name"]: v for v in info.get("config", [])}
ok(frac.returncode == 1
   and any("OFL_OFFLOAD_FRACTION='1.5' is invalid" in p
           and "[0, 1]" in p for p in info.get("problems", [])),
   "OFL_OFFLOAD_FRACTION=1.5: exit 1, the range named",
   frac.stderr[-1500:])
ok(cfg.get("OFL_OFFLOAD_FRACTION", {}).get("valid") is False
   and cfg.get("OFL_BACKEND", {}).get("valid") is True,
   "--json marks the invalid value, and only it",
   json.dumps(cfg.get("OFL_OFFLOAD_FRACTION")))
half = run({"OFL_OFFLOAD_FRACTION": "0.5"})
ok(half.returncode == 0, "OFL_OFFLOAD_FRACTION=0.5 is fine", half.stderr[-800:])

unk = run({"OFL_OFFLOAD_GROUP": "core_attn"})
ok(unk.returncode == 1 and
   "unknown variable OFL_OFFLOAD_GROUP (did you mean OFL_OFFLOAD_GROUPS?)"
   in unk.stderr.splitlines()[0] if unk.stderr else False,
   "an unknown variable: exit 1, first line names the closest known one",
   unk.stderr[-1500:])
far = run({"OFL_COMPLETELY_DIFFERENT_THING": "1"})
ok(far.returncode == 1 and "unknown variable OFL_COMPLETELY_DIFFERENT_THING"
   in far.stderr and "did you mean" not in far.stderr,
   "a name near none: unknown, no guess", far.stderr[-800:])
tool = run({"OFL_LIBRARY": "/x/libofl.so", "OFL_DEMO_RANKS": "2"})
ok(tool.returncode == 0, "the tools' own OFL_* variables are not unknown",
   tool.stderr[-800:])

if backend == "host":
    # This machine has no GPU, or the pass hides it: cuda asked by name
    # where the runtime cannot be found.
    nocuda = run({"OFL_BACKEND": "cuda",
                  "OFL_CUDART_LIBRARY": "libofl-test-no-such-cudart.so.0"})
    ok(nocuda.returncode == 1 and nocuda.stderr.startswith(
        "ofl-info: error: OFL_BACKEND=cuda but the cuda backend is not "
        "available: "), "OFL_BACKEND=cuda without a usable runtime: exit 1 "
       "and why", nocuda.stderr[-1500:])
else:
    cuda = run({"OFL_BACKEND": "cuda"})
    ok(cuda.returncode == 0, "OFL_BACKEND=cuda where it is available: exit 0",
       cuda.stderr[-1500:])

print("TAP version 13")
print(f"1..{len(results)}")
for i, (good_, what, detail) in enumerate(results, 1):
    print(f"{'ok' if good_ else 'not ok'} {i} - {what}")
    if not good_ and detail:
        for line in str(detail).splitlines()[:20]:
            print(f"# {line}")
sys.exit(0 if all(r[0] for r in results) else 1)
