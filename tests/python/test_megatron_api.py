"""Megatron-Core's fine-grained offloading calls, as the main branch and the
0.16.1 wheel make them, against ofl.torch.megatron (host backend, CPU).

The layers here are written like Megatron's own: MainStyleLayer like main's
transformer/attention.py and transformer_layer.py (``with off_interface(flag,
x, name) as x`` then ``manager.group_offload(y, forced_released_tensors=...,
delay_offload=...)``, keyword init_chunk_handler with pp_rank and the knobs,
mark_not_offload, reset(process_group=...), forward_record() and
backward_record(t) without an event, cuda_graph_stream/event,
enter_replay/exit_replay around a replay that delays offloads), R016Layer
like 0.16.1's (group_commit, mark_not_offloadable, positional
init_chunk_handler, the module-level fine_grained_offloading_* names).
Losses and gradients are bitwise equal to the same layers without
offloading, and the manager moved the bytes. When megatron-core is
installed, ofl's interface is also checked against its names and
signatures."""
import inspect
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import ofl.torch.megatron as fgao  # noqa: E402
from ofl.torch.megatron import (  # noqa: E402
    FineGrainedActivationOffloadingInterface as off_interface, PipelineOffloadManager)

torch.set_num_threads(1)
H, S, B, L = 64, 16, 2, 3
MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "moe_act")


class MainStyleLayer(torch.nn.Module):
    """A transformer layer calling the offloading API as Megatron-Core main
    does (transformer_layer.py, attention.py, moe/experts.py)."""

    def __init__(self, offload, delay_until_graph=False):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(H)
        self.qkv = torch.nn.Linear(H, 3 * H)
        self.proj = torch.nn.Linear(H, H)
        self.ln2 = torch.nn.LayerNorm(H)
        self.fc1 = torch.nn.Linear(H, 4 * H)
        self.fc2 = torch.nn.Linear(4 * H, H)
        self.offload = offload
        self.delay = delay_until_graph
        self.off_interface = off_interface  # _get_offloading_interface()

    def forward(self, x):
        on = self.offload and self.training
        residual = x
        attn_norm_manager = self.off_interface(on, x, "attn_norm")
        with attn_norm_manager as x:
            h = self.ln1(x)
        qkv_manager = off_interface(on, h, "qkv_linear")
        with qkv_manager as h:
            q, k, v = self.qkv(h).chunk(3, dim=-1)
        q, k, v = qkv_manager.group_offload((q, k, v), forced_released_tensors=[])
        core_manager = off_interface(on, q, "core_attn")
        with core_manager as q:
            a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                               is_causal=True).squeeze(1)
        a = core_manager.group_offload(a, forced_released_tensors=[q, k, v])
        proj_manager = off_interface(on, a, "attn_proj")
        with proj_manager as a:
            out = self.proj(a)
        out = proj_manager.group_offload(out, forced_released_tensors=[a])
        x = residual + out
        x = attn_norm_manager.group_offload(x, forced_released_tensors=[residual])
        residual = x
        mlp_norm_manager = self.off_interface(on, x, "mlp_norm")
        with mlp_norm_manager as x:
            h = self.ln2(x)
        h = self.fc1(h)
        act_manager = off_interface(on, h, "moe_act")
        with act_manager as h:
            h = F.gelu(h)
        # experts.py: delay_offload=config.delay_offload_until_cuda_graph
        h = act_manager.group_offload(h, forced_released_tensors=[], delay_offload=self.delay)
        x = residual + self.fc2(h)
        return mlp_norm_manager.group_offload(x, forced_released_tensors=[residual])


