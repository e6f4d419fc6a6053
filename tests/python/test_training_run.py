"""ofl.torch through a real training run (host backend): iterations end for a
reused and a fresh context per step, nothing grows over thousands of steps,
every saved tensor comes back exactly (dtypes, views, conj/neg bits), in-place
changes after the save are caught, exceptions leave the context usable,
graphs used more than once work, misuse gets a Python message, and the
output head and buffers stay where they are. Gradients are compared bitwise
against the same program without hooks."""
import gc
import os
import subprocess
import sys
import threading
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import ofl  # noqa: E402
import ofl.torch as ot  # noqa: E402
from ofl.torch import offload as off  # noqa: E402

torch.set_num_threads(1)
LONG = int(os.environ.get("OFL_TEST_LONG_STEPS", "2000"))


def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


class MLP(nn.Module):
    def __init__(self, d=48, h=96, out=12):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, h)
        self.output = nn.Linear(h, out)

    def forward(self, x):
        return self.output(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return MLP()


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 48, generator=g), torch.randint(0, 12, (16,), generator=g))
            for _ in range(n)]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise(tc, a, b, what=""):
    tc.assertEqual(set(a), set(b), what)
    for n in a:
        tc.assertTrue(torch.equal(a[n], b[n]), "%s: %s differs" % (what, n))


