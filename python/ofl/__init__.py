"""ofl: Python bindings of the ofl activation-offloading runtime (libofl).

The package is pure Python over ctypes; it needs ``libofl.so`` at run time
(see :mod:`ofl._lib` for where it is looked for: ``OFL_LIBRARY`` first).
The PyTorch integration lives in :mod:`ofl.torch`.
"""
from ._errors import OflError, check  # noqa: F401
from . import _lib  # noqa: F401

__version__ = "0.1.0"
library_path = _lib.path
