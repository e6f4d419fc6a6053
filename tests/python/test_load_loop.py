"""ofl.torch in long training loops under load: the pattern of a crash once
seen inside nn.Linear.forward (a tiny GPT under offload_activations, a
one-rank gloo process group, the machine busy). Each loop trains the same
model with and without offload and compares every step's loss and the final
parameters bitwise, while busy threads run beside it:

* a reused offload_activations context, entered every step;
* a fresh context per step;
* several thresholds (min_offload_size), one of which offloads nothing;
* Megatron-Core's markers with reset() per step.

Under the asan setup (./ofl.sh asan) this runs with libasan preloaded into
Python, libofl and the extension built with AddressSanitizer, and strict
mode's stream jitter: a block handed back while torch still reads it, or a
copy worker racing the training thread, is a report there. Steps per loop:
OFL_TEST_LOAD_STEPS (default 60; ./ofl.sh asan runs 200)."""
import math
import os
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import ofl.torch as ot  # noqa: E402
from ofl.torch.megatron import (  # noqa: E402
    FineGrainedActivationOffloadingInterface as off_interface)

torch.set_num_threads(1)
STEPS = int(os.environ.get("OFL_TEST_LOAD_STEPS", "60"))
VOCAB, D, HEADS, SEQ, LAYERS, BATCH = 64, 64, 4, 64, 2, 2


class Block(nn.Module):
    def __init__(self, markers):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.markers = markers

    def attention(self, h):
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, D))

    def forward(self, x):
        if not self.markers:
            x = x + self.attention(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        # Megatron-Core 0.16.1's calls around its modules
        residual = x
        with off_interface(True, x, "attn_norm") as x:
            h = self.ln1(x)
        with off_interface(True, h, "core_attn") as h:
            a = self.attention(h)
        a = off_interface.group_commit(a, name="core_attn", forced_released_tensors=[])
        x = residual + a
        x = off_interface.group_commit(x, name="attn_norm", forced_released_tensors=[residual])
        residual = x
        with off_interface(True, x, "mlp_norm") as x:
            h = self.fc1(self.ln2(x))
        with off_interface(True, h, "moe_act") as h:
            h = F.gelu(h)
        h = off_interface.group_commit(h, name="moe_act", forced_released_tensors=[])
        x = residual + self.fc2(h)
        return off_interface.group_commit(x, name="mlp_norm", forced_released_tensors=[residual])


class GPT(nn.Module):
    def __init__(self, markers=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.blocks = nn.ModuleList(Block(markers) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.output = nn.Linear(D, VOCAB)
        self.markers = markers

    def forward(self, tok):
        if self.markers:
            off_interface.init_chunk_handler(None, None, 256)
        x = self.emb(tok) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.output(self.ln(x))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(n)]


def train(model, data, ctx_of_step, after_step=None):
    """AdamW steps; ctx_of_step(i) -> the context of step i's forward (None:
    no hooks). The losses and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i, seq in enumerate(data):
        opt.zero_grad(set_to_none=True)
        ctx = ctx_of_step(i)
        if ctx is None:
            logits = model(seq[:, :-1])
        else:
            with ctx:
                logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        loss.backward()
        if after_step is not None:
            after_step()
        opt.step()
        losses.append(loss.detach().clone())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


class Busy:
    """Threads that keep the cores busy (Python and torch work) while the
    loop runs: the load under which the crash was seen."""

    def __init__(self, n=2):
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.spin, daemon=True) for _ in range(n)]

    def spin(self):
        a = torch.randn(96, 96)
        while not self.stop.is_set():
            a = torch.tanh(a @ a.t() / 96)
            sum(math.sqrt(i) for i in range(2000))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


class LoadLoop(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import torch.distributed as dist
        if not dist.is_initialized():
            fd, path = tempfile.mkstemp(prefix="ofl-gloo-")
            os.close(fd)
            os.unlink(path)
            dist.init_process_group("gloo", init_method="file://" + path, rank=0, world_size=1)
        cls.data = batches(STEPS)
        cls.ref_losses, cls.ref_params = train(GPT(), cls.data, lambda i: None)

    def check(self, losses, params, what):
        for i, (a, b) in enumerate(zip(losses, self.ref_losses)):
            self.assertTrue(torch.equal(a, b), "%s: step %d loss %r != %r" % (what, i, a, b))
        for n, p in params.items():
            self.assertTrue(torch.equal(p, self.ref_params[n]), "%s: %s differs" % (what, n))

    def offloaded(self, ctx, what, steps):
        """The loop really offloaded, every tensor came back, and nothing is
        left in use in the pools."""
        s = ctx.stats()
        self.assertGreater(s["offloaded_tensors"], steps, what)
        self.assertEqual(s["reloaded_bytes"], s["offloaded_bytes"], what)
        for pool, p in ctx.pool_stats().items():
            self.assertEqual(p["in_use_bytes"], 0, "%s: %s" % (what, pool))

    def test_reused_context_under_load(self):
        model = GPT()
        ctx = ot.offload_activations(model, min_offload_size=1024, max_fwd_stash_size=5)
        with Busy():
            losses, params = train(model, self.data, lambda i: ctx)
        self.check(losses, params, "reused context")
        self.offloaded(ctx, "reused context", STEPS)

    def test_fresh_context_per_step_under_load(self):
        model = GPT()
        made = []

        def fresh(i):
            made.append(ot.offload_activations(model, min_offload_size=1024, max_fwd_stash_size=5))
            return made[-1]

        with Busy():
            losses, params = train(model, self.data, fresh)
        self.check(losses, params, "fresh context")
        self.offloaded(made[-1], "fresh context", 1)

    def test_thresholds_under_load(self):
        for size in (1, 4096, 1 << 30):
            model = GPT()
            ctx = ot.offload_activations(model, min_offload_size=size, max_fwd_stash_size=5)
            before = ctx.stats()["offloaded_tensors"]  # the manager is process-wide
            with Busy(1):
                losses, params = train(model, self.data[: max(STEPS // 3, 4)], lambda i: ctx)
            ref = train(GPT(), self.data[: max(STEPS // 3, 4)], lambda i: None)
            for a, b in zip(losses, ref[0]):
                self.assertTrue(torch.equal(a, b), "min_offload_size %d" % size)
            for n, p in params.items():
                self.assertTrue(torch.equal(p, ref[1][n]), "min_offload_size %d: %s" % (size, n))
            if size < (1 << 30):
                self.offloaded(ctx, "min_offload_size %d" % size, 4)
            else:
                self.assertEqual(ctx.stats()["offloaded_tensors"], before)

    def test_megatron_markers_with_reset_under_load(self):
        model = GPT(markers=True)
        for p in model.blocks.parameters():
            off_interface.mark_not_offloadable(p)
        with Busy():
            losses, params = train(model, self.data, lambda i: None, after_step=ot.reset)
        self.check(losses, params, "Megatron markers")


if __name__ == "__main__":
    t0 = time.time()
    prog = unittest.main(verbosity=2, exit=False)
    print("load loops: %d steps each, %.1f s" % (STEPS, time.time() - t0))
    sys.exit(0 if prog.result.wasSuccessful() else 1)
