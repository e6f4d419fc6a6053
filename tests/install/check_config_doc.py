#!/usr/bin/env python3
"""docs/configuration.md is generated from the library's own table: the page
below its marker line must equal what `ofl-info --markdown` prints, so a
variable added, removed or redocumented in runtime/config_table.c fails here
until the page is regenerated. The output must not depend on the shell's OFL_*
settings either.

Usage: check_config_doc.py OFL_INFO PAGE
Regenerate: check_config_doc.py OFL_INFO PAGE --write"""
import difflib
import os
import subprocess
import sys

MARKER = "<!-- generated: everything below is `ofl-info --markdown` -->\n"

ofl_info, page = sys.argv[1:3]
write = "--write" in sys.argv[3:]
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


def markdown(extra_env):
    env = dict(os.environ)
    env.update(extra_env)
    return subprocess.run([ofl_info, "--markdown"], capture_output=True,
                          text=True, env=env, timeout=60)


gen = markdown({})
ok(gen.returncode == 0 and gen.stdout.count("\n| `OFL_") > 10,
   "ofl-info --markdown prints the table", gen.stdout[-1500:] + gen.stderr)
odd = markdown({"OFL_BACKEND": "nonsense", "OFL_DEBUG": "INFO",
                "OFL_OFFLOAD_GROUP": "x", "OFL_DISK_BUDGET": ""})
ok(odd.returncode == 0 and odd.stdout == gen.stdout,
   "its output is the same whatever OFL_* the shell sets", odd.stderr)

text = open(page).read()
head, sep, body = text.partition(MARKER)
if write and gen.returncode == 0:
    with open(page, "w") as f:
        f.write(head + MARKER + gen.stdout)
    body, sep = gen.stdout, MARKER
ok(sep == MARKER, "the page has its marker line", MARKER)
diff = "".join(difflib.unified_diff(body.splitlines(True),
                                    gen.stdout.splitlines(True),
                                    "docs/configuration.md",
                                    "ofl-info --markdown"))
ok(body == gen.stdout,
   "the page below the marker is ofl-info --markdown",
   diff + "\nregenerate: python3 tests/install/check_config_doc.py "
   "<build>/tools/ofl-info docs/configuration.md --write")
print("TAP version 13")
print(f"1..{len(results)}")
for i, (good, what, detail) in enumerate(results, 1):
    print(f"{'ok' if good else 'not ok'} {i} - {what}")
    if not good and detail:
        for line in str(detail).splitlines()[:60]:
            print(f"# {line}")
sys.exit(0 if all(r[0] for r in results) else 1)
