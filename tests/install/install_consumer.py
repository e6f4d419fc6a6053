#!/usr/bin/env python3
"""Installs the build into a temporary DESTDIR (meson install --no-rebuild)
and uses it as a consumer would: the installed file set (versioned soname,
no examples in bin/), an ofl.pc without CUDA paths, a five-line C program
built with pkg-config (shared and --static) and with CMake (ofl::ofl and
ofl::ofl_static), each run on the host backend printing the version, the
installed ofl-info, and ldd of libofl.so naming neither libcudart nor
libnccl (they are loaded at run time).

usage: install_consumer.py BUILD_ROOT MESON CC [PKG_CONFIG] [CMAKE]"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

build_root, meson, cc = sys.argv[1:4]
pkgconfig = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
cmake = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None

results = []


def tap(cond, what, detail="", skip=None):
    results.append((bool(cond), what, detail, skip))


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


PROG = r"""#include <ofl/ofl.h>
#include <stdio.h>
int main(void) {
  ofl_device_t *dev;
  if (ofl_device_open(NULL, &dev) != OFL_SUCCESS) return 1;
  printf("ofl %s on %s\n", OFL_VERSION_STRING, ofl_backend_name(ofl_device_backend(dev)));
  ofl_device_close(dev);
  return 0;
}
"""

CMAKELISTS = """cmake_minimum_required(VERSION 3.10)
project(ofl_consumer C)
find_package(ofl 0.1 REQUIRED)
add_executable(prog_shared prog.c)
target_link_libraries(prog_shared PRIVATE ofl::ofl)
add_executable(prog_static prog.c)
target_link_libraries(prog_static PRIVATE ofl::ofl_static)
"""


def main(tmp):
    dest = os.path.join(tmp, "dest")
    intro = json.loads(run([meson, "introspect", "--buildoptions",
                            build_root]).stdout)
    opt = {o["name"]: o["value"] for o in intro}
    if opt.get("b_sanitize", "none") != "none":
        # An instrumented libofl needs the sanitizer runtime in every
        # consumer: the plain consumer builds below cannot link it.
        tap(True, "install and consumer builds",
            skip="sanitizer build (b_sanitize=%s)" % opt["b_sanitize"])
        return
    r = run([meson, "install", "-C", build_root, "--no-rebuild", "--destdir",
             dest])
    tap(r.returncode == 0, "meson install --destdir into a temporary tree",
        r.stdout[-1500:] + r.stderr[-1500:])
    if r.returncode != 0:
        return
    prefix = dest + opt["prefix"]
    libdir = os.path.join(prefix, opt["libdir"])
    bindir = os.path.join(prefix, opt["bindir"])
    incdir = os.path.join(prefix, opt["includedir"])

    # The file set.
    real = os.path.join(libdir, "libofl.so.0.1.0")
    so0 = os.path.join(libdir, "libofl.so.0")
    need = [real, os.path.join(libdir, "libofl.so"), os.path.join(libdir, "libofl.a"),
            os.path.join(incdir, "ofl", "ofl.h"), os.path.join(incdir, "ofl", "version.h"),
            os.path.join(incdir, "ofl", "ofl.hpp"),
            os.path.join(libdir, "pkgconfig", "ofl.pc"),
            os.path.join(libdir, "cmake", "ofl", "oflConfig.cmake"),
            os.path.join(libdir, "cmake", "ofl", "oflConfigVersion.cmake"),
            os.path.join(bindir, "ofl-info")]
    missing = [p for p in need if not os.path.exists(p)]
    tap(not missing, "installed: libofl.so.0.1.0, .so, .a, headers, ofl.pc, "
        "CMake package, ofl-info", "\n".join(missing))
    tap(os.path.islink(so0) and os.readlink(so0) == "libofl.so.0.1.0",
        "libofl.so.0 -> libofl.so.0.1.0")
    sn = run(["readelf", "-d", real]).stdout if os.path.exists(real) else ""
    tap("[libofl.so.0]" in sn, "soname is libofl.so.0", sn[-800:])
    examples = [p for p in ("ofl_pipeline_demo", "ofl_cpp_embed")
                if os.path.exists(os.path.join(bindir, p))]
    tap(not examples or opt.get("install_examples"),
        "examples not installed unless -Dinstall_examples=true",
        " ".join(examples))

    pc = open(os.path.join(libdir, "pkgconfig", "ofl.pc")).read() \
        if not missing or os.path.exists(os.path.join(libdir, "pkgconfig", "ofl.pc")) else ""
    bad = [w for w in ("/usr/local/cuda", "cudart", "nccl", "cuda/") if w in pc]
    tap(pc and not bad, "ofl.pc names no CUDA path or library",
        "found: " + ", ".join(bad) + "\n" + pc)

    env = dict(os.environ)
    env["OFL_BACKEND"] = "host"
    env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"]
                                       if env.get("LD_LIBRARY_PATH") else "")
    src = os.path.join(tmp, "prog")
    os.makedirs(src)
    with open(os.path.join(src, "prog.c"), "w") as f:
        f.write(PROG)
    want = re.compile(r"^ofl \d+\.\d+\.\d+ on host$", re.M)

    def build_and_run(what, cmd, exe, cwd=None):
        b = run(cmd, cwd=cwd)
        if b.returncode != 0:
            tap(False, what, " ".join(cmd) + "\n" + b.stdout[-1500:] + b.stderr[-1500:])
            return
        o = run([exe], env=env)
        tap(o.returncode == 0 and want.search(o.stdout), what,
            o.stdout[-500:] + o.stderr[-1500:])

    # pkg-config, shared and static, against the DESTDIR tree.
    if pkgconfig:
        pkenv = dict(os.environ)
        pkenv["PKG_CONFIG_PATH"] = os.path.join(libdir, "pkgconfig")
        pkenv["PKG_CONFIG_SYSROOT_DIR"] = dest
        cf = run([pkgconfig, "--cflags", "--libs", "ofl"], env=pkenv)
        st = run([pkgconfig, "--static", "--libs", "ofl"], env=pkenv)
        tap(cf.returncode == 0 and st.returncode == 0,
            "pkg-config --libs ofl and pkg-config --static --libs ofl work",
            cf.stderr + st.stderr + st.stdout)
        # The public headers need no mpi.h: MPI is link-only (Libs.private),
        # so --cflags names ofl's include directory and no MPI path.
        only = run([pkgconfig, "--cflags", "ofl"], env=pkenv)
        tap(only.returncode == 0 and "mpi" not in only.stdout.lower(),
            "pkg-config --cflags ofl has no MPI include path",
            only.stdout + only.stderr)
        if cf.returncode == 0:
            out = os.path.join(tmp, "prog_pc")
            build_and_run("C program built with pkg-config (libofl.so) runs",
                          [cc, os.path.join(src, "prog.c"), "-o", out]
                          + cf.stdout.split(), out)
        if st.returncode == 0:
            # Static: libofl.a plus every library pkg-config --static names.
            out = os.path.join(tmp, "prog_pc_static")
            flags = [a if a != "-lofl" else os.path.join(libdir, "libofl.a")
                     for a in st.stdout.split()]
            cflags = run([pkgconfig, "--cflags", "ofl"], env=pkenv).stdout.split()
            build_and_run("C program built with pkg-config --static (libofl.a) runs",
                          [cc, os.path.join(src, "prog.c"), "-o", out] + cflags + flags,
                          out)
    else:
        tap(True, "pkg-config builds", skip="pkg-config not found")

    if cmake:
        with open(os.path.join(src, "CMakeLists.txt"), "w") as f:
            f.write(CMAKELISTS)
        bdir = os.path.join(tmp, "cmake-build")
        c = run([cmake, "-S", src, "-B", bdir, "-DCMAKE_PREFIX_PATH=" + prefix,
                 "-DCMAKE_C_COMPILER=" + cc])
        tap(c.returncode == 0, "find_package(ofl 0.1) with CMAKE_PREFIX_PATH",
            c.stdout[-1500:] + c.stderr[-1500:])
        if c.returncode == 0:
            build_and_run("CMake program linked to ofl::ofl runs",
                          [cmake, "--build", bdir, "--target", "prog_shared"],
                          os.path.join(bdir, "prog_shared"))
            build_and_run("CMake program linked to ofl::ofl_static runs",
                          [cmake, "--build", bdir, "--target", "prog_static"],
                          os.path.join(bdir, "prog_static"))
            nd = run(["nm", "-D", os.path.join(bdir, "prog_static")]).stdout
            tap("ofl_device_open" not in nd.split(),
                "ofl::ofl_static links libofl.a in (no libofl.so needed)")
            ldd_s = run(["ldd", os.path.join(bdir, "prog_static")]).stdout
            tap("libofl.so" not in ldd_s, "the static program does not load libofl.so", ldd_s)
        vers = os.path.join(tmp, "vers")
        os.makedirs(vers)
        with open(os.path.join(vers, "CMakeLists.txt"), "w") as f:
            f.write("cmake_minimum_required(VERSION 3.10)\nproject(v NONE)\n"
                    "find_package(ofl 9.0 QUIET)\n"
                    "if(ofl_FOUND)\n  message(FATAL_ERROR \"9.0 accepted\")\nendif()\n")
        v = run([cmake, "-S", vers, "-B", os.path.join(tmp, "vers-b"),
                 "-DCMAKE_PREFIX_PATH=" + prefix])
        tap(v.returncode == 0, "oflConfigVersion.cmake refuses an incompatible version",
            v.stdout[-800:] + v.stderr[-800:])
    else:
        tap(True, "CMake builds", skip="cmake not found (ofl.sh installs it)")

    # Without LD_LIBRARY_PATH: ofl-info finds libofl.so.0 by its $ORIGIN rpath.
    env_norpath = dict(env)
    env_norpath.pop("LD_LIBRARY_PATH", None)
    info = run([os.path.join(bindir, "ofl-info"), "--json"], env=env_norpath)
    try:
        json.loads(info.stdout)
        good = info.returncode == 0
    except ValueError:
        good = False
    tap(good, "installed ofl-info --json runs (libofl found through $ORIGIN)",
        info.stderr[-1000:])

    ldd = run(["ldd", real]).stdout
    linked = [l.strip() for l in ldd.splitlines() if "cudart" in l or "nccl" in l]
    tap(not linked, "ldd libofl.so shows neither libcudart nor libnccl",
        "\n".join(linked))


tmp = tempfile.mkdtemp(prefix="ofl-install-")
try:
    main(tmp)
finally:
    shutil.rmtree(tmp, ignore_errors=True)

print("TAP version 13")
print(f"1..{len(results)}")
for i, (good, what, detail, skip) in enumerate(results, 1):
    if skip:
        print(f"ok {i} - {what} # SKIP {skip}")
        continue
    print(f"{'ok' if good else 'not ok'} {i} - {what}")
    if not good and detail:
        for line in str(detail).splitlines()[-30:]:
            print(f"# {line}")
sys.exit(0 if all(r[0] for r in results) else 1)
