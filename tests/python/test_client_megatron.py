"""Real Megatron-Core against ofl.torch: megatron-core from PyPI (the newest
wheel; exit 77 when it is not importable), its GPTModel built from the local
(non-TransformerEngine) layer spec, world size 1 under gloo, trained with
its own schedule (forward_backward_no_pipelining) on the CPU.

Megatron's offloading module is replaced by ofl.torch.megatron before
Megatron is imported, so Megatron's own layers (attention.py,
transformer_layer.py, gpt_model.py) and schedule call ofl: with
fine_grained_activation_offloading=True and five offload_modules the losses
and every gradient are bitwise equal to offloading off over several steps of
several microbatches, and the manager's statistics show the bytes moved.

Megatron needs CUDA in three places on this CPU path; each is patched here,
nothing else:
  1. schedules.py allocates its token counter with device="cuda": the
     schedules module sees a torch whose zeros() puts "cuda" on the CPU;
  2. the attention's global memory buffer (utils.GlobalMemoryBuffer) is
     allocated on torch.cuda.current_device(): its "mpu" float32 buffer is
     made beforehand on the CPU (baddbmm uses it with beta 0);
  3. the CUDA RNG tracker's fork() around attention dropout (probability 0
     here) switches CUDA RNG states: it is a null context."""
import contextlib
import os
import socket
import sys
import types
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import ofl.torch.megatron as ofl_megatron  # noqa: E402

# Megatron's own layers import the offloading API from here: ofl's.
sys.modules["megatron.core.pipeline_parallel.fine_grained_activation_offload"] = ofl_megatron
warnings.filterwarnings("ignore")
try:
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.transformer.transformer_config import TransformerConfig
except Exception as e:  # pragma: no cover
    print("SKIP: megatron-core is not importable (%s); pip install megatron-core" % e)
    sys.exit(77)

torch.set_num_threads(1)
VOCAB, S, B, MBS, STEPS = 128, 32, 2, 3, 3
MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CpuTorch(types.ModuleType):
    """torch as schedules.py sees it: zeros(device="cuda") on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*a, device=None, **kw):
        return torch.zeros(*a, device="cpu" if device == "cuda" else device, **kw)


def setUpModule():
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % _free_port(), rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    schedules.torch = _CpuTorch("torch")  # 1
    parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)] = \
        torch.empty(1 << 20)  # 2
    tensor_parallel.get_cuda_rng_tracker().fork = \
        lambda *a, **k: contextlib.nullcontext()  # 3


def tearDownModule():
    import torch.distributed as dist
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def make_model(offload):
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0,
                            fine_grained_activation_offloading=offload,
                            offload_modules=list(MODULES) if offload else [],
                            min_offloaded_tensor_size=1024)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=S)


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (B, S), generator=g),
              torch.randint(0, VOCAB, (B, S), generator=g)) for _ in range(MBS)]
            for _ in range(STEPS)]


POS = torch.arange(S).unsqueeze(0).expand(B, S)
MASK = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)


def forward_step(it, model):
    tok, lab = next(it)
    out = model(tok, POS, MASK, labels=lab)

    def loss_func(o):
        loss = o.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def train(model, steps):
    fb = get_forward_backward_func()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for mbs in steps:
        opt.zero_grad()
        res = fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
                 num_microbatches=len(mbs), seq_length=S, micro_batch_size=B,
                 forward_only=False)
        losses.append([r["loss"] for r in res])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads


class MegatronGPT(unittest.TestCase):
    def test_gpt_model_offloaded_by_ofl_bitwise_equal(self):
        import megatron.core.pipeline_parallel.fine_grained_activation_offload as seen
        self.assertIs(seen, ofl_megatron)
        mgr = ofl_megatron.PipelineOffloadManager.reset_instance()
        steps = data()
        ref = train(make_model(False), steps)
        self.assertEqual(mgr.stats()["iterations"], 0)  # offloading off: ofl not called
        got = train(make_model(True), steps)
        for la, lb in zip(ref[0], got[0]):
            for a, b in zip(la, lb):
                self.assertTrue(torch.equal(a, b), "losses differ: %r vs %r" % (a, b))
        for ga, gb in zip(ref[1], got[1]):
            self.assertEqual(ga.keys(), gb.keys())
            for n in ga:
                self.assertTrue(torch.equal(ga[n], gb[n]), "gradient of %s differs" % n)
        st = mgr.stats()
        print("megatron-core %s: %s" % (megatron.core.__version__, st))
        self.assertEqual(st["iterations"], STEPS)  # the schedule's reset() ends each
        self.assertGreater(st["offloaded_bytes"], 0)
        self.assertEqual(st["reloaded_bytes"], st["offloaded_bytes"])
        self.assertEqual(st["unpopped_tensors"], 0)
        self.assertEqual(sorted(mgr.group_stats()), sorted(MODULES))
        for name, g in mgr.group_stats().items():
            self.assertGreater(g["offloaded_bytes"], 0, name)
        self.assertEqual(sorted(mgr.summary_rows[0]), sorted(MODULES))
        self.assertIn("attn_norm", mgr.summary_text)
        ofl_megatron.PipelineOffloadManager.destroy_instance()


if __name__ == "__main__":
    unittest.main(verbosity=2)