def sgd_step(model, opt, batch, ctx):
    """One step, the forward under ctx (None: no hooks); the loss."""
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with ctx if ctx is not None else torch.enable_grad():
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def train(model, batches, ctx_factory, steps=None):
    """SGD steps; ctx_factory() -> the context of each step's forward
    (None: no hooks). Returns the losses and the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = [sgd_step(model, opt, batches[i % len(batches)], ctx_factory())
              for i in range(steps or len(batches))]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


class Fresh(unittest.TestCase):
    """Each test starts without idle managers of earlier tests (contexts
    with the same settings share them)."""

    def setUp(self):
        gc.collect()
        off.release_managers()


class Lifecycle(Fresh):
    def test_reused_and_fresh_context_same_numbers(self):
        batches = data(6)
        base = train(make_mlp(), batches, lambda: None, steps=12)
        ctx = ot.offload_activations(min_offload_size=64)
        reused = train(make_mlp(), batches, lambda: ctx, steps=12)
        fresh = train(make_mlp(), batches, lambda: ot.offload_activations(min_offload_size=64),
                      steps=12)
        for run in (reused, fresh):
            for a, b in zip(base[0], run[0]):
                self.assertTrue(torch.equal(a, b))
            assert_bitwise(self, base[1], run[1])
        st = ctx.stats()
        self.assertEqual(st["iterations"], 12)
        self.assertFalse(ctx._core.is_warmup())
        self.assertGreater(st["offloaded_bytes"], 0)
        self.assertEqual(st["unpopped_tensors"], 0)
        ctx.close()
        ctx.close()  # idempotent

    def _long_run(self, model, make_ctx, steps):
        batches = data(4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(i):
            sgd_step(model, opt, batches[i % 4], make_ctx())

        for i in range(50):
            step(i)
        gc.collect()
        r0 = rss_kib()
        for i in range(steps):
            step(i)
        gc.collect()
        return rss_kib() - r0

    def test_long_run_rss_and_iterations(self):
        """LONG steps each: plain, one context reused, a fresh context per
        step. RSS growth within 16 MiB of the plain loop's; iterations
        counted, warmup over, nothing left on the model."""
        model = make_mlp()
        plain = self._long_run(model, lambda: None, LONG)
        ctx = ot.offload_activations(model, min_offload_size=64)
        it0 = None
        reused = self._long_run(model, lambda: ctx, LONG)
        st = ctx.stats()
        self.assertEqual(st["iterations"], LONG + 50)
        self.assertFalse(ctx._core.is_warmup())
        self.assertEqual(st["unpopped_tensors"], 0)
        self.assertGreater(st["offloaded_bytes"], 0)
        ctx.close()
        sessions_before = sum(len(v) for v in off._sessions.values())
        made = []

        def fresh_ctx():
            c = ot.offload_activations(model, min_offload_size=64)
            made.append(1)
            return c

        fresh = self._long_run(model, fresh_ctx, LONG)
        gc.collect()
        self.assertEqual(len(made), LONG + 50)
        # no manager per step: the fresh contexts took over the dropped one's
        self.assertLessEqual(sum(len(v) for v in off._sessions.values()), sessions_before + 1)
        self.assertEqual(len(model.output._forward_hooks), 0)
        self.assertEqual(len(model.output._forward_pre_hooks), 0)
        s = [s for v in off._sessions.values() for s in v if s.core.stats()["iterations"] > 0]
        self.assertTrue(any(x.core.stats()["iterations"] >= LONG for x in s))
        print("RSS growth over %d steps: plain %+d KiB, reused context %+d KiB, "
              "fresh context per step %+d KiB" % (LONG, plain, reused, fresh))
        self.assertLess(reused - plain, 16 * 1024)
        self.assertLess(fresh - plain, 16 * 1024)
        del it0

    def test_two_copies_per_tensor(self):
        """Host backend: a saved CPU tensor is offloaded from torch's memory
        in place (no copy into ofl's device pool first): the forward asks
        the device pool for nothing, and the device copies are one D2H per
        offloaded tensor and one H2D per reload."""
        model = make_mlp()
        x, y = data(1)[0]
        ctx = ot.offload_activations(min_offload_size=64)
        for _ in range(3):
            with ctx:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        core = ctx._core
        p0, d0, m0 = ctx.pool_stats()["device_pool"], ctx.device_stats(), ctx.stats()
        with ctx:
            loss = F.cross_entropy(model(x), y)
        core.synchronize()
        p1, d1, m1 = ctx.pool_stats()["device_pool"], ctx.device_stats(), ctx.stats()
        self.assertEqual(p1["requests"] - p0["requests"], 0)
        self.assertGreater(m1["offloaded_bytes"] - m0["offloaded_bytes"], 0)
        self.assertEqual(d1["copy_bytes"][1] - d0["copy_bytes"][1],
                         m1["offloaded_bytes"] - m0["offloaded_bytes"])  # D2H
        loss.backward()
        p2, d2, m2 = ctx.pool_stats()["device_pool"], ctx.device_stats(), ctx.stats()
        self.assertEqual(p2["requests"] - p1["requests"],
                         m2["reloaded_tensors"] - m1["reloaded_tensors"])
        self.assertEqual(d2["copy_bytes"][0] - d1["copy_bytes"][0],
                         m2["reloaded_bytes"] - m1["reloaded_bytes"])  # H2D
        self.assertEqual(d2["copies"] - d0["copies"],
                         (m2["offloaded_tensors"] - m0["offloaded_tensors"])
                         + (m2["reloaded_tensors"] - m0["reloaded_tensors"]))
        ctx.close()

    def test_reloads_live_in_torchs_memory(self):
        """The manager's reload pool takes its blocks from torch's allocator
        (torch.empty on the host backend, the caching allocator on cuda):
        ofl allocates no device memory of its own for them."""
        model = make_mlp()
        batches = data(3)
        rt = ot._core.Runtime.get()
        d0 = rt.stats()["device_allocs"]
        rt.allocator()
        h0 = len(rt._blocks)  # blocks of other managers still alive
        ctx = ot.offload_activations(min_offload_size=64)
        train(model, batches, lambda: ctx, steps=6)
        core = ctx._core
        self.assertIsNotNone(core.torch_pool)
        pool = ctx.pool_stats()["device_pool"]
        self.assertGreater(ctx.stats()["reloaded_bytes"], 0)
        self.assertGreater(pool["backend_allocs"], 0)  # the allocator's calls
        self.assertEqual(ctx.device_stats()["device_allocs"], d0)
        held = core.rt._blocks
        self.assertEqual(len(held) - h0, pool["backend_allocs"] - pool["backend_frees"])
        del core
        ctx.close()
        gc.collect()
        off.release_managers()
        self.assertEqual(len(held), h0)  # every block went back to torch

    def test_grad_accumulation_is_one_iteration(self):
        model = make_mlp()
        batches = data(4)
        ctx = ot.offload_activations(min_offload_size=64)
        ref = make_mlp()
        for step in range(3):
            outs, refs = [], []
            for x, y in batches:
                with ctx:
                    outs.append(F.cross_entropy(model(x), y) / 4)
                refs.append(F.cross_entropy(ref(x), y) / 4)
            for o, r in zip(outs, refs):
                o.backward()
                r.backward()
            self.assertEqual(ctx.stats()["iterations"], step + 1)
        assert_bitwise(self, grads(ref), grads(model))
        ctx.close()

    def test_partial_backward_then_next_forward(self):
        """A graph kept alive and used after the next forward started: its
        tensors were reloaded when that iteration ended, nothing is lost."""
        model = make_mlp()
        ref = make_mlp()
        x, y = data(1)[0]
        ctx = ot.offload_activations(min_offload_size=64)
        with ctx:
            h = model.fc2(F.gelu(model.fc1(x)))
            loss = F.cross_entropy(model.output(F.gelu(h)), y)
        rh = ref.fc2(F.gelu(ref.fc1(x)))
        rloss = F.cross_entropy(ref.output(F.gelu(rh)), y)
        # backward of the head only, the rest of the graph kept
        gh, = torch.autograd.grad(loss, h, retain_graph=True)
        rgh, = torch.autograd.grad(rloss, rh, retain_graph=True)
        self.assertTrue(torch.equal(gh, rgh))
        with ctx:  # the next forward ends the iteration
            other = F.cross_entropy(model(x), y)
        loss.backward()
        rloss.backward()
        assert_bitwise(self, grads(ref), grads(model))
        other.backward()
        ctx.close()


class Probe(torch.autograd.Function):
    """Saves its extra inputs; backward records what came back."""

    @staticmethod
    def forward(ctx, x, *ts):
        ctx.save_for_backward(*ts)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Probe.seen = list(ctx.saved_tensors)
        return (g,) + (None,) * len(Probe.seen)


def describe(t):
    return (t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


class Fidelity(Fresh):
    def roundtrip(self, tensors, min_size=1):
        x = torch.randn(3, requires_grad=True)
        expect = [(describe(t), t.clone() if t.numel() else t) for t in tensors]
        ctx = ot.offload_activations(min_offload_size=min_size)
        with ctx:
            y = Probe.apply(x, *tensors)
        y.sum().backward()
        for (d, ref), got in zip(expect, Probe.seen):
            self.assertEqual(describe(got), d)
            if ref.numel():
                a, b = (v.resolve_conj().resolve_neg().contiguous() for v in (got, ref))
                if a.dtype != torch.bool:
                    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
                self.assertTrue(torch.equal(a, b), str(d))  # byte for byte (NaN bits too)
        st = ctx.stats()
        ctx.close()
        return st

    def test_every_dtype(self):
        g = torch.Generator().manual_seed(5)
        dts = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
               torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
               torch.bool]
        for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                  "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32"):
            if hasattr(torch, n):
                dts.append(getattr(torch, n))
        ts = []
        for dt in dts:
            raw = torch.randint(0, 255, (64 * torch.empty(0, dtype=dt).element_size(),),
                                dtype=torch.uint8, generator=g)
            if dt == torch.bool:
                ts.append(raw[:64] > 127)
            else:
                ts.append(raw.view(dt).view(8, 8))
        st = self.roundtrip(ts)
        self.assertGreaterEqual(st["offloaded_tensors"], len(dts) - 2)

    def test_reloaded_tensor_is_not_a_view(self):
        # A saved tensor that is no view comes back as a tensor of its own
        # (imported over the reloaded block through DLPack), as it was saved,
        # not as a view of a byte buffer; the path without DLPack (a view of
        # torch.frombuffer) gives the same bytes.
        ts = [torch.randn(8, 8), torch.randn(4, 4, 4).to(torch.bfloat16),
              torch.arange(64, dtype=torch.int64), (torch.randn(16, 4) > 0)]
        self.roundtrip(ts)
        self.assertEqual([g._base is None for g in Probe.seen], [True] * len(ts))
        prog = ("import sys, unittest; sys.argv[1:] = []\n"
                "import test_training_run as t\n"
                "s = unittest.TestSuite([t.Fidelity('test_every_dtype'),"
                " t.Fidelity('test_views_strides_zero_size')])\n"
                "r = unittest.TextTestRunner(verbosity=0).run(s)\n"
                "t.Fidelity('test_every_dtype').roundtrip([t.torch.randn(8, 8)])\n"
                "view = t.Probe.seen[0]._base is not None  # torch.frombuffer's\n"
                "sys.exit(0 if r.wasSuccessful() and r.testsRun == 2 and view else 1)\n")
        env = dict(os.environ, OFL_EXT_DLPACK="0")
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__))] +
                                            sys.path)
        run = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True,
                             text=True, timeout=300)
        self.assertEqual(run.returncode, 0, run.stdout[-2000:] + run.stderr[-2000:])

    def test_views_strides_zero_size(self):
        base = torch.randn(32, 16)
        ts = [base[4:20], base.t(), base[:, ::2], base[1:2], torch.empty(0, 5),
              torch.randn(1, 8).expand(16, 8), torch.tensor(3.5), base[:3, ::4]]
        self.roundtrip(ts)

    def test_conj_and_neg_bits(self):
        z = torch.randn(16, dtype=torch.complex64)
        ts = [z.conj(), torch._neg_view(z), torch._neg_view(z.conj()), z.conj().resolve_conj()]
        self.roundtrip(ts)
        # gradients through lazy conjugates: bitwise equal to no hooks
        w = torch.randn(16, dtype=torch.complex64)
        runs = []
        for hooked in (False, True):
            a = z.clone().requires_grad_(True)
            ctx = ot.offload_activations(min_offload_size=8) if hooked else None
            with ctx or torch.enable_grad():
                out = (a.conj() * w.conj()).mul(a.conj()).real.sum()
            out.backward()
            runs.append(a.grad.clone())
            if ctx:
                ctx.close()
        self.assertTrue(torch.equal(torch.view_as_real(runs[0]), torch.view_as_real(runs[1])))

    def test_inplace_after_save_raises_like_torch(self):
        for size in (256, 2):  # offloaded, and kept for its size
            for via_view in (False, True):
                msgs = []
                for hooked in (False, True):
                    x = torch.randn(size, requires_grad=True)
                    ctx = ot.offload_activations(min_offload_size=64) if hooked else None
                    with ctx or torch.enable_grad():
                        a = x * 2
                        y = a.sin()
                    (a[: size // 2] if via_view else a).add_(1)
                    with self.assertRaises(RuntimeError) as cm:
                        y.sum().backward()
                    msgs.append(str(cm.exception))
                    if ctx:
                        del y, a
                        ctx.close()
                self.assertIn("modified by an inplace operation", msgs[0])
                self.assertIn("modified by an inplace operation", msgs[1])
                self.assertIn("is at version 1; expected version 0", msgs[1])


class Boom(Exception):
    pass


class Exceptions(Fresh):
    def test_exception_in_forward_then_training_goes_on(self):
        for warm in (False, True):  # raised in the warmup, and in steady state
            model, ref = make_mlp(), make_mlp()
            batches = data(5)
            ctx = ot.offload_activations(min_offload_size=64)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
            fail_at = 0 if not warm else 3
            for i, (x, y) in enumerate(batches):
                opt.zero_grad(set_to_none=True)
                ropt.zero_grad(set_to_none=True)
                if i == fail_at:
                    with self.assertRaises(Boom):
                        with ctx:
                            h = F.gelu(model.fc1(x))
                            raise Boom()
                    del h
                with ctx:
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                rl = F.cross_entropy(ref(x), y)
                rl.backward()
                ropt.step()
                self.assertTrue(torch.equal(loss.detach(), rl.detach()))
            assert_bitwise(self, {n: p.detach() for n, p in ref.named_parameters()},
                           {n: p.detach() for n, p in model.named_parameters()})
            self.assertEqual(ctx._core.unpopped, 0)
            self.assertEqual(ctx.pool_stats()["device_pool"]["in_use_bytes"], 0)
            ctx.close()

    def test_keyboard_interrupt_inside_the_pack_hook(self):
        model, ref = make_mlp(), make_mlp()
        x, y = data(1)[0]
        ctx = ot.offload_activations(min_offload_size=64)
        for _ in range(3):  # past the warmup
            with ctx:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        model.zero_grad(set_to_none=True)
        core = ctx._core
        real = core.pack_offload
        calls = [0]

        def interrupted(t, name, *rest):
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt()
            return real(t, name, *rest)

        core.pack_offload = interrupted
        with self.assertRaises(KeyboardInterrupt):
            with ctx:
                F.cross_entropy(model(x), y)
        del core.pack_offload
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            with ctx:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            F.cross_entropy(ref(x), y).backward()
            assert_bitwise(self, grads(ref), grads(model))
        self.assertEqual(ctx._core.unpopped, 0)
        ctx.close()

    def test_megatron_reset_after_abandoned_step(self):
        ot.PipelineOffloadManager.reset_instance(summary=False, groups="")
        try:
            for where in ("warmup", "steady"):
                model, ref = make_mlp(), make_mlp()
                x, y = data(1)[0]

                def step(m, fail=False):
                    ot.init_chunk_handler(1, 0, 1)
                    h = x.requires_grad_(False) * 1.0
                    h = h.requires_grad_(True)
                    h = ot.fine_grained_offloading_group_start(h, "mlp")
                    with ot.get_context(True):
                        out = m.fc2(F.gelu(m.fc1(h)))
                        if fail:
                            raise Boom()
                    out = ot.fine_grained_offloading_group_commit(out, "mlp")
                    loss = F.cross_entropy(m.output(F.gelu(out)), y)
                    loss.backward()
                    ot.reset()

                if where == "steady":
                    step(model)
                    step(ref.__class__())  # keeps shapes; numbers unused
                with self.assertRaises(Boom):
                    step(model, fail=True)
                ot.reset()  # recovers
                model.zero_grad(set_to_none=True)
                for _ in range(3):
                    model.zero_grad(set_to_none=True)
                    ref.zero_grad(set_to_none=True)
                    step(model)
                    F.cross_entropy(ref(x), y).backward()
                    assert_bitwise(self, grads(ref), grads(model), where)
                self.assertFalse(ot.PipelineOffloadManager.get_instance().is_warmup)
        finally:
            ot.PipelineOffloadManager.destroy_instance()


class GraphReuse(Fresh):
    def both(self, fn):
        out = []
        for hooked in (False, True):
            model = make_mlp()
            x, y = data(1)[0]
            ctx = ot.offload_activations(min_offload_size=64) if hooked else None
            out.append(fn(model, x, y, ctx))
            if ctx:
                self.assertGreater(ctx.stats()["offloaded_bytes"], 0)
                ctx.close()
        return out

    def test_retain_graph_second_backward(self):
        def run(model, x, y, ctx):
            with ctx or torch.enable_grad():
                loss = F.cross_entropy(model(x), y)
            loss.backward(retain_graph=True)
            first = grads(model)
            loss.backward()
            return first, grads(model)

        (a1, a2), (b1, b2) = self.both(run)
        assert_bitwise(self, a1, b1)
        assert_bitwise(self, a2, b2)

    def test_double_backward(self):
        def run(model, x, y, ctx):
            with ctx or torch.enable_grad():
                loss = F.cross_entropy(model(x), y)
                gs = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
                pen = sum((g * g).sum() for g in gs)
            pen.backward()
            return grads(model)

        a, b = self.both(run)
        assert_bitwise(self, a, b)

    def test_hvp(self):
        def run(model, x, y, ctx):
            w = model.fc1.weight.detach().clone()
            v = torch.ones_like(w)

            def f(wt):
                h = F.gelu(F.linear(x, wt, model.fc1.bias))
                return F.cross_entropy(model.output(F.gelu(model.fc2(h))), y)

            with ctx or torch.enable_grad():
                val, hv = torch.autograd.functional.hvp(f, w, v)
            return {"val": val, "hv": hv}

        a, b = self.both(run)
        assert_bitwise(self, a, b)

    def test_megatron_refuses_a_second_backward(self):
        ot.PipelineOffloadManager.reset_instance(summary=False, groups="")
        try:
            ot.init_chunk_handler(1, 0, 1)
            h = torch.randn(16, 48, requires_grad=True)
            h = ot.fine_grained_offloading_group_start(h, "mlp")
            w = torch.randn(48, 48, requires_grad=True)
            with ot.get_context(True):
                out = (h @ w).relu()
            out = ot.fine_grained_offloading_group_commit(out, "mlp")
            out.sum().backward(retain_graph=True)
            with self.assertRaises(RuntimeError) as cm:
                out.sum().backward()
            msg = str(cm.exception)
            self.assertIn("ran a second time", msg)
            self.assertIn("offload_activations()", msg)
            ot.reset()
        finally:
            ot.PipelineOffloadManager.destroy_instance()


class Messages(Fresh):
    def setUp(self):
        super().setUp()
        ot.PipelineOffloadManager.reset_instance(summary=False, groups="")

    def tearDown(self):
        ot.PipelineOffloadManager.destroy_instance()

    def test_markers_refuse_non_tensors(self):
        x = torch.randn(2, 2, requires_grad=True)
        for bad in ([x], 1.5, None, "x"):
            with self.assertRaises(TypeError) as cm:
                ot.fine_grained_offloading_group_start(bad, "core_attn")
            self.assertIn("fine_grained_offloading_group_start: tensor must be a torch.Tensor",
                          str(cm.exception))
        for bad in ([1.5], (), 1.5, None, "x"):
            with self.assertRaises(TypeError) as cm:
                ot.fine_grained_offloading_group_commit(bad, "core_attn")
            self.assertIn("fine_grained_offloading_group_commit: tensor", str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            ot.fine_grained_offloading_group_start(x, 7)
        self.assertIn("name must be", str(cm.exception))
        with self.assertRaises(TypeError):
            ot.fine_grained_offloading_group_commit(x, "a", forced_released_tensors=x)
        with self.assertRaises(ValueError) as cm:
            ot.fine_grained_offloading_group_start(torch.randn(2), "a")
        self.assertIn("does not require grad", str(cm.exception))

    def test_errors_name_the_python_calls(self):
        ot.init_chunk_handler(1, 0, 1)
        x = ot.fine_grained_offloading_group_start(torch.randn(4, 4, requires_grad=True), "mlp")
        with self.assertRaises(ofl.OflError) as cm:
            ot.fine_grained_offloading_group_commit(x * 2, "core_attn")
        text = str(cm.exception)
        self.assertIn("fine_grained_offloading_group_commit", text)
        self.assertNotIn("ofl_manager_", text)
        ot.fine_grained_offloading_group_commit(x * 2, "mlp")
        ot.reset()

    def test_context_from_two_threads(self):
        ctx = ot.offload_activations(min_offload_size=64)
        errs = []
        entered, release = threading.Event(), threading.Event()

        def hold():
            with ctx:
                entered.set()
                release.wait(10)

        t = threading.Thread(target=hold)
        t.start()
        entered.wait(10)
        try:
            with ctx:
                pass
        except RuntimeError as e:
            errs.append(str(e))
        release.set()
        t.join()
        self.assertEqual(len(errs), 1)
        self.assertIn("another thread", errs[0])
        ctx.close()

    def test_close_before_backward(self):
        model = make_mlp()
        x, y = data(1)[0]
        ctx = ot.offload_activations(min_offload_size=64)
        with ctx:
            loss = F.cross_entropy(model(x), y)
        with self.assertRaises(RuntimeError) as cm:
            ctx.close()
        self.assertIn("close() before backward", str(cm.exception))
        loss.backward()  # nothing was lost
        ref = make_mlp()
        F.cross_entropy(ref(x), y).backward()
        assert_bitwise(self, grads(ref), grads(model))
        ctx.close()


class TiedLinear:
    """torchtune's TiedLinear: not a module; .linear is."""

    class _Lin(nn.Module):
        def forward(self, x, w):
            return F.linear(x, w)

    def __init__(self, emb):
        self.emb = emb
        self.linear = TiedLinear._Lin()

    def __call__(self, x):
        return self.linear(x, self.emb.weight)


class TinyLM(nn.Module):
    def __init__(self, tied):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(40, 32)
        self.layers = nn.ModuleList([nn.ModuleDict({"w1": nn.Linear(32, 64),
                                                    "w3": nn.Linear(64, 32)})
                                     for _ in range(2)])
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32).repeat(16, 1))
        if tied:
            self.output = TiedLinear(self.tok)
        else:
            self.output = nn.Linear(32, 40, bias=False)

    def forward(self, ids):
        h = self.tok(ids)
        for blk in self.layers:
            h = h + blk["w3"](F.silu(blk["w1"](h)))
        h = h * self.scale[: h.shape[-2]]
        return self.output(h)


