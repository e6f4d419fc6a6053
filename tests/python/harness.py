"""The common start of the python tests: torch importable or the test is
skipped (exit 77, meson's skip), the host backend unless the environment
names one, a line saying where the saved-tensor hooks come from, and the
C extension ofl._ext present for the tests that use the hooks: a skip
without it, a failure where the build made it (OFL_EXPECT_EXT=1)."""
import os
import sys

try:
    import torch  # noqa: F401
except Exception as e:  # pragma: no cover
    print("SKIP: torch is not importable (%s); pip install torch numpy" % e)
    sys.exit(77)

os.environ.setdefault("OFL_BACKEND", "host")

from ofl.torch import _core  # noqa: E402

print("ofl.torch hooks: %s (%s)" % (_core.hooks_backend, _core.hooks_backend_reason))

# the tests that run without ofl._ext: the stager's and the package's own
_WITHOUT_EXT = ("test_stager.py", "test_stager_sweep.py", "test_binding.py")
if _core.hooks_backend != "c" and os.path.basename(sys.argv[0]) not in _WITHOUT_EXT:
    if os.environ.get("OFL_EXPECT_EXT") == "1":
        print("FAIL: the build made ofl._ext but ofl.torch cannot use it: %s"
              % _core.hooks_backend_reason)
        sys.exit(1)
    print("SKIP: ofl.torch's saved-tensor hooks need ofl._ext: %s" % _core.hooks_backend_reason)
    sys.exit(77)


# Under AddressSanitizer (the asan_python setup sets OFLTEST_ASAN=1) freed
# blocks wait in its quarantine and its allocator keeps per-size caches, so
# the process's RSS grows with every allocation whatever ofl does: the RSS
# bounds of the long-run tests are checked in the plain suite only (the
# pools' and the manager's counters are checked under ASan too).
RSS_CHECKED = os.environ.get("OFLTEST_ASAN") != "1"


def assert_rss_growth(tc, grown, limit, what=""):
    """tc.assertLess(grown, limit) where RSS means something (not under
    AddressSanitizer)."""
    if RSS_CHECKED:
        tc.assertLess(grown, limit, what)