class R016Layer(MainStyleLayer):
    """The same layer calling the API as Megatron-Core 0.16.1 does."""

    def forward(self, x):
        on = self.offload and self.training
        residual = x
        with off_interface(on, x, "attn_norm") as x:
            h = self.ln1(x)
        with off_interface(on, h, "qkv_linear") as h:
            qkv = self.qkv(h).chunk(3, dim=-1)
        if on:
            qkv = off_interface.group_commit(qkv, name="qkv_linear", forced_released_tensors=[])
        q, k, v = qkv
        with off_interface(on, q, "core_attn") as q:
            a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                               is_causal=True).squeeze(1)
        if on:
            a = fgao.fine_grained_offloading_group_commit(a, name="core_attn",
                                                          forced_released_tensors=[q, k, v])
        with off_interface(on, a, "attn_proj") as a:
            out = self.proj(a)
        if on:
            out = off_interface.group_commit(out, name="attn_proj", forced_released_tensors=[a])
        x = residual + out
        if on:
            x = off_interface.group_commit(x, name="attn_norm", forced_released_tensors=[residual])
        residual = x
        with off_interface(on, x, "mlp_norm") as x:
            h = self.ln2(x)
        h = self.fc1(h)
        with off_interface(on, h, "moe_act") as h:
            h = F.gelu(h)
        if on:
            # 0.16.1: delay_offload queues the offload until the flush, always
            h = off_interface.group_commit(h, name="moe_act", delay_offload=self.delay)
        x = residual + self.fc2(h)
        if on:
            x = off_interface.group_commit(x, name="mlp_norm", forced_released_tensors=[residual])
        return x


class Model(torch.nn.Module):
    def __init__(self, layer_cls, offload, main, delay=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, H)
        self.layers = torch.nn.ModuleList(layer_cls(offload, delay) for _ in range(L))
        self.head = torch.nn.Linear(H, 50)
        self.offload, self.main = offload, main
        self.disable_param_offloading = True

    def forward(self, tok, tgt):
        if self.offload:  # GPTModel.preprocess_for_fine_grained_offloading
            if self.main:
                off_interface.init_chunk_handler(
                    pp_rank=0, vp_size=None, vp_stage=None, min_offloaded_tensor_size=256,
                    delta_offload_bytes_across_pp_ranks=0, activation_offload_fraction=1.0,
                    max_inflight_offloads=None)
            else:
                off_interface.init_chunk_handler(None, None, 256)
            if self.disable_param_offloading:
                mark = off_interface.mark_not_offload if self.main else \
                    off_interface.mark_not_offloadable
                for p in self.layers.parameters():
                    mark(p)
                self.disable_param_offloading = False
        x = self.emb(tok)
        for i, layer in enumerate(self.layers):
            if self.offload and self.main and layer.delay:
                # transformer_layer.py: a graph replay, delayed offloads
                # flushed after it; backward_record/forward_record around it
                x = off_interface.backward_record(x)
                off_interface.enter_replay()
                try:
                    x = layer(x)
                finally:
                    off_interface.exit_replay()
                off_interface.flush_delayed_groups()
                off_interface.forward_record()
            else:
                x = layer(x)
                if self.offload and not self.main and layer.delay:
                    fgao.fine_grained_offloading_group_flush_delayed_groups()
        return F.cross_entropy(self.head(x).view(-1, 50), tgt.view(-1))


def batches(steps, mbs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 50, (B, S), generator=g), torch.randint(0, 50, (B, S), generator=g))
             for _ in range(mbs)] for _ in range(steps)]


