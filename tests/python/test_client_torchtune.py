"""Real torchtune against ofl.torch: torchtune from PyPI (with a torchao it
imports with; exit 77 when torchtune is not importable), on the CPU.

* torchtune's own tests of activation offloading
  (tests/torchtune/training/test_activation_offloading.py), ported to the
  CPU with ofl.torch.torchtune.OffloadActivations in place of
  torchtune.training.OffloadActivations: "cuda" is "cpu" and
  torch.cuda._sleep (queued GPU work, to catch an early free) is left out.
  The first test's tensors are under min_offload_size (80 bytes): a copy
  with min_offload_size=0 checks that ofl really moved them.
* A tiny llama3_2 (tied output, torchtune's TiedLinear) and qwen2 (untied)
  built from torchtune's component builders, trained a few steps under
  get_act_offloading_ctx_manager(model, True) as torchtune's recipes call
  it: losses and gradients bitwise equal to no hooks; the output head is
  exempt (nothing is offloaded while it runs) and the rest is offloaded."""
import gc
import os
import sys
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
from torch import nn  # noqa: E402

warnings.filterwarnings("ignore")
try:
    import torchtune  # noqa: F401
    from torchtune.models.llama3_2._component_builders import llama3_2
    from torchtune.models.qwen2._component_builders import qwen2
    from torchtune.modules import TiedLinear
    import torchtune.training as tt_training
except Exception as e:  # pragma: no cover
    print("SKIP: torchtune is not importable (%s); pip install torchtune torchao" % e)
    sys.exit(77)

import ofl.torch.torchtune as ott  # noqa: E402
from ofl.torch.torchtune import OffloadActivations, get_act_offloading_ctx_manager  # noqa: E402

from ofl.torch.offload import release_managers  # noqa: E402

torch.set_num_threads(1)


class Fresh(unittest.TestCase):
    """Each test starts with no idle manager: contexts made with the same
    settings share a dropped one's manager (and its statistics and warmup)."""

    def setUp(self):
        gc.collect()
        release_managers()


# ---- torchtune's tests/torchtune/training/test_activation_offloading.py, on the CPU


class TorchtuneOwnTests(Fresh):
    def _same_as_without(self, use_streams, **kw):
        with torch.device("cpu"):
            torch.manual_seed(2024)
            model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10),
                                  nn.ReLU())
            torch.manual_seed(2024)
            model_c = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10),
                                    nn.ReLU())
        inp = torch.randn((2, 10), device="cpu")
        loss = model(inp).sum()
        loss.backward()
        ctx = OffloadActivations(use_streams=use_streams, **kw)
        with ctx:
            loss_c = model_c(inp).sum()
        loss_c.backward()
        for param, param_c in zip(model.parameters(), model_c.parameters()):
            self.assertTrue(torch.equal(param.grad, param_c.grad))
        return ctx

    def test_offloading_is_same_as_without(self):
        for use_streams in (True, False):
            with self.subTest(use_streams=use_streams):
                self._same_as_without(use_streams)

    def test_offloading_is_same_as_without_all_offloaded(self):
        for use_streams in (True, False):
            with self.subTest(use_streams=use_streams):
                ctx = self._same_as_without(use_streams, min_offload_size=0)
                self.assertGreater(ctx.stats()["offloaded_bytes"], 0)

    def test_offloading_works_with_view_outputs(self):
        class BwdReturnsViewOfActivation(torch.autograd.Function):
            @staticmethod
            def forward(ctx, cloned_activation):
                cloned_activation = cloned_activation.t()
                ctx.save_for_backward(cloned_activation)
                return torch.rand(2, 4, device="cpu")

            @staticmethod
            def backward(ctx, dy):
                unpacked_activation = ctx.saved_tensors[0]
                return unpacked_activation.t()

        class NoOp(torch.autograd.Function):
            @staticmethod
            def forward(ctx, cloned_activation):
                ctx.save_for_backward(cloned_activation)
                return cloned_activation.clone()

            @staticmethod
            def backward(ctx, viewed_activation):
                ctx.saved_tensors[0]
                return viewed_activation

        class ComputeNode(torch.autograd.Function):
            @staticmethod
            def forward(ctx, activation):
                return activation.clone()

            @staticmethod
            def backward(ctx, viewed_activation):
                return viewed_activation == 1  # torch.cuda._sleep left out (CPU)

        class InspectEarlierActivation(torch.autograd.Function):
            @staticmethod
            def forward(ctx, activation):
                ctx.save_for_backward(torch.ones_like(activation) * 5)
                return activation

            @staticmethod
            def backward(ctx, viewed_activation_all_1):
                corrupter = ctx.saved_tensors[0]
                assert torch.all(viewed_activation_all_1)  # the 1s, not the 5s
                return corrupter

        def fwd(t):
            a = InspectEarlierActivation.apply(t)
            b = ComputeNode.apply(a)
            c = NoOp.apply(b)
            d = BwdReturnsViewOfActivation.apply(c)
            return d.sum()

        tensor_c = torch.ones(256, 1024, device="cpu", requires_grad=True)
        ctx = OffloadActivations(use_streams=True)
        with ctx:
            loss_c = fwd(tensor_c)
        ctx.fwd_stash = {}  # as the original (torchtune's attribute; nothing in ofl)
        loss_c.backward()
        self.assertGreater(ctx.stats()["offloaded_bytes"], 0)


