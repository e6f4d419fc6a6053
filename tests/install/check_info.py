#!/usr/bin/env python3
"""ofl-info runs, prints every section, and --json is valid JSON (checked
with python3 -m json.tool) that reports the backend of the pass: in the
cudasim pass (OFLTEST_BACKEND=cuda) the cuda backend with the stand-in's 2
devices and their memory, in the host pass the host backend."""
import json
import os
import subprocess
import sys

exe = sys.argv[1]
backend = os.environ.get("OFLTEST_BACKEND", "host")
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


text = subprocess.run([exe], capture_output=True, text=True)
ok(text.returncode == 0, "ofl-info exits 0", text.stderr[-2000:])
for section in ("backends", "devices", "pinned memory", "disk tier",
                "configuration"):
    ok(f"\n{section}" in text.stdout, f"text output has the {section} section")
ok("OFL_BACKEND" in text.stdout and "OFL_DISK_DIR" in text.stdout,
   "text output lists the OFL_* variables")

js = subprocess.run([exe, "--json"], capture_output=True, text=True)
ok(js.returncode == 0, "ofl-info --json exits 0", js.stderr[-2000:])
tool = subprocess.run([sys.executable, "-m", "json.tool"], input=js.stdout,
                      capture_output=True, text=True)
ok(tool.returncode == 0, "--json output passes python3 -m json.tool",
   tool.stderr[-2000:])
try:
    info = json.loads(js.stdout)
except ValueError as e:
    info = {}
    ok(False, "--json output parses", str(e))

cfg = {v["name"]: v for v in info.get("config", [])}
ok(cfg.get("OFL_BACKEND", {}).get("value") == backend
   and cfg["OFL_BACKEND"]["source"] == "environment"
   and cfg["OFL_BACKEND"]["default"] == "auto",
   "OFL_BACKEND shows its value, default and source",
   json.dumps(cfg.get("OFL_BACKEND")))
ok(cfg.get("OFL_DISK_DIR", {}).get("source") in ("default", "environment"),
   "every variable has a source")
ok(info.get("version", "").count(".") == 2 and info.get("soname") == "libofl.so.0",
   "version and soname")
be = info.get("backends", {})
ok(be.get("host", {}).get("available") is True, "host backend available")
devs = {d["name"]: d for d in info.get("devices", [])}
if backend == "cuda":
    cu = be.get("cuda", {})
    ok(cu.get("available") is True and cu.get("devices") == 2,
       "cuda backend available with the stand-in's 2 devices", json.dumps(cu))
    ok(all(devs.get(f"cuda:{i}", {}).get("capacity_bytes", 0) > 0
           for i in range(2)), "both cuda devices report their memory",
       json.dumps(info.get("devices")))
    ok(info.get("default_backend") == "cuda", "default open picks cuda")
    ok("libcudart.so.13" in info.get("cuda_runtime", "")
       and "loaded by ofl" in info.get("cuda_runtime", ""),
       "the cuda runtime used is named, and why", info.get("cuda_runtime"))
    # A driver that refuses the stand-in's CUDA 13 runtime: ofl-info says
    # that ofl fell back to the stand-in's libcudart.so.12 (tests/cudasim/cu12).
    cu12 = os.path.join(os.path.dirname(exe), "..", "tests", "cudasim", "cu12")
    if os.path.exists(os.path.join(cu12, "libcudart.so.12")):
        env = dict(os.environ, CUDASIM_DRIVER_VERSION="12080",
                   LD_LIBRARY_PATH=os.environ.get("LD_LIBRARY_PATH", "")
                   + ":" + cu12)
        old = subprocess.run([exe], capture_output=True, text=True, env=env)
        ok(old.returncode == 0 and "cuda runtime: libcudart.so.12" in old.stdout
           and "refused libcudart.so.13" in old.stdout,
           "an old driver: ofl-info names the libcudart.so.12 fallback",
           old.stdout[:1500])
else:
    cu = be.get("cuda", {})
    ok(cu.get("available") is True or cu.get("reason", "") != "",
       "cuda either available or the reason is given", json.dumps(cu))
    ok(info.get("default_backend") == "host", "default open picks host")
ok("host" in devs and devs["host"].get("opened"), "host device listed")
if backend == "host":
    # A node without the CUDA runtime: the host backend, and the reason.
    env = dict(os.environ, OFL_CUDART_LIBRARY="libofl-test-no-such-cudart.so.0",
               OFL_BACKEND="auto")
    nr = subprocess.run([exe, "--json"], capture_output=True, text=True, env=env)
    try:
        ni = json.loads(nr.stdout)
    except ValueError:
        ni = {}
    cu = ni.get("backends", {}).get("cuda", {})
    ok(nr.returncode == 0 and cu.get("available") is False
       and "cuda runtime was not found" in cu.get("reason", "")
       and ni.get("default_backend") == "host",
       "without the cuda runtime: host backend, reason 'runtime not found'",
       nr.stdout[-1500:] + nr.stderr[-1500:])
disk = info.get("disk", {})
ok(disk.get("opened") is True and disk.get("dir", "") != ""
   and isinstance(disk.get("o_direct"), bool)
   and isinstance(disk.get("io_uring"), bool),
   "disk tier: directory, O_DIRECT and io_uring reported", json.dumps(disk))
ok("memlock_soft_bytes" in info.get("pinned", {}), "pinned-memory limit reported")

print("TAP version 13")
print(f"1..{len(results)}")
for i, (good, what, detail) in enumerate(results, 1):
    print(f"{'ok' if good else 'not ok'} {i} - {what}")
    if not good and detail:
        for line in str(detail).splitlines()[:20]:
            print(f"# {line}")
if not all(r[0] for r in results):
    print("# ofl-info output:")
    for line in text.stdout.splitlines():
        print(f"# {line}")
sys.exit(0 if all(r[0] for r in results) else 1)
