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
