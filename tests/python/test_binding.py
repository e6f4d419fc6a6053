"""One binding: ofl._ext (ofl.torch's saved-tensor hooks) links libofl and
shares it with the ctypes calls of the package, and the package without the
extension says what is missing. Run by meson (suite python) with the build's
libofl (OFL_LIBRARY) and extension (<build>/python on PYTHONPATH); the
children run the same package with other environments."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend

import ofl  # noqa: E402
from ofl.torch import _core  # noqa: E402

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(ofl.__file__)))  # <repo>/python

# A small offloaded training step: one Linear stack under offload_activations,
# gradients compared byte for byte with the same step without ofl.
STEP = textwrap.dedent("""
    import torch, ofl.torch as ot
    torch.manual_seed(0)
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 64))
    x = torch.randn(32, 64)
    a, b = net(), net()
    a(x).square().sum().backward()
    for _ in range(3):
        b.zero_grad()
        with ot.offload_activations(b, min_offload_size=1):
            y = b(x)
        y.square().sum().backward()
    same = all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    print("bitwise", same)
""")


def child(code, env_extra=None, pythonpath=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    env.pop("OFL_EXPECT_EXT", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=240)


@unittest.skipUnless(_core.hooks_backend == "c", "the build made no ofl._ext")
class OneLibrary(unittest.TestCase):
    def test_the_extension_uses_the_libofl_ctypes_loaded(self):
        from ofl import _ext
        path, _ = _ext.library()
        self.assertTrue(os.path.samefile(path, ofl._lib.path), (path, ofl._lib.path))

    def test_the_extension_links_libofl(self):
        from ofl import _ext
        if shutil.which("readelf") is None:
            self.skipTest("no readelf")
        dyn = subprocess.run(["readelf", "-d", _ext.__file__], capture_output=True,
                             text=True).stdout
        self.assertIn("Shared library: [libofl.so.0]", dyn)

    def test_a_copy_named_by_OFL_LIBRARY_serves_both(self):
        """OFL_LIBRARY at another file of the same soname: ctypes loads it
        first and the extension is bound to it too (one libofl in the
        process), and a step runs bitwise."""
        with tempfile.TemporaryDirectory() as d:
            copy = os.path.join(d, "libofl.so.0")
            shutil.copyfile(os.path.realpath(ofl._lib.path), copy)
            r = child("import ofl, ofl.torch._core as c\n"
                      "from ofl import _ext\n"
                      "print('ctypes', ofl._lib.path)\n"
                      "print('ext', _ext.library()[0])\n"
                      "print('hooks', c.hooks_backend)\n" + STEP,
                      {"OFL_LIBRARY": copy})
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
            self.assertEqual(lines["ctypes"], copy)
            self.assertTrue(os.path.samefile(lines["ext"], copy), r.stdout)
            self.assertEqual(lines["hooks"], "c")
            self.assertEqual(lines["bitwise"], "True")

    def test_OFL_PYTHON_EXT_0_warns_and_changes_nothing(self):
        r = child("import warnings\nwarnings.simplefilter('always')\n"
                  "import ofl.torch._core as c\nprint('hooks', c.hooks_backend)\n" + STEP,
                  {"OFL_PYTHON_EXT": "0"})
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("OFL_PYTHON_EXT=0 no longer selects", r.stderr)
        self.assertIn("hooks c", r.stdout)
        self.assertIn("bitwise True", r.stdout)


class WithoutTheExtension(unittest.TestCase):
    """The package from the source tree alone (no <build>/python on
    PYTHONPATH): ofl.torch imports, its offloading refuses to start with a
    message that says what to install, and the ctypes parts work."""

    def test_offloading_says_what_is_missing(self):
        r = child(textwrap.dedent("""
            import torch, ofl.torch as ot
            from ofl.torch import _core
            print("hooks", _core.hooks_backend)
            m = torch.nn.Linear(8, 8)
            try:
                with ot.offload_activations(m):
                    m(torch.randn(2, 8)).sum().backward()
            except ImportError as e:
                print("refused", e)
            try:
                ot.PipelineOffloadManager.reset_instance(summary=False)
            except ImportError as e:
                print("megatron refused", e)
            # the ctypes parts: a safetensors file written and read back
            import os, tempfile
            d = tempfile.mkdtemp()
            sd = {"w": torch.arange(12, dtype=torch.float32).view(3, 4),
                  "b": torch.tensor([1, 2, 3], dtype=torch.int64)}
            p = os.path.join(d, "x.safetensors")
            ot.save_safetensors(sd, p)
            back = ot.load_safetensors(p)
            print("safetensors", all(torch.equal(sd[k], back[k]) for k in sd))
        """), pythonpath=SOURCE)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("hooks None", r.stdout)
        refused = [line for line in r.stdout.splitlines() if line.startswith("refused")]
        self.assertEqual(len(refused), 1, r.stdout)
        for what in ("ofl._ext", "python3-dev", "pip install ./python"):
            self.assertIn(what, refused[0])
        self.assertIn("megatron refused", r.stdout)
        self.assertIn("safetensors True", r.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
