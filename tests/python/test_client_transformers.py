"""Real transformers against ofl.torch: transformers from PyPI (exit 77 when
it is not importable), a tiny LlamaForCausalLM made from a LlamaConfig (no
download), on the CPU. Losses and every gradient over a few steps are
bitwise equal to no hooks:

* without gradient checkpointing, under ofl.torch.OffloadActivations(
  model=model) (lm_head kept), Axolotl's get_lora_act_offloading_ctx_manager
  and trl's get_act_offloading_ctx_manager (ofl.torch.axolotl);
* with model.gradient_checkpointing_enable(): torch's checkpoint under the
  same offloading context, and Axolotl's offload_disk path
  (transformers.modeling_utils.checkpoint replaced by
  ofl.torch.axolotl.hf_grad_checkpoint_disk_offload_wrapper before the
  enable call, as Axolotl does): each layer's input on ofl's disk tier."""
import gc
import os
import sys
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402

warnings.filterwarnings("ignore")
try:
    import transformers
    import transformers.modeling_utils
    from transformers import LlamaConfig, LlamaForCausalLM
except Exception as e:  # pragma: no cover
    print("SKIP: transformers is not importable (%s); pip install transformers" % e)
    sys.exit(77)

import ofl.torch as ot  # noqa: E402
import ofl.torch.axolotl as oax  # noqa: E402
from ofl.torch.offload import release_managers  # noqa: E402

torch.set_num_threads(1)
V = 128


def make(gc_on=False):
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    if gc_on:
        model.gradient_checkpointing_enable()
    return model


def train(model, ctx=None, steps=3, mbs=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(mbs):
            tok = torch.randint(0, V, (2, 24), generator=g)
            if ctx is None:
                out = model(input_ids=tok, labels=tok)
            else:
                with ctx:
                    out = model(input_ids=tok, labels=tok)
            (out.loss / mbs).backward()
            losses.append(out.loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return losses, grads


class TinyLlama(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ref = train(make())
        cls.ref_gc = train(make(True))

    def setUp(self):
        gc.collect()
        release_managers()

    def same(self, a, b):
        for x, y in zip(a[0], b[0]):
            self.assertTrue(torch.equal(x, y), "losses differ: %r vs %r" % (x, y))
        for ga, gb in zip(a[1], b[1]):
            self.assertEqual(ga.keys(), gb.keys())
            for n in ga:
                self.assertTrue(torch.equal(ga[n], gb[n]), "gradient of %s differs" % n)

    def test_checkpointing_alone_is_bitwise_equal(self):
        self.same(self.ref, self.ref_gc)

    def offloaded(self, gc_on, ctx_of):
        model = make(gc_on)
        ctx = ctx_of(model)
        self.same(self.ref_gc if gc_on else self.ref, train(model, ctx))
        st = ctx.stats()
        self.assertGreater(st["offloaded_bytes"], 0)
        self.assertEqual(st["reloaded_bytes"], st["offloaded_bytes"])
        return ctx

    def test_offload_activations(self):
        self.offloaded(False, lambda m: ot.OffloadActivations(model=m))

    def test_head_is_lm_head(self):
        m = make()
        self.assertIs(ot.OffloadActivations(model=m)._head, m.lm_head)
        self.assertIs(oax.find_axolotl_head(m), m.lm_head)

    def test_axolotl_lora_ctx_manager(self):
        self.offloaded(False, lambda m: oax.get_lora_act_offloading_ctx_manager(m))

    def test_trl_ctx_manager(self):
        self.offloaded(False, lambda m: oax.get_act_offloading_ctx_manager(m, use_streams=True))

    def test_gradient_checkpointing_with_offload(self):
        self.offloaded(True, lambda m: ot.OffloadActivations(model=m))

    def test_axolotl_offload_disk_path(self):
        saved = transformers.modeling_utils.checkpoint
        transformers.modeling_utils.checkpoint = oax.hf_grad_checkpoint_disk_offload_wrapper
        try:
            model = make(True)
        finally:
            transformers.modeling_utils.checkpoint = saved
        store = oax.Disco.get_instance().store
        before = store.stats()["stored"]
        self.same(self.ref_gc, train(model))
        # one layer input per layer per microbatch went to disk
        self.assertEqual(store.stats()["stored"] - before, 2 * 3 * 2)
        self.assertEqual(len(store.order), 0)


if __name__ == "__main__":
    print("transformers", transformers.__version__)
    unittest.main(verbosity=2)