def run(model, data, reset):
    """Steps of microbatches (forward, backward each), an SGD update per
    step; the losses and the gradients of every step."""
    losses, grads = [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in data:
        opt.zero_grad()
        ls = []
        for tok, tgt in step:
            loss = model(tok, tgt)
            (loss / len(step)).backward()
            ls.append(loss.detach().clone())
        if model.offload:
            reset()
        losses.append(ls)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads


class MegatronCalls(unittest.TestCase):
    def setUp(self):
        PipelineOffloadManager.reset_instance()

    def tearDown(self):
        PipelineOffloadManager.destroy_instance()

    def assert_same(self, a, b):
        for la, lb in zip(a[0], b[0]):
            for x, y in zip(la, lb):
                self.assertTrue(torch.equal(x, y), "losses differ: %r vs %r" % (x, y))
        for ga, gb in zip(a[1], b[1]):
            for n in ga:
                self.assertTrue(torch.equal(ga[n], gb[n]), "gradient of %s differs" % n)

    def check(self, layer_cls, main, delay, reset):
        data = batches(3, 2)
        ref = run(Model(layer_cls, False, main, delay), data, reset)
        got = run(Model(layer_cls, True, main, delay), data, reset)
        self.assert_same(ref, got)
        mgr = PipelineOffloadManager.get_instance()
        st = mgr.stats()
        self.assertEqual(st["iterations"], 3)
        self.assertGreater(st["offloaded_bytes"], 0)
        self.assertEqual(st["reloaded_bytes"], st["offloaded_bytes"])
        self.assertEqual(sorted(mgr.group_stats()), sorted(MODULES))
        self.assertEqual(sorted(mgr.summary_rows[0]), sorted(MODULES))
        return mgr

    def test_main_call_sequence_bitwise_equal(self):
        import torch.distributed as dist
        group = dist.group.WORLD if dist.is_initialized() else None
        self.check(MainStyleLayer, True, False, lambda: off_interface.reset(process_group=group))

    def test_main_graph_replay_delays_and_flushes(self):
        """delay_offload through group_offload waits for the flush only in a
        replay (main); the flush after the replay sends it."""
        self.check(MainStyleLayer, True, True, lambda: off_interface.reset(process_group=None))

    def test_r016_call_sequence_bitwise_equal(self):
        self.check(R016Layer, False, True, off_interface.reset)

    def test_delay_outside_replay_is_immediate_on_main_only(self):
        """main's group_offload(delay_offload=True) outside a replay commits
        at once (nothing waits for a flush); 0.16.1's group_commit queues."""
        off_interface.init_chunk_handler(pp_rank=0, vp_size=1, vp_stage=0,
                                         min_offloaded_tensor_size=1,
                                         delta_offload_bytes_across_pp_ranks=0,
                                         activation_offload_fraction=1.0)
        core = PipelineOffloadManager.get_instance()._core
        x = torch.randn(64, 64, requires_grad=True)
        m = off_interface(True, x, "g")
        with m as h:
            y = h.sin()
        y = m.group_offload(y, delay_offload=True)
        self.assertEqual(core.delayed, [])
        with off_interface(True, y, "g2") as h:
            z = h.cos()
        z = off_interface.group_commit(z, "g2", delay_offload=True)
        self.assertEqual(len(core.delayed), 1)
        off_interface.flush_delayed_groups()
        self.assertEqual(core.delayed, [])
        z.sum().backward()
        off_interface.reset()

    def test_offload_off_passes_through(self):
        x = torch.randn(4, requires_grad=True)
        m = off_interface(False, x, "g")
        with m as h:
            self.assertIs(h, x)
        self.assertIs(m.group_offload(x), x)

    def test_main_knobs_reach_a_fresh_manager(self):
        off_interface.init_chunk_handler(
            pp_rank=2, vp_size=None, vp_stage=None, min_offloaded_tensor_size=16,
            delta_offload_bytes_across_pp_ranks=4096, activation_offload_fraction=0.5,
            max_inflight_offloads=3)
        mgr = PipelineOffloadManager.get_instance()
        self.assertEqual((mgr._knobs["pp_rank"], mgr._knobs["rank_delta_bytes"],
                          mgr._knobs["fraction"], mgr._knobs["max_inflight"]), (2, 4096, 0.5, 3))
        self.assertEqual(mgr._core.min_elems, 16)
        # a change during the warmup is refused; the same values are not
        off_interface.init_chunk_handler(
            pp_rank=2, vp_size=None, vp_stage=None, min_offloaded_tensor_size=16,
            delta_offload_bytes_across_pp_ranks=4096, activation_offload_fraction=0.5,
            max_inflight_offloads=3)
        with self.assertRaisesRegex(ValueError, "fraction 0.5 -> 0.25"):
            off_interface.init_chunk_handler(
                pp_rank=2, vp_size=None, vp_stage=None, min_offloaded_tensor_size=16,
                delta_offload_bytes_across_pp_ranks=4096, activation_offload_fraction=0.25)
        # Megatron's 0 (wait at each commit) is ofl's 1; None is unlimited
        m2 = PipelineOffloadManager.reset_instance()
        off_interface.init_chunk_handler(0, 1, 0, 16, 0, 1.0, 0)
        self.assertEqual(m2._knobs["max_inflight"], 1)
        # knobs given to the constructor win over Megatron's config
        m3 = PipelineOffloadManager.reset_instance(fraction=0.75)
        off_interface.init_chunk_handler(pp_rank=0, vp_size=1, vp_stage=0,
                                         min_offloaded_tensor_size=16,
                                         delta_offload_bytes_across_pp_ranks=0,
                                         activation_offload_fraction=1.0)
        self.assertEqual(m3._knobs["fraction"], 0.75)

    def test_chunk_handler_argument_errors(self):
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'pp_rnk'"):
            off_interface.init_chunk_handler(pp_rnk=0, vp_size=1, vp_stage=0)
        with self.assertRaisesRegex(TypeError, "multiple values"):
            off_interface.init_chunk_handler(1, 0, 16, vp_size=1)

    def test_cuda_graph_helpers_on_the_host_backend(self):
        self.assertIsNone(off_interface.cuda_graph_stream())
        self.assertIsNone(off_interface.cuda_graph_event())
        t = torch.ones(2, requires_grad=True)
        self.assertIs(off_interface.backward_record(t), t)
        self.assertIsNone(off_interface.forward_record())
        self.assertIs(fgao.fine_grained_offloading_backward_record(t, None), t)
        self.assertIsNone(fgao.fine_grained_offloading_forward_record(None))
        off_interface.enter_replay()
        self.assertTrue(PipelineOffloadManager.get_instance()._in_replay)
        off_interface.exit_replay()
        self.assertFalse(PipelineOffloadManager.get_instance()._in_replay)

    def test_mark_not_offload_sets_both_flags(self):
        p = torch.nn.Parameter(torch.ones(3))
        off_interface.mark_not_offload(p)
        self.assertTrue(p._ofl_not_offloadable and p._do_not_offload)
        PipelineOffloadManager.get_instance().mark_not_offload(torch.ones(1))
        with self.assertRaises(TypeError):
            off_interface.mark_not_offload("p")


# Main's interface (megatron/core/pipeline_parallel/
# fine_grained_activation_offload.py): static helpers and their parameters.
MAIN_STATIC = {
    "cuda_graph_stream": [], "cuda_graph_event": [],
    "init_chunk_handler": ["pp_rank", "vp_size", "vp_stage", "min_offloaded_tensor_size",
                           "delta_offload_bytes_across_pp_ranks",
                           "activation_offload_fraction", "max_inflight_offloads"],
    "get_context": ["flag"], "mark_not_offload": ["tensor"], "forward_record": [],
    "backward_record": ["tensor"], "reset": ["process_group"], "reset_instance": [],
    "flush_delayed_groups": [], "disable_offload": [], "enable_offload": [],
    "enter_replay": [], "exit_replay": [],
}
MAIN_MODULE = ["fine_grained_offloading_disable_offload", "fine_grained_offloading_enable_offload",
               "fine_grained_offloading_group_offload",
               "fine_grained_offloading_group_flush_delayed_groups",
               "fine_grained_offloading_group_start", "PipelineOffloadManager",
               "FineGrainedActivationOffloadingInterface"]


class Names(unittest.TestCase):
    def test_main_names(self):
        for n in MAIN_MODULE:
            self.assertTrue(hasattr(fgao, n), n)
        for n in MAIN_STATIC:
            self.assertTrue(callable(getattr(off_interface, n)), n)
        self.assertIn("group_offload", vars(off_interface))
        for n in ("d2h_stream", "h2d_stream", "cuda_graph_stream", "cuda_graph_event",
                  "offload_summary_bytes", "offload_summary_total_bytes", "do_offload"):
            self.assertTrue(hasattr(PipelineOffloadManager, n), n)

    def test_installed_megatron_names_and_signatures(self):
        """Every public name of the installed megatron-core's module (its
        interface's helpers too) exists in ofl and takes its calls."""
        try:
            import importlib
            real = importlib.import_module(
                "megatron.core.pipeline_parallel.fine_grained_activation_offload")
        except Exception as e:
            self.skipTest("megatron-core not importable (%s)" % e)
        if real is fgao:
            self.skipTest("megatron's module is ofl's in this process")
        ri = real.FineGrainedActivationOffloadingInterface
        for n, fn in vars(ri).items():
            if n.startswith("_"):
                continue
            self.assertTrue(hasattr(off_interface, n), "interface lacks %s" % n)
            sig = inspect.signature(getattr(ri, n))
            params = [p for p in sig.parameters.values() if p.name != "self"]
            kw = {p.name: None for p in params if p.default is inspect.Parameter.empty}
            mine = inspect.signature(getattr(off_interface, n))
            has_var = any(p.kind == p.VAR_KEYWORD for p in mine.parameters.values())
            for p in params:
                self.assertTrue(has_var or p.name in mine.parameters,
                                "%s: ofl lacks parameter %s" % (n, p.name))
            del kw
        for n in dir(real):
            if n.startswith("fine_grained_offloading_"):
                self.assertTrue(hasattr(fgao, n), "ofl.torch.megatron lacks %s" % n)


if __name__ == "__main__":
    unittest.main(verbosity=2)
