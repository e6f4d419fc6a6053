"""An interrupt anywhere in a step leaves the process usable (host backend,
the hooks of ofl._ext): KeyboardInterrupt,
and separately an ordinary exception, raised at every line event of
ofl.torch's own Python code that one step reaches (sweep.py), for a step of
offload_activations and one of the Megatron-named markers, in the warmup
and after it.

After each injection the process goes on: two steps with the same context,
two with a new context (then close()), two with the Megatron markers and
reset() (reset() first where the interrupted step was a Megatron one: its
documented recovery). Each of those steps' gradients is bitwise equal to
the same step without offload, every pool has nothing in use after them,
no saved-tensor hooks are left on torch's stack, and nothing raises.

CI takes a deterministic stride of about OFL_SWEEP_POINTS (default 40)
points per (step, phase, exception); OFL_SWEEP_FULL=1 sweeps every line
event and prints the counts (./ofl.sh soak)."""
import gc
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks
import sweep  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import ofl.torch as ot  # noqa: E402
import ofl.torch.megatron as fgao  # noqa: E402
from ofl.torch import offload as off  # noqa: E402

torch.set_num_threads(1)
CI_POINTS = int(os.environ.get("OFL_SWEEP_POINTS", "40"))


class MLP(nn.Module):
    def __init__(self, d=24, h=48, out=10):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, h)
        self.output = nn.Linear(h, out)

    def forward(self, x):
        return self.output(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def make_mlp():
    torch.manual_seed(0)
    return MLP()


_g = torch.Generator().manual_seed(1)
BATCHES = [(torch.randn(8, 24, generator=_g), torch.randint(0, 10, (8,), generator=_g))
           for _ in range(3)]


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def same_bytes(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


# ---- the steps -------------------------------------------------------------------


def offload_step(ctx, model, batch):
    x, y = batch
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def megatron_step(model, batch):
    """One microbatch as Megatron's schedule runs it: init_chunk_handler, a
    group around fc2, the hooks inside, commit, backward, reset()."""
    x, y = batch
    model.zero_grad(set_to_none=True)
    fgao.init_chunk_handler(1, 0, 1)
    h = F.gelu(model.fc1(x))
    h = fgao.fine_grained_offloading_group_start(h, "mlp")
    with fgao.get_context(True):
        out = F.gelu(model.fc2(h))
    out = fgao.fine_grained_offloading_group_commit(out, "mlp", forced_released_tensors=[h])
    loss = F.cross_entropy(model.output(out), y)
    loss.backward()
    fgao.reset()
    return loss.detach()


def plain_step(model, batch):
    x, y = batch
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def _megatron_fresh():
    fgao.PipelineOffloadManager.reset_instance(summary=False, groups="")


def _in_use(pool_stats):
    return {k: v["in_use_bytes"] for k, v in pool_stats.items() if v["in_use_bytes"]}


def _isolate():
    """After a point that left the process unusable: a clean slate, so that
    the next point is judged on its own."""
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    with off._sessions_lock:
        off._sessions.clear()
    _megatron_fresh()
    gc.collect()


class Checker:
    """The steps after an injection, each against the same step without
    offload; returns the first problem, or None."""

    def __init__(self):
        self.model = make_mlp()
        self.ref = make_mlp()

    def _compare(self, what, loss, ref_loss):
        if not same_bytes(loss, ref_loss):
            return "%s: loss differs from the step without offload" % what
        a, b = grads(self.model), grads(self.ref)
        if set(a) != set(b):
            return "%s: gradients of %s, expected %s" % (what, sorted(a), sorted(b))
        for n in a:
            if not same_bytes(a[n], b[n]):
                return "%s: gradient %s differs from the step without offload" % (what, n)
        return None

    def after(self, ctx, megatron_interrupted):
        try:
            return self._after(ctx, megatron_interrupted)
        except BaseException as e:  # noqa: B902 a later call raised: unusable
            return "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")

    def _after(self, ctx, megatron_interrupted):
        if megatron_interrupted:
            fgao.reset()  # the documented recovery of an abandoned Megatron step
            if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
                return "saved-tensor hooks left on torch's stack after reset()"
        for i in range(2):  # the same context
            b = BATCHES[i % len(BATCHES)]
            p = self._compare("same context, step %d" % i, offload_step(ctx, self.model, b),
                              plain_step(self.ref, b))
            if p:
                return p
        ctx.close()
        del ctx
        ctx = ot.offload_activations(min_offload_size=64)
        for i in range(2):  # a new context
            b = BATCHES[(i + 1) % len(BATCHES)]
            p = self._compare("new context, step %d" % i, offload_step(ctx, self.model, b),
                              plain_step(self.ref, b))
            if p:
                return p
        if ctx._core.unpopped:
            return "new context: %d records counted unpopped" % ctx._core.unpopped
        used = _in_use(ctx.pool_stats())
        if used:
            return "new context: pools in use after the steps: %s" % used
        ctx.close()
        for i in range(2):  # the Megatron markers
            b = BATCHES[(i + 2) % len(BATCHES)]
            p = self._compare("megatron markers, step %d" % i, megatron_step(self.model, b),
                              plain_step(self.ref, b))
            if p:
                return p
        mgr = fgao.PipelineOffloadManager.get_instance()
        used = _in_use(mgr.pool_stats())
        if used:
            return "megatron markers: pools in use after reset(): %s" % used
        if mgr._core.open:
            return "megatron markers: groups open after reset()"
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return "saved-tensor hooks left on torch's stack"
        return None


class InterruptSweep(unittest.TestCase):
    """The sweep over a step of offload_activations and over one of the
    Megatron markers."""

    @classmethod
    def setUpClass(cls):
        _megatron_fresh()
        cls.tallies = []

    @classmethod
    def tearDownClass(cls):
        print("hooks %s: swept %d injection points, %d left the process unusable"
              % (ot._core.hooks_backend, sum(t.swept for t in cls.tallies),
                 sum(len(t.bad) for t in cls.tallies)), flush=True)

    def sweep(self, kind, phase, exc):
        chk = Checker()
        tally = sweep.Tally("%s/%s/%s hooks %s" % (kind, phase, exc.__name__,
                                                   ot._core.hooks_backend))

        def setup():
            """A context (offload) and the manager's state before the
            step: a fresh warmup or past it."""
            ctx = ot.offload_activations(min_offload_size=64)
            if kind == "megatron" and phase == "warmup":
                _megatron_fresh()
            if phase == "steady":
                for i in range(2):
                    if kind == "offload":
                        offload_step(ctx, chk.model, BATCHES[i])
                    else:
                        megatron_step(chk.model, BATCHES[i])
            return ctx

        def injected(ctx):
            if kind == "offload":
                return lambda: offload_step(ctx, chk.model, BATCHES[2])
            return lambda: megatron_step(chk.model, BATCHES[2])

        ctx = setup()
        tally.events = sweep.count(injected(ctx))
        problem = chk.after(ctx, False)
        del ctx
        self.assertIsNone(problem, "the clean run: %s" % problem)
        for k in sweep.points(tally.events, CI_POINTS):
            ctx = setup()
            _, where, err = sweep.run_traced(injected(ctx), k, exc)
            problem = chk.after(ctx, kind == "megatron" and err is not None)
            del ctx
            if problem and where and where.endswith("__del__"):
                # a finalizer: Python reports the raise as unraisable and
                # drops the rest of it (as for a real signal there)
                tally.finalizer.append((k, where, problem))
                problem = None
            tally.add(k, where, problem)
            if problem or tally.finalizer and tally.finalizer[-1][0] == k:
                _isolate()
        self.tallies.append(tally)
        tally.report()
        return tally

    def check(self, tallies):
        bad = ["%s: event %d at %s: %s" % (t.name, k, w, p) for t in tallies for k, w, p in t.bad]
        self.assertEqual(bad, [], "%d injection points left the process unusable:\n%s"
                         % (len(bad), "\n".join(bad[:20])))

    def test_offload_activations_step(self):
        self.check([self.sweep("offload", phase, exc)
                    for phase in ("warmup", "steady")
                    for exc in (KeyboardInterrupt, sweep.Injection)])

    def test_megatron_markers_step(self):
        self.check([self.sweep("megatron", phase, exc)
                    for phase in ("warmup", "steady")
                    for exc in (KeyboardInterrupt, sweep.Injection)])


if __name__ == "__main__":
    unittest.main(verbosity=2)
