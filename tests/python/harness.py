"""The common start of the python tests: torch importable or the test is
skipped (exit 77, meson's skip), the host backend unless the environment
names one, and a line saying which hooks (C or ctypes) the run uses."""
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
