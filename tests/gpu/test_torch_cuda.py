"""ofl.torch on a GPU (the cuda backend under torch): exits 77 (skip) without
torch built with CUDA or without a visible GPU. Run by the 'gpu' suite and by
tools/gpu_session.sh on a lent GPU machine.

1. A small GPT trained a few steps through offload_activations and through
   the Megatron-named markers, compute on the default stream and on a side
   stream: losses and gradients bitwise equal to the same steps without
   offload, bytes really moved.
2. Peak memory: torch.cuda.max_memory_allocated of a step with offload is
   lower than without.
3. AsyncStager on a state dict written on a side stream just before stage():
   every staged byte equals the side stream's result.
4. A forward with forward_record captured in torch.cuda.graph and replayed:
   the capture stays valid and the replay's output equals eager.
"""
import os
import sys
import unittest

try:
    import torch
except Exception as e:  # pragma: no cover
    print("SKIP: torch is not importable (%s)" % e)
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIP: torch sees no CUDA device (built with CUDA: %s)" % (torch.version.cuda,))
    sys.exit(77)

os.environ["OFL_BACKEND"] = "cuda"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch.nn.functional as F  # noqa: E402
import ofl.torch as ot  # noqa: E402
from model import TinyTransformer, make_data, one_f_one_b  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.use_deterministic_algorithms(True, warn_only=True)


def grads(m):
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def model_and_data(seed=0):
    torch.manual_seed(seed)
    m = TinyTransformer(vocab=256, d=128, heads=4, ff=512, layers=2, seq=128).to(DEV)
    data = [[(t.to(DEV), y.to(DEV)) for t, y in mbs]
            for mbs in make_data(steps=3, microbatches=2, batch=4, seq=128, vocab=256)]
    return m, data


def run(loop, stream=None):
    m, data = model_and_data()
    losses = []
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(
        torch.cuda.current_stream())
    with ctx:
        for mbs in data:
            m.zero_grad(set_to_none=True)
            losses += loop(m, mbs)
    torch.cuda.synchronize()
    return losses, grads(m)


def plain(m, mbs):
    out = []
    for tok, tgt in mbs:
        loss = m(tok, tgt)
        (loss / len(mbs)).backward()
        out.append(loss.detach())
    return out


class Training(unittest.TestCase):
    def check_same(self, a, b):
        for x, y in zip(a[0], b[0]):
            self.assertTrue(torch.equal(x, y))
        self.assertEqual(set(a[1]), set(b[1]))
        for n in a[1]:
            self.assertTrue(torch.equal(a[1][n], b[1][n]), n)

    def test_offload_activations_default_and_side_stream(self):
        for stream in (None, torch.cuda.Stream()):
            base = run(plain, stream)
            ctx = ot.offload_activations(min_offload_size=1024)

            def offl(m, mbs):
                out = []
                for tok, tgt in mbs:
                    with ctx:
                        loss = m(tok, tgt)
                    (loss / len(mbs)).backward()
                    out.append(loss.detach())
                return out

            got = run(offl, stream)
            self.check_same(base, got)
            self.assertGreater(ctx.stats()["offloaded_bytes"], 0)
            self.assertGreater(ctx.stats()["reloaded_bytes"], 0)
            ctx.close()

    def test_megatron_markers_default_and_side_stream(self):
        for stream in (None, torch.cuda.Stream()):
            base = run(plain, stream)
            mgr = ot.PipelineOffloadManager.reset_instance(summary=False)
            got = run(lambda m, mbs: one_f_one_b(m, mbs, offload=True, min_size=1024), stream)
            self.check_same(base, got)
            self.assertGreater(mgr.stats()["offloaded_bytes"], 0)
            ot.PipelineOffloadManager.destroy_instance()

    def test_peak_memory_lower(self):
        m, data = model_and_data()
        tok, tgt = data[0][0]

        def peak(ctx):
            m.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if ctx is None:
                loss = m(tok, tgt)
            else:
                with ctx:
                    loss = m(tok, tgt)
            loss.backward()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()

        ctx = ot.offload_activations(min_offload_size=1024)
        for _ in range(3):
            peak(ctx)  # past the warmup
        without, with_ = peak(None), peak(ctx)
        print("# max_memory_allocated: %d without offload, %d with" % (without, with_))
        self.assertLess(with_, without)
        ctx.close()


class Staging(unittest.TestCase):
    def test_stager_after_a_side_stream_write(self):
        side = torch.cuda.Stream()
        sd = {"w%d" % i: torch.zeros(1 << 20, device=DEV) for i in range(8)}
        stager = ot.AsyncStager()
        for rnd in range(3):
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)  # the write lands late
                for i, t in enumerate(sd.values()):
                    t.fill_(rnd * 10 + i)
            torch.cuda.current_stream().wait_stream(side)
            staged = stager.stage(sd)
            for i, (k, t) in enumerate(sd.items()):
                want = torch.full((1 << 20,), float(rnd * 10 + i))
                self.assertTrue(torch.equal(staged[k], want), (rnd, k))
        stager.close()


class Graphs(unittest.TestCase):
    def test_forward_record_in_a_captured_graph(self):
        ot.PipelineOffloadManager.reset_instance(summary=False)
        try:
            lin = torch.nn.Linear(256, 256).to(DEV)
            x = torch.randn(64, 256, device=DEV)
            ev = torch.cuda.Event()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):  # warm up outside the capture
                    y = F.gelu(lin(x))
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(g):
                try:
                    ot.forward_record(ev)
                except TypeError:
                    ot.forward_record()
                y = F.gelu(lin(x))
            x.copy_(torch.randn(64, 256, device=DEV))
            g.replay()
            torch.cuda.synchronize()
            with torch.no_grad():
                eager = F.gelu(lin(x))
            self.assertTrue(torch.equal(y, eager))
        finally:
            ot.PipelineOffloadManager.destroy_instance()


if __name__ == "__main__":
    unittest.main(verbosity=2)
