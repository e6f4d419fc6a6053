# Optional bundling: OFL_BUNDLE_LIBRARY=/path/to/libofl.so pip install ./python
# copies that library into the package (ofl/_libs/), so the installed package
# does not need libofl on the system loader's path. Without it the package is
# pure Python and finds libofl at run time (OFL_LIBRARY, meson install, ...).
import glob
import os
import shutil

from setuptools import setup

src = os.environ.get("OFL_BUNDLE_LIBRARY")
here = os.path.dirname(os.path.abspath(__file__))
dst = os.path.join(here, "ofl", "_libs")
if src:
    os.makedirs(dst, exist_ok=True)
    for old in glob.glob(os.path.join(dst, "libofl.so*")):
        os.remove(old)
    shutil.copy2(os.path.realpath(src), os.path.join(dst, "libofl.so"))
setup()
