"""Real Megatron-Core with ofl's keep, offload or recompute (issue 42): its
GPTModel built with recompute_granularity="selective" and recompute_modules
["core_attn", "mlp", "layernorm"], wrapped by
ofl.torch.megatron.apply_recompute_modules, trained by Megatron's own
schedule on the CPU under the auto plan with a target only recompute
meets; losses and gradients bitwise equal to Megatron without offload or
recompute. The CPU setup (and its three patches) is test_client_megatron's.
Exits 77 without megatron-core or torch."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OFL_LINK_D2H_GBPS", "0.002")  # copies that cannot hide
os.environ.setdefault("OFL_LINK_H2D_GBPS", "0.002")
import test_client_megatron as M  # noqa: E402  (exits 77 without megatron-core)

import torch  # noqa: E402
from ofl.torch import megatron as om  # noqa: E402

setUpModule = M.setUpModule
tearDownModule = M.tearDownModule
RC = ["core_attn", "mlp", "layernorm"]


def make_model(recompute):
    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
              hidden_dropout=0.0, attention_dropout=0.0, min_offloaded_tensor_size=1024)
    if recompute:
        kw.update(recompute_granularity="selective", recompute_modules=list(RC),
                  fine_grained_activation_offloading=True,
                  offload_modules=["qkv_linear"])
    cfg = M.TransformerConfig(**kw)
    torch.manual_seed(0)
    model = M.GPTModel(config=cfg, transformer_layer_spec=M.get_gpt_layer_local_spec(),
                       vocab_size=M.VOCAB, max_sequence_length=M.S)
    if recompute:
        wrapped = om.apply_recompute_modules(model, cfg)
        assert wrapped == {"core_attn": 2, "mlp": 2, "layernorm": 4}, wrapped
    return model


class MegatronRecompute(unittest.TestCase):
    def test_selective_recompute_modules_bitwise(self):
        om.PipelineOffloadManager.destroy_instance()
        steps = M.data()
        ref = M.train(make_model(False), steps)
        mgr = om.PipelineOffloadManager.get_instance(offload_modules="auto", memory_target=1,
                                                     recompute_modules=RC, summary=False)
        mgr._core.min_elems = 1024
        got = M.train(make_model(True), steps)
        for la, lb in zip(ref[0], got[0]):
            for a, b in zip(la, lb):
                self.assertTrue(torch.equal(a, b), "losses differ: %r vs %r" % (a, b))
        for ga, gb in zip(ref[1], got[1]):
            for n in ga:
                self.assertTrue(torch.equal(ga[n], gb[n]), "gradient of %s differs" % n)
        acts = mgr.stats()["plan"]["actions"]
        print({n: (a["action"], a["recomputable"], a["why_not_recomputable"])
               for n, a in acts.items()})
        for n in RC:
            self.assertTrue(acts[n]["recomputable"], acts[n])
        self.assertFalse(acts["qkv_linear"]["recomputable"])
        self.assertIn("recompute_modules", acts["qkv_linear"]["why_not_recomputable"])
        om.PipelineOffloadManager.destroy_instance()


if __name__ == "__main__":
    unittest.main(verbosity=2)
