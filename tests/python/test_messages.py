"""ofl.torch speaks Python: an error raised as an OflError is not also
printed on stderr as a C WARN line first (the library is told that the
package reports the errors it returns: ofl_error_logging_set(0)), and the
exception's message says what to call in Python's names."""
import os
import subprocess
import sys
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

MISUSE = textwrap.dedent("""
    import torch, ofl
    from ofl.torch.megatron import FineGrainedActivationOffloadingInterface as oi
    x = torch.randn(4, 4, requires_grad=True)
    try:
        oi.group_commit(x, name="core_attn", forced_released_tensors=[])
    except ofl.OflError as e:
        print("raised:", e)
""")


class Messages(unittest.TestCase):
    def run_child(self, code, **env):
        e = dict(os.environ, OFL_DEBUG="WARN", **env)
        return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                              text=True, timeout=120)

    def test_an_error_raised_in_python_is_not_printed_as_a_c_warn_first(self):
        run = self.run_child(MISUSE)
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        self.assertIn("raised:", run.stdout)
        self.assertIn("fine_grained_offloading_group_start", run.stdout)
        self.assertNotIn("ofl WARN", run.stderr, run.stderr[-2000:])

    def test_the_c_library_still_warns_for_c_callers(self):
        # the same error from C (no binding said it reports errors) is a WARN
        code = textwrap.dedent("""
            import ctypes, ofl
            lib = ofl._lib.lib
            lib.ofl_error_logging_set(1)
            out = ctypes.c_void_p()
            st = lib.ofl_pool_alloc(None, None, 0, 0, None, ctypes.byref(out))
            print("status", st)
        """)
        run = self.run_child(code)
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        self.assertIn("status 2", run.stdout)
        self.assertIn("ofl WARN", run.stderr)

    def test_wrong_arguments_are_python_errors_naming_the_argument(self):
        import torch
        import ofl.torch as ot
        cases = [
            (dict(model="x"), TypeError, "model must be a torch.nn.Module"),
            (dict(min_offload_size="big"), TypeError, "min_offload_size must be an int"),
            (dict(min_offload_size=1.5), TypeError, "min_offload_size must be an int"),
            (dict(max_fwd_stash_size=None), TypeError, "max_fwd_stash_size must be an int"),
            (dict(use_pin_memory="yes"), TypeError, "use_pin_memory must be True or False"),
            (dict(use_streams="no"), TypeError, "use_streams must be True or False"),
            (dict(min_offload_size=-1), ValueError, "min_offload_size must be >= 0"),
        ]
        for kw, exc, text in cases:
            with self.assertRaises(exc, msg=repr(kw)) as cm:
                ot.OffloadActivations(**kw)
            self.assertIn(text, str(cm.exception))
            self.assertIn("OffloadActivations:", str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            ot.OffloadActivations("yes", "no")
        self.assertIn("use_pin_memory", str(cm.exception))
        # torchtune's own calls still work
        ot.OffloadActivations(True, True, 5, 1024).close()
        ot.OffloadActivations(use_streams=None, model=torch.nn.Linear(2, 2),
                              warn_if_no_head=False).close()

    def test_ofl_info_says_each_problem_once(self):
        run = subprocess.run([sys.executable, "-m", "ofl.info"], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, OFL_OFFLOAD_GROUP="x"))
        out = run.stdout + run.stderr
        self.assertEqual(run.returncode, 1, out[-2000:])
        self.assertEqual(out.count("unknown variable OFL_OFFLOAD_GROUP"), 1, out[-3000:])
        self.assertIn("did you mean OFL_OFFLOAD_GROUPS", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
