#!/usr/bin/env python3
"""The shared library exports the public API only: every defined dynamic
symbol is an ofl_* function or object, none is internal (ofl__*), and the
core entry points are present."""
import subprocess
import sys

lib = sys.argv[1]
out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True,
                     capture_output=True, text=True).stdout
syms = [l.split()[-1] for l in out.splitlines() if l.strip()]
bad = [s for s in syms if not s.startswith("ofl_") or s.startswith("ofl__")]
need = ["ofl_device_open", "ofl_status_str", "ofl_config_print",
        "ofl_memcpy_async", "ofl_event_record"]
missing = [s for s in need if s not in syms]
print("TAP version 13\n1..2")
print(("ok" if not bad else "not ok") + f" 1 - only public ofl_ symbols exported ({len(syms)} symbols)")
for s in bad[:20]:
    print(f"# unexpected export: {s}")
print(("ok" if not missing else "not ok") + " 2 - core entry points exported")
for s in missing:
    print(f"# missing export: {s}")
sys.exit(1 if bad or missing else 0)
