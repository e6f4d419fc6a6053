"""The device-level memory target from Python (host backend, CPU):
device_memory_target= with offload_modules="auto" through offload_activations
and the Megatron interface. The warmup measures what is not activations
(here "weights" taken from ofl's device, as a C program's would be: torch
keeps no CPU allocator statistics) and the plan's activation target is the
rest of the device target; stats()["plan"] gives the figures; a target
below what is not activations raises an OflError with both figures, and
training goes on; the tighter of two targets wins; gradients bitwise equal
to plain PyTorch. Run by meson (suite python); exits 77 (skip) without
torch."""
import ctypes
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import ofl.torch as ot  # noqa: E402
from ofl import OflError, _lib  # noqa: E402
from ofl._lib import lib as L  # noqa: E402
from ofl.torch._core import Runtime  # noqa: E402
from model import TinyTransformer, make_data, one_f_one_b, train  # noqa: E402
from test_auto_plan import assert_same, fresh_model, plain_loop  # noqa: E402

torch.set_num_threads(1)
VOCAB, SEQ = 64, 16
WEIGHTS = 8 << 20

L.ofl_device_malloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
L.ofl_device_malloc.restype = ctypes.c_int
L.ofl_device_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
L.ofl_device_free.restype = ctypes.c_int


class Weights:
    """WEIGHTS bytes of ofl's device memory held while the test runs."""

    def __enter__(self):
        self.dev = Runtime.get().dev
        self.p = ctypes.c_void_p()
        self.assert_ok(L.ofl_device_malloc(self.dev, WEIGHTS, ctypes.byref(self.p)))
        return self

    def __exit__(self, *exc):
        self.assert_ok(L.ofl_device_free(self.dev, self.p))

    @staticmethod
    def assert_ok(st):
        if st != 0:
            raise OflError(st, "ofl_device_malloc/free")


def ctx_loop(ctx):
    def loop(m, mbs):
        losses = []
        for tok, tgt in mbs:
            with ctx:
                loss = m(tok, tgt)
            losses.append(loss.detach().clone())
            (loss / len(mbs)).backward()
        return losses
    return loop


def check_device_plan(tc, plan, device_target):
    """The figures of the device target in stats()["plan"], and the
    activation target the C plan took from them."""
    tc.assertEqual(plan["device_target_bytes"], device_target)
    tc.assertEqual(plan["device_source"], "ofl device")
    rest = plan["non_activation_bytes"]
    tc.assertEqual(rest, plan["device_peak_bytes"] - plan["activation_pool_peak_bytes"])
    tc.assertGreaterEqual(rest, WEIGHTS, "the weights are not activations")
    tc.assertLess(rest, WEIGHTS + plan["peak_none_bytes"] + (4 << 20))
    return rest


class OffloadActivations(unittest.TestCase):
    def run_ctx(self, steps=4, **kw):
        data = make_data(steps=steps, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, plain_loop)
        ctx = ot.offload_activations(min_offload_size=64, offload_modules="auto", **kw)
        offl = train(fresh_model(), data, ctx_loop(ctx))
        assert_same(self, base, offl)
        return ctx

    def test_the_rest_of_the_device_target_goes_to_activations(self):
        with Weights():
            target = WEIGHTS + (64 << 20)
            ctx = self.run_ctx(device_memory_target=target)
            plan = ctx.stats()["plan"]
            rest = check_device_plan(self, plan, target)
            self.assertEqual(plan["target_bytes"], target - rest)
            self.assertEqual(plan["met"], 1)
            ctx.close()

    def test_the_tighter_target_wins(self):
        with Weights():
            target = WEIGHTS + (64 << 20)
            ctx = self.run_ctx(device_memory_target=target, memory_target="4K")
            plan = ctx.stats()["plan"]
            check_device_plan(self, plan, target)
            self.assertEqual(plan["target_bytes"], 4 << 10)
            ctx.close()

    def test_below_what_is_not_activations_raises_with_both_figures(self):
        data = make_data(steps=4, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, plain_loop)
        with Weights():
            target = WEIGHTS // 2
            ctx = ot.offload_activations(min_offload_size=64, offload_modules="auto",
                                         device_memory_target=target)
            loop = ctx_loop(ctx)
            errors = []
            model = fresh_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            losses, grads = [], []
            for i, mbs in enumerate(data):
                opt.zero_grad(set_to_none=True)
                try:
                    losses.append(loop(model, mbs))
                except OflError as e:
                    errors.append(e)
                    # where the warmup ended (the next step's first forward),
                    # the step is run again from the start
                    opt.zero_grad(set_to_none=True)
                    losses.append(loop(model, mbs))
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                opt.step()
            self.assertEqual(len(errors), 1, errors)
            msg = str(errors[0])
            plan = ctx.stats()["plan"]
            rest = plan["non_activation_bytes"]
            self.assertIn("%d bytes" % target, msg)
            self.assertIn("%d bytes" % rest, msg)
            self.assertGreaterEqual(rest, WEIGHTS)
            # everything that may go is offloaded, and the numbers are exact
            self.assertEqual(plan["predicted_peak_bytes"], plan["peak_all_bytes"])
            assert_same(self, base, (losses, grads))
            ctx.close()

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "device_memory_target"):
            ot.offload_activations(device_memory_target="1G")  # without auto
        with self.assertRaisesRegex(TypeError, "device_memory_target"):
            ot.offload_activations(offload_modules="auto", device_memory_target=1.5)
        with self.assertRaisesRegex(ValueError, "device_memory_target"):
            ot.OffloadActivations(offload_modules="auto", device_memory_target="lots")


class Megatron(unittest.TestCase):
    def setUp(self):
        ot.PipelineOffloadManager.destroy_instance()

    def tearDown(self):
        ot.PipelineOffloadManager.destroy_instance()

    def test_get_instance_with_a_device_target(self):
        data = make_data(steps=4, microbatches=4, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, lambda m, mbs: one_f_one_b(m, mbs, offload=False))
        with Weights():
            target = WEIGHTS + (32 << 20)
            mgr = ot.PipelineOffloadManager.get_instance(offload_modules="auto",
                                                         device_memory_target="%dK" % (target >> 10))
            offl = train(fresh_model(), data, lambda m, mbs: one_f_one_b(m, mbs, offload=True))
            assert_same(self, base, offl)
            plan = mgr.stats()["plan"]
            rest = check_device_plan(self, plan, target)
            self.assertEqual(plan["target_bytes"], target - rest)

    def test_init_chunk_handler_keyword(self):
        mgr = ot.PipelineOffloadManager.get_instance()
        ot.init_chunk_handler(1, 0, 1, offload_modules="auto", device_memory_target="1G")
        self.assertEqual(mgr._knobs["device_memory_target"], 1 << 30)
        with self.assertRaisesRegex(TypeError, "device_memory_target"):
            ot.PipelineOffloadManager(offload_modules="auto", device_memory_target=[1])


if __name__ == "__main__":
    unittest.main(verbosity=2)