# ---- tiny torchtune models


def tiny_llama3_2():
    return llama3_2(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                    max_seq_len=64, intermediate_dim=128, tie_word_embeddings=True)


def tiny_qwen2():
    return qwen2(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                 intermediate_dim=128, max_seq_len=64, tie_word_embeddings=False)


def train(build, ctx_of, steps=3, mbs=2):
    torch.manual_seed(0)
    model = build()
    ctx = ctx_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(mbs):
            tok = torch.randint(0, 256, (2, 32), generator=g)
            lab = torch.randint(0, 256, (2, 32), generator=g)
            with ctx:  # the recipes' `with self.activations_handling_ctx:`
                logits = model(tok)
            loss = nn.functional.cross_entropy(logits.view(-1, 256), lab.view(-1))
            (loss / mbs).backward()
            losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return model, ctx, losses, grads


class TinyModels(Fresh):
    def check(self, build, tied):
        _, _, l0, g0 = train(build, lambda m: get_act_offloading_ctx_manager(m, False))
        head_counts = []

        def ctx_of(model):
            ctx = get_act_offloading_ctx_manager(model, True)
            head = model.output.linear if tied else model.output
            self.assertIsInstance(model.output, TiedLinear if tied else nn.Linear)
            self.assertIs(ctx._head, head)

            # offloads counted while the head runs
            def pre(m, a):
                head_counts.append(-ctx.stats()["offloaded_tensors"])

            def post(m, a, o):
                head_counts[-1] += ctx.stats()["offloaded_tensors"]
            head.register_forward_pre_hook(pre)
            head.register_forward_hook(post)
            return ctx

        _, ctx, l1, g1 = train(build, ctx_of)
        for a, b in zip(l0, l1):
            self.assertTrue(torch.equal(a, b), "losses differ: %r vs %r" % (a, b))
        for ga, gb in zip(g0, g1):
            for n in ga:
                self.assertTrue(torch.equal(ga[n], gb[n]), "gradient of %s differs" % n)
        st = ctx.stats()
        self.assertGreater(st["offloaded_bytes"], 0)
        self.assertEqual(st["reloaded_bytes"], st["offloaded_bytes"])
        self.assertEqual(head_counts, [0] * len(head_counts))
        self.assertEqual(len(head_counts), 6)

        # without the model's head rule the head's input is offloaded
        head_counts.clear()

        def ctx_plain(model):
            ctx = ott.OffloadActivations()
            head = model.output.linear if tied else model.output
            head.register_forward_pre_hook(
                lambda m, a: head_counts.append(-ctx.stats()["offloaded_tensors"]))
            head.register_forward_hook(
                lambda m, a, o: head_counts.__setitem__(
                    -1, head_counts[-1] + ctx.stats()["offloaded_tensors"]))
            return ctx
        gc.collect()
        release_managers()
        train(build, ctx_plain, steps=1, mbs=1)
        self.assertGreater(head_counts[0], 0)

    def test_llama3_2_tied_output(self):
        self.check(tiny_llama3_2, True)

    def test_qwen2_untied_output(self):
        self.check(tiny_qwen2, False)

    def test_disabled_is_a_null_context_and_names_match(self):
        import contextlib
        self.assertIsInstance(get_act_offloading_ctx_manager(nn.Linear(2, 2), False),
                              contextlib.nullcontext)
        for n in ("OffloadActivations", "NoOpManager", "get_act_offloading_ctx_manager"):
            self.assertTrue(hasattr(tt_training, n) and hasattr(ott, n), n)
        import inspect
        self.assertEqual(list(inspect.signature(tt_training.OffloadActivations).parameters),
                         list(inspect.signature(OffloadActivations).parameters)[:4])
        self.assertEqual(list(inspect.signature(tt_training.get_act_offloading_ctx_manager)
                              .parameters),
                         list(inspect.signature(get_act_offloading_ctx_manager).parameters))

    def test_noop_manager_keeps_a_region(self):
        torch.manual_seed(0)
        lin = nn.Linear(64, 64)
        x = torch.randn(32, 64, requires_grad=True)
        ctx = OffloadActivations(min_offload_size=0)
        with ctx:
            with ott.NoOpManager():
                y = lin(x).relu()
            n = ctx.stats()["offloaded_tensors"]
            z = (y * 2).sin()
        self.assertEqual(n, 0)
        z.sum().backward()
        self.assertGreater(ctx.stats()["offloaded_tensors"], 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
