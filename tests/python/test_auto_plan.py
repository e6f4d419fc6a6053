"""The auto offload plan from Python (host backend, CPU): offload_modules=
"auto" with a memory_target through the Megatron interface (get_instance,
init_chunk_handler) and offload_activations; gradients bitwise equal to
plain PyTorch; stats()["plan"] mirrors ofl_manager_plan_t; the arguments'
errors are Python's (TypeError/ValueError naming the argument). Run by meson
(suite python); exits 77 (skip) without torch."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import ofl.torch as ot  # noqa: E402
from ofl import _lib  # noqa: E402
from model import TinyTransformer, make_data, one_f_one_b, train  # noqa: E402

torch.set_num_threads(1)
VOCAB, SEQ = 64, 16
PLAN_FIELDS = {"automatic", "met", "exact", "target_bytes", "predicted_peak_bytes",
               "peak_all_bytes", "peak_none_bytes", "shortfall_bytes",
               "predicted_exposed_ms", "predicted_stall_ms", "d2h_gbps", "h2d_gbps", "rate_source", "iterations",
               "measured_peak_bytes", "measured_peak_max_bytes", "measured_stall_ms",
               "lead_changes", "replans", "names", "release_ms", "warmup_stall_ms",
               "settled_iterations", "measured_peak_settled_bytes",
               "actions", "recompute"}  # the last two: ofl.torch's (per name's action)
NAME_FIELDS = {"name", "groups", "chosen", "bytes", "chosen_bytes", "copy_ms", "window_ms",
               "exposed_ms", "prefetch_lead_max"}


def fresh_model(seed=0):
    torch.manual_seed(seed)
    return TinyTransformer(vocab=VOCAB, seq=SEQ)


def plain_loop(model, mbs):
    losses = []
    for tok, tgt in mbs:
        loss = model(tok, tgt)
        losses.append(loss.detach().clone())
        (loss / len(mbs)).backward()
    return losses


def assert_same(tc, run_a, run_b):
    (la, ga), (lb, gb) = run_a, run_b
    for sa, sb in zip(la, lb):
        for a, b in zip(sa, sb):
            tc.assertTrue(torch.equal(a, b), "losses differ: %r vs %r" % (a, b))
    for sa, sb in zip(ga, gb):
        tc.assertEqual(sa.keys(), sb.keys())
        for n in sa:
            tc.assertTrue(torch.equal(sa[n], sb[n]), "gradient of %s differs" % n)


def check_plan(tc, plan, target):
    tc.assertIsNotNone(plan, "no plan after the warmup")
    tc.assertEqual(set(plan), PLAN_FIELDS)
    tc.assertEqual(plan["automatic"], 1)
    tc.assertEqual(plan["target_bytes"], target)
    tc.assertGreater(plan["peak_none_bytes"], 0)
    tc.assertGreaterEqual(plan["iterations"], 1)
    tc.assertGreater(plan["measured_peak_max_bytes"], 0)
    tc.assertIn(plan["rate_source"], ("measured", "link model", "memcpy"))
    tc.assertGreater(plan["d2h_gbps"], 0)
    tc.assertTrue(plan["names"])
    for x in plan["names"]:
        tc.assertEqual(set(x), NAME_FIELDS)
        tc.assertIsInstance(x["name"], str)
        tc.assertLessEqual(x["chosen"], x["groups"])
        tc.assertLessEqual(x["chosen_bytes"], x["bytes"])
    tc.assertEqual(set(plan["actions"]), {x["name"] for x in plan["names"]})
    for a in plan["actions"].values():
        tc.assertIn(a["action"], ("keep", "offload", "recompute"))
    chosen = sum(x["chosen_bytes"] for x in plan["names"])
    if plan["peak_none_bytes"] > target:
        tc.assertGreater(chosen, 0, "a target below the no-offload peak chose nothing")
    else:
        tc.assertEqual(chosen, 0, "a target met without offload moved bytes")


class ParseBytes(unittest.TestCase):
    def test_sizes(self):
        p = _lib.parse_bytes
        self.assertEqual(p("f", "a", 4096), 4096)
        self.assertEqual(p("f", "a", "64K"), 64 << 10)
        self.assertEqual(p("f", "a", "1.5M"), 3 << 19)
        self.assertEqual(p("f", "a", "2G"), 2 << 30)
        self.assertEqual(p("f", "a", "512 MiB"), 512 << 20)
        self.assertEqual(p("f", "a", "100"), 100)

    def test_errors_name_the_argument(self):
        for bad, exc in ((-1, ValueError), ("12Q", ValueError), ("", ValueError),
                         ("M", ValueError), (1.5, TypeError), (True, TypeError),
                         (None, TypeError)):
            with self.assertRaisesRegex(exc, "memory_target"):
                _lib.parse_bytes("offload_activations", "memory_target", bad)


class Megatron(unittest.TestCase):
    def setUp(self):
        ot.PipelineOffloadManager.destroy_instance()

    def tearDown(self):
        ot.PipelineOffloadManager.destroy_instance()

    def run_auto(self, **knobs):
        data = make_data(steps=4, microbatches=4, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, lambda m, mbs: one_f_one_b(m, mbs, offload=False))
        mgr = ot.PipelineOffloadManager.get_instance(**knobs)
        offl = train(fresh_model(), data, lambda m, mbs: one_f_one_b(m, mbs, offload=True))
        assert_same(self, base, offl)
        return mgr

    def test_get_instance_auto_with_target(self):
        mgr = self.run_auto(offload_modules="auto", memory_target="8K")
        st = mgr.stats()
        self.assertGreater(st["offloaded_bytes"], 0)
        check_plan(self, st["plan"], 8 << 10)

    def test_roomy_target_offloads_nothing_after_warmup(self):
        mgr = self.run_auto(offload_modules="auto", memory_target=1 << 30)
        check_plan(self, mgr.stats()["plan"], 1 << 30)

    def test_init_chunk_handler_keywords(self):
        mgr = ot.PipelineOffloadManager.get_instance()
        ot.init_chunk_handler(1, 0, 1, offload_modules="auto", memory_target="16K")
        self.assertEqual(mgr._knobs["groups"], b"auto")
        self.assertEqual(mgr._knobs["memory_target"], 16 << 10)
        self.assertIsNone(mgr.stats()["plan"])  # before the end of the warmup

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "memory_target"):
            ot.PipelineOffloadManager(offload_modules="auto", memory_target="lots")
        with self.assertRaisesRegex(TypeError, "offload_modules|groups"):
            ot.PipelineOffloadManager(offload_modules=3)
        with self.assertRaisesRegex(TypeError, "memory_target"):
            ot.init_chunk_handler(1, 0, 1, offload_modules="auto", memory_target=2.5)
        with self.assertRaisesRegex(TypeError, "offload_modules"):
            ot.init_chunk_handler(1, 0, 1, offload_modules=[1])

    def test_no_plan_key_without_auto(self):
        mgr = ot.PipelineOffloadManager.get_instance(groups="")
        self.assertNotIn("plan", mgr.stats())


class OffloadActivations(unittest.TestCase):
    def test_auto_bitwise_equal_and_plan(self):
        data = make_data(steps=4, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, plain_loop)
        ctx = ot.offload_activations(min_offload_size=64, offload_modules="auto",
                                     memory_target="16K")

        def loop(m, mbs):
            losses = []
            for tok, tgt in mbs:
                with ctx:
                    loss = m(tok, tgt)
                losses.append(loss.detach().clone())
                (loss / len(mbs)).backward()
            return losses

        offl = train(fresh_model(), data, loop)
        assert_same(self, base, offl)
        st = ctx.stats()
        self.assertGreater(st["offloaded_bytes"], 0)
        check_plan(self, st["plan"], 16 << 10)
        ctx.close()

    def test_auto_names_are_module_paths(self):
        """With a model, each group is named by the module that saved it
        (issue 39): the plan lists module paths, bitwise equal still."""
        data = make_data(steps=3, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, plain_loop)
        model = fresh_model()
        ctx = ot.offload_activations(model, min_offload_size=64, offload_modules="auto",
                                     memory_target="16K")

        def loop(m, mbs):
            losses = []
            for tok, tgt in mbs:
                with ctx:
                    loss = m(tok, tgt)
                losses.append(loss.detach().clone())
                (loss / len(mbs)).backward()
            return losses

        offl = train(model, data, loop)
        assert_same(self, base, offl)
        plan = ctx.stats()["plan"]
        check_plan(self, plan, 16 << 10)
        names = {x["name"] for x in plan["names"]}
        for want in ("layers.0.attn_norm", "layers.0.mlp_norm", "layers.1.attn_norm",
                     "layers.0", "norm"):
            self.assertIn(want, names)
        self.assertNotIn("output", names)  # the head's tensors stay (never offloaded)
        self.assertTrue(any(x["chosen"] for x in plan["names"] if x["name"] != "activations"))
        ctx.close()

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "memory_target"):
            ot.offload_activations(memory_target="1M")  # without auto
        with self.assertRaisesRegex(ValueError, "offload_modules"):
            ot.offload_activations(offload_modules="core_attn")
        with self.assertRaisesRegex(TypeError, "offload_modules"):
            ot.offload_activations(offload_modules=["auto"])
        with self.assertRaisesRegex(TypeError, "memory_target"):
            ot.offload_activations(offload_modules="auto", memory_target=[1])


if __name__ == "__main__":
    unittest.main(verbosity=2)
