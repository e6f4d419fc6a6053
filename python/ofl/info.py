"""``python -m ofl.info``: what ``ofl-info`` prints, for the libofl this
package loads (the same arguments: ``--json``, ``-v``, ``--version``), and
its exit status: 1 when an ``OFL_*`` value is invalid, an ``OFL_*`` variable
unknown, or the backend ``OFL_BACKEND`` names not available here.

The ofl-info run is the one next to the library ofl loaded: in the package
(``ofl/_libs/ofl-info``, built with it by ``pip install``), in a build tree
(``<build>/tools/ofl-info``) or in an install prefix (``<prefix>/bin``);
else the first on ``PATH``. Without any, the configuration check and table
are printed through ctypes (the backends and devices need ofl-info).
"""
import os
import shutil
import sys


def _candidates(lib_path):
    d = os.path.dirname(os.path.realpath(lib_path)) if lib_path else ""
    if d:
        yield os.path.join(d, "ofl-info")
        yield os.path.join(d, "tools", "ofl-info")
        yield os.path.join(d, "..", "bin", "ofl-info")
        yield os.path.join(d, "..", "..", "bin", "ofl-info")
    found = shutil.which("ofl-info")
    if found:
        yield found


def find_ofl_info(lib_path):
    """The ofl-info that goes with the library at lib_path, or None."""
    for p in _candidates(lib_path):
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return os.path.abspath(p)
    return None


def _fallback(argv):
    import ctypes
    from . import _lib
    lib = _lib.lib
    lib.ofl_config_check.restype = ctypes.c_size_t
    lib.ofl_config_check.argtypes = [ctypes.c_void_p]
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.fflush.argtypes = [ctypes.c_void_p]
    sys.stdout.flush()
    sys.stderr.flush()
    err = libc.fdopen(os.dup(2), b"w")
    problems = lib.ofl_config_check(err)
    libc.fflush(err)
    print("# ofl-info was not found next to %s: the configuration only"
          % _lib.path)
    sys.stdout.flush()
    out = libc.fdopen(os.dup(1), b"w")
    lib.ofl_config_print.argtypes = [ctypes.c_void_p]
    lib.ofl_config_print(out)
    libc.fflush(out)
    return 1 if problems else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    from . import _lib
    exe = find_ofl_info(_lib.path)
    if exe is None:
        return _fallback(argv)
    # The same library as this process, whatever ofl-info's own RUNPATH.
    env = dict(os.environ)
    libdir = os.path.dirname(os.path.realpath(_lib.path))
    env["LD_LIBRARY_PATH"] = libdir + (
        ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, [exe] + list(argv), env)


if __name__ == "__main__":
    sys.exit(main())
