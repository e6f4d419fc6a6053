"""ofl: Python bindings of the ofl activation-offloading runtime (libofl).

The package needs ``libofl.so`` at run time (see :mod:`ofl._lib` for where it
is looked for: ``OFL_LIBRARY`` first) and calls it through ctypes; the
saved-tensor hooks of :mod:`ofl.torch` run in the C extension ``ofl._ext``
when it was built (``pip install ./python``), else over ctypes.
"""
import pkgutil as _pkgutil

# A build tree of the repository builds ofl._ext into <build>/python/ofl
# without the Python sources (the python tests put <build>/python on
# PYTHONPATH after python/): the package spans both directories.
__path__ = _pkgutil.extend_path(__path__, __name__)

from ._errors import OflError, check  # noqa: F401,E402
from . import _lib  # noqa: F401,E402

__version__ = "0.1.0"
library_path = _lib.path
