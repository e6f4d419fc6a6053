"""ofl: Python bindings of the ofl activation-offloading runtime (libofl).

``pip install ./python`` builds libofl from the repository's sources into
the package (``ofl/_libs``), with ``ofl-info`` and the C extension
``ofl._ext``; :mod:`ofl._lib` loads it through ctypes (``OFL_LIBRARY``
first, see there for the order). The saved-tensor hooks of :mod:`ofl.torch`
are ``ofl._ext``'s, which links the same libofl; without the extension
:mod:`ofl.torch`'s offloading refuses to start and says why. :mod:`ofl.torch`
needs PyTorch (``pip install "./python[torch]"``); ``python -m ofl.info``
prints what ``ofl-info`` prints.
"""
import importlib.machinery as _machinery
import pkgutil as _pkgutil
import sys as _sys

# A build tree of the repository builds ofl._ext into <build>/python/ofl
# without the Python sources (the python tests put <build>/python on
# PYTHONPATH after python/): the package spans both directories.
__path__ = _pkgutil.extend_path(__path__, __name__)


class _NeedsTorch:
    """Finds ofl.torch as usual, and turns a missing torch (or numpy) met
    while importing it into an error that says what to install, rather than
    a bare ``No module named 'torch'`` from inside the package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != __name__ + ".torch":
            return None
        spec = _machinery.PathFinder.find_spec(fullname, path or __path__)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_checked(module):
            try:
                exec_module(module)
            except ModuleNotFoundError as e:
                if e.name not in ("torch", "numpy"):
                    raise
                raise ModuleNotFoundError(
                    "ofl.torch needs %s, which this Python cannot import: "
                    "install the package with its torch extra (pip install "
                    "\"ofl[torch]\"; from a checkout: pip install "
                    "\"./python[torch]\"), or install PyTorch "
                    "(https://pytorch.org/get-started)" % e.name,
                    name=e.name) from e

        spec.loader.exec_module = exec_checked
        return spec


if not any(isinstance(f, _NeedsTorch) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _NeedsTorch())

from ._errors import OflError, check  # noqa: F401,E402
from . import _lib  # noqa: F401,E402

__version__ = "0.1.0"
library_path = _lib.path