class Head(Fresh):
    def run_lm(self, model, ctx):
        ids = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(2))
        saved = []

        def spy(t):
            saved.append(t)
        with ctx:
            logits = model(ids)
        logits.float().pow(2).mean().backward()
        return logits

    def test_tied_and_untied_heads_exempt_buffers_kept(self):
        for tied in (True, False):
            model = TinyLM(tied)
            head = model.output.linear if tied else model.output
            seen = {}

            def pre(mod, args):
                seen["head_in"] = args[0]
            h = head.register_forward_pre_hook(pre)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ctx = ot.offload_activations(model, min_offload_size=64)
            ref = TinyLM(tied)
            self.run_lm(model, ctx)
            self.run_lm(ref, torch.enable_grad())
            assert_bitwise(self, grads(ref), grads(model), "tied=%s" % tied)
            # the head's input (saved by the head's matmul) was never offloaded,
            # the layers' activations were, the buffer neither
            core = ctx._core
            offloaded = core.stats()["offloaded_bytes"]
            h.remove()
            ctx.close()
            off.release_managers()
            ctx2 = ot.offload_activations(model, min_offload_size=64)
            ctx2._head = None  # no head rule: the head's input goes too
            model.zero_grad(set_to_none=True)
            self.run_lm(model, ctx2)
            head_bytes = seen["head_in"].numel() * seen["head_in"].element_size()
            self.assertEqual(ctx2.stats()["offloaded_bytes"] - offloaded, head_bytes)
            self.assertTrue(model.scale._ofl_not_offloadable)
            ctx2.close()
            off.release_managers()

    def test_warns_without_head(self):
        class NoHead(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x)

        with self.assertWarns(UserWarning) as cm:
            ot.offload_activations(NoHead())
        self.assertIn("no output head", str(cm.warning))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ot.offload_activations(NoHead(), warn_if_no_head=False)

    def test_buffer_saved_is_the_buffer(self):
        buf = nn.Buffer(torch.randn(64, 64))
        x = torch.randn(64, 64, requires_grad=True)
        ctx = ot.offload_activations(min_offload_size=64)
        with ctx:
            y = Probe.apply(x, buf, x * 1.0)
        y.sum().backward()
        self.assertEqual(Probe.seen[0].data_ptr(), buf.data_ptr())  # kept
        self.assertNotEqual(Probe.seen[1].untyped_storage().data_ptr(),
                            x.untyped_storage().data_ptr())
        ctx.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
