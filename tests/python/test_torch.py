"""ofl.torch tests (host backend, CPU tensors). Run by meson (suite python):
exits 77 (skip) when torch cannot be imported."""
import gc
import os
import sys
import tempfile
import tracemalloc
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import ofl  # noqa: E402
import ofl.torch as ot  # noqa: E402
from model import TinyTransformer, make_data, one_f_one_b, train  # noqa: E402

from ofl.torch import _core as ofl_core  # noqa: E402
torch.set_num_threads(1)
VOCAB, SEQ = 64, 16


class Hooks(unittest.TestCase):
    def test_the_hooks_are_the_extensions(self):
        """The one implementation of the hooks: ofl._ext's."""
        from ofl import _ext
        self.assertEqual(ofl_core.hooks_backend, "c", ofl_core.hooks_backend_reason)
        self.assertTrue(issubclass(ofl_core.ManagerCore, _ext.Hooks))


def fresh_model(seed=0):
    torch.manual_seed(seed)
    return TinyTransformer(vocab=VOCAB, seq=SEQ)


def plain_loop(model, mbs):
    losses = []
    for tok, tgt in mbs:
        loss = model(tok, tgt)
        losses.append(loss.detach().clone())
        (loss / len(mbs)).backward()
    return losses


def assert_same(tc, run_a, run_b):
    la, ga = run_a
    lb, gb = run_b
    for sa, sb in zip(la, lb):
        for a, b in zip(sa, sb):
            tc.assertTrue(torch.equal(a, b), "losses differ: %r vs %r" % (a, b))
    for sa, sb in zip(ga, gb):
        tc.assertEqual(sa.keys(), sb.keys())
        for n in sa:
            tc.assertTrue(torch.equal(sa[n], sb[n]), "gradient of %s differs" % n)


SLACK = 64 * 1024


def check_pools(tc, dev0, dev1, pools0, pools1):
    """Blocks in use return to the same value; the pools may have grown by
    blocks created while others were still in flight (a free block whose
    last copy is queued is skipped: pending_skips), nothing else. How many
    such blocks depends on the timing of the copy thread against the
    training thread (the machine's load; faster hooks): up to about three
    steps' worth on this machine, each of them counted as a skip."""
    for p in ("device_pool", "host_pool"):
        tc.assertEqual(pools0[p]["in_use_bytes"], pools1[p]["in_use_bytes"], p)
        if pools1[p]["total_bytes"] > pools0[p]["total_bytes"] + SLACK:
            new_blocks = pools1[p]["blocks_total"] - pools0[p]["blocks_total"]
            skips = pools1[p]["pending_skips"] - pools0[p]["pending_skips"]
            tc.assertLessEqual(new_blocks, skips,
                               "%s grew by %d blocks, %d of them not for a pending block"
                               % (p, new_blocks, new_blocks - skips))
    # device and pinned memory: by the pools' growth checked above at most
    grew = {p: max(0, pools1[p]["total_bytes"] - pools0[p]["total_bytes"])
            for p in ("device_pool", "host_pool")}
    tc.assertLessEqual(dev1["device_bytes_in_use"],
                       dev0["device_bytes_in_use"] + SLACK + grew["device_pool"])
    tc.assertLessEqual(dev1["pinned_bytes_in_use"],
                       dev0["pinned_bytes_in_use"] + SLACK + grew["host_pool"])


def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


class Megatron(unittest.TestCase):
    def setUp(self):
        self.mgr = ot.PipelineOffloadManager.reset_instance()

    def tearDown(self):
        ot.PipelineOffloadManager.destroy_instance()

    def test_1f1b_bitwise_equal(self):
        data = make_data(steps=4, microbatches=4, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, lambda m, mbs: one_f_one_b(m, mbs, offload=False))
        offl = train(fresh_model(), data, lambda m, mbs: one_f_one_b(m, mbs, offload=True))
        assert_same(self, base, offl)
        st = self.mgr.stats()
        self.assertGreater(st["offloaded_bytes"], 0)
        self.assertGreater(st["reloaded_bytes"], 0)
        self.assertGreater(st["offloaded_tensors"], 0)
        self.assertEqual(st["iterations"], 4)
        self.assertFalse(self.mgr.is_warmup)
        self.assertIsNotNone(self.mgr.summary_text)
        self.assertIn("Activation Offload Summary", self.mgr.summary_text)
        self.assertGreater(self.mgr.offload_summary_total_bytes, 0)
        self.assertEqual(set(self.mgr.group_stats()), {"qkv_linear", "core_attn", "expert_fc1"})

    def test_eval_no_grad_offloads_nothing(self):
        model = fresh_model()
        data = make_data(steps=2, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        train(model, data[:1], lambda m, mbs: one_f_one_b(m, mbs, offload=True))
        before = self.mgr.stats()
        with torch.no_grad():
            for tok, tgt in data[1]:
                ot.init_chunk_handler(1, 0, 1)
                model(tok, tgt, offload=True)
        ot.reset()
        after = self.mgr.stats()
        for k in ("offloaded_bytes", "offloaded_tensors", "reloaded_bytes"):
            self.assertEqual(before[k], after[k], k)
        # training goes on after the eval pass, structure unchanged
        train(model, data[1:], lambda m, mbs: one_f_one_b(m, mbs, offload=True))
        self.assertGreater(self.mgr.stats()["offloaded_bytes"], after["offloaded_bytes"])

    def test_no_grad_first_does_not_consume_warmup(self):
        model = fresh_model()
        data = make_data(steps=1, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        with torch.no_grad():
            ot.init_chunk_handler(1, 0, 1)
            model(*data[0][0], offload=True)
        ot.reset()
        self.assertTrue(self.mgr.is_warmup)
        self.assertEqual(self.mgr.stats()["offloaded_bytes"], 0)

    def test_commit_other_name_raises(self):
        ot.init_chunk_handler(1, 0, 1)
        x = torch.randn(4, 4, requires_grad=True)
        x = ot.fine_grained_offloading_group_start(x, "core_attn")
        with self.assertRaises(ofl.OflError) as cm:
            ot.fine_grained_offloading_group_commit(x * 2, "expert_fc1")
        e = cm.exception
        self.assertEqual(e.status_str, "invalid usage (wrong order of calls)")
        self.assertIn("group_start", e.message)
        self.assertIn(e.message, str(e))

    def test_reset_with_open_group_recovers(self):
        # a step abandoned with a group open (an exception in the forward):
        # reset() closes it and starts the warmup again
        ot.init_chunk_handler(1, 0, 1)
        x = torch.randn(4, 4, requires_grad=True)
        ot.fine_grained_offloading_group_start(x, "core_attn")
        ot.reset()
        self.assertTrue(ot.PipelineOffloadManager.get_instance().is_warmup)
        self.assertEqual(ot.PipelineOffloadManager.get_instance()._core.open, [])

    def test_mark_not_offloadable_and_disable(self):
        ot.init_chunk_handler(1, 0, 1)
        x = torch.randn(64, 64, requires_grad=True)
        w = torch.randn(64, 64)
        ot.mark_not_offloadable(w)
        with ot.FineGrainedActivationOffloadingInterface(True, x, "g") as h:
            y = (h @ w.requires_grad_()).sum(-1)
        y = ot.fine_grained_offloading_group_commit(y, "g")
        y.sum().backward()
        ot.reset()
        st = self.mgr.stats()
        # h is offloaded, w is not
        self.assertEqual(st["offloaded_bytes"], 64 * 64 * 4)
        self.mgr.disable_offload()
        ot.init_chunk_handler(1, 0, 1)
        with ot.FineGrainedActivationOffloadingInterface(True, x, "g") as h:
            y = (h @ w).sum(-1)
        y = ot.fine_grained_offloading_group_commit(y, "g")
        y.sum().backward()
        ot.reset()
        self.assertEqual(self.mgr.stats()["offloaded_bytes"], st["offloaded_bytes"])
        self.mgr.enable_offload()

    def test_delay_and_flush(self):
        ot.init_chunk_handler(1, 0, 1)
        x = torch.randn(32, 32, requires_grad=True)
        with ot.FineGrainedActivationOffloadingInterface(True, x, "g") as h:
            y = h.exp()
        y = ot.fine_grained_offloading_group_commit(y, "g", delay_offload=True)
        self.assertEqual(self.mgr.stats()["offloaded_bytes"], 0)
        ot.flush_delayed_groups()
        self.assertGreater(self.mgr.stats()["offloaded_bytes"], 0)
        y.sum().backward()
        self.assertTrue(torch.equal(x.grad, x.detach().exp()))
        ot.reset()

    def test_records_noop_on_cpu_and_get_context(self):
        t = torch.ones(2, requires_grad=True)
        self.assertIs(ot.backward_record(t, None), t)
        self.assertIsNone(ot.forward_record(None))
        with ot.get_context(False):
            pass
        self.assertIs(ot.get_context(True), ot.PipelineOffloadManager.get_instance())

    def test_knobs_first_creation(self):
        m = ot.PipelineOffloadManager.reset_instance(fraction=0.5, max_inflight=2, pp_rank=1,
                                                     rank_delta_bytes=0)
        self.assertIs(ot.PipelineOffloadManager.get_instance(fraction=1.0), m)
        with self.assertRaises(TypeError):
            ot.PipelineOffloadManager.reset_instance(bogus=1)

    def test_no_leak_200_steps(self):
        model = fresh_model()
        data = make_data(steps=1, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            one_f_one_b(model, data[0], offload=True)
            opt.step()

        for _ in range(10):
            step()
        gc.collect()
        dev0, pools0, rss0 = self.mgr.device_stats(), self.mgr.pool_stats(), rss_kib()
        tracemalloc.start()
        snap0 = tracemalloc.take_snapshot()
        for _ in range(190):
            step()
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        dev1, pools1, rss1 = self.mgr.device_stats(), self.mgr.pool_stats(), rss_kib()
        check_pools(self, dev0, dev1, pools0, pools1)
        grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        self.assertLess(grown, 256 * 1024, "python heap grew by %d bytes" % grown)
        harness.assert_rss_growth(self, rss1 - rss0, 16 * 1024, "RSS grew by %d KiB" % (rss1 - rss0))
        self.assertEqual(self.mgr.stats()["unpopped_tensors"], 0)


class OffloadActivations(unittest.TestCase):
    def test_plain_loop_bitwise_equal(self):
        data = make_data(steps=4, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, plain_loop)
        ctx = ot.offload_activations(min_offload_size=64)

        def loop(m, mbs):
            losses = []
            for tok, tgt in mbs:
                with ctx:
                    loss = m(tok, tgt)
                losses.append(loss.detach().clone())
                (loss / len(mbs)).backward()
            return losses

        offl = train(fresh_model(), data, loop)
        assert_same(self, base, offl)
        st = ctx.stats()
        self.assertGreater(st["offloaded_bytes"], 0)
        self.assertGreater(st["reloaded_bytes"], 0)
        ctx.close()

    def test_model_head_and_decorator(self):
        model = fresh_model()
        data = make_data(steps=3, microbatches=1, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, plain_loop)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ctx = ot.offload_activations(model=model, min_offload_size=64, max_fwd_stash_size=1)

        @ctx
        def fwd(tok, tgt):
            return model(tok, tgt)

        def loop(m, mbs):
            losses = []
            for tok, tgt in mbs:
                loss = fwd(tok, tgt)
                losses.append(loss.detach().clone())
                loss.backward()
            return losses

        offl = train(model, data, loop)
        assert_same(self, base, offl)
        self.assertGreater(ctx.stats()["offloaded_bytes"], 0)
        ctx.close()
        with self.assertWarns(UserWarning):
            ot.offload_activations(model=torch.nn.ReLU()).close()

    def test_grad_accumulation_and_eval(self):
        data = make_data(steps=3, microbatches=2, batch=2, seq=SEQ, vocab=VOCAB)
        base = train(fresh_model(), data, plain_loop)
        ctx = ot.offload_activations(min_offload_size=64)

        def loop(m, mbs):
            # forwards first, then the backwards (two chunks per iteration)
            losses, outs = [], []
            for tok, tgt in mbs:
                with ctx:
                    loss = m(tok, tgt)
                losses.append(loss.detach().clone())
                outs.append(loss / len(mbs))
            for o in outs:
                o.backward()
            with torch.no_grad(), ctx:
                m(*mbs[0])
            return losses

        offl = train(fresh_model(), data, loop)
        assert_same(self, base, offl)
        ctx.close()

    def test_no_leak_200_steps(self):
        model = fresh_model()
        (tok, tgt), = make_data(steps=1, microbatches=1, batch=2, seq=SEQ, vocab=VOCAB)[0]
        ctx = ot.offload_activations(min_offload_size=64)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            with ctx:
                loss = model(tok, tgt)
            loss.backward()
            opt.step()

        for _ in range(10):
            step()
        gc.collect()
        dev0, pools0, rss0 = ctx.device_stats(), ctx.pool_stats(), rss_kib()
        for _ in range(190):
            step()
        gc.collect()
        dev1, pools1, rss1 = ctx.device_stats(), ctx.pool_stats(), rss_kib()
        check_pools(self, dev0, dev1, pools0, pools1)
        harness.assert_rss_growth(self, rss1 - rss0, 16 * 1024, "RSS grew by %d KiB" % (rss1 - rss0))
        self.assertEqual(ctx.stats()["unpopped_tensors"], 0)
        ctx.close()


class TraceFile(unittest.TestCase):
    def test_trace_file_is_written_at_exit(self):
        """OFL_TRACE_FILE under ofl.torch: the device is never closed, the
        trace is written when the interpreter exits, with the offload's
        copies in it."""
        import json
        import subprocess
        prog = ("import torch, ofl.torch as ot\n"
                "m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),"
                " torch.nn.Linear(64, 64))\n"
                "ctx = ot.offload_activations(min_offload_size=16)\n"
                "for _ in range(3):\n"
                "    with ctx:\n"
                "        y = m(torch.randn(32, 64)).sum()\n"
                "    y.backward()\n"
                "assert ctx.stats()['offloaded_tensors'] > 0\n")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.json")
            env = dict(os.environ, OFL_TRACE_FILE=path)
            env["PYTHONPATH"] = os.pathsep.join(sys.path)
            run = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True,
                                 text=True, timeout=300)
            self.assertEqual(run.returncode, 0, run.stdout[-2000:] + run.stderr[-2000:])
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        names = [e["name"] for e in events if e.get("ph") == "X"]
        self.assertGreater(names.count("d2h"), 0, names[:20])
        self.assertGreater(names.count("h2d"), 0, names[:20])


class Checkpoints(unittest.TestCase):
    def state(self):
        torch.manual_seed(3)
        sd = {n: p.detach().clone() for n, p in fresh_model().state_dict().items()}
        sd["bf16"] = torch.randn(5, 3).to(torch.bfloat16)
        sd["i64"] = torch.arange(7)
        sd["flag"] = torch.tensor([True, False])
        sd["half"] = torch.randn(2, 2, 2).half()
        return sd

    def test_safetensors_round_trip(self):
        sd = self.state()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "m.safetensors")
            ot.save_safetensors(sd, path, metadata={"step": "7"})
            back, meta = ot.load_safetensors(path, "cpu", with_metadata=True)
        self.assertEqual(meta.get("step"), "7")
        self.assertEqual(set(back), set(sd))
        for n, t in sd.items():
            self.assertEqual(back[n].dtype, t.dtype, n)
            self.assertEqual(back[n].shape, t.shape, n)
            self.assertEqual(bytes(back[n].contiguous().view(torch.uint8).reshape(-1).numpy()),
                             bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy()), n)

    def test_safetensors_errors(self):
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.safetensors")
            with open(bad, "wb") as f:
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
            with self.assertRaises(ofl.OflError) as cm:
                ot.load_safetensors(bad)
            self.assertEqual(cm.exception.status, 15)
            with self.assertRaises(TypeError):
                ot.save_safetensors({"x": 1}, os.path.join(d, "x.safetensors"))

    def test_async_stager(self):
        sd = self.state()
        tied = torch.randn(4, 4)
        nested = {"model": sd, "tied": [tied, tied[1]], "step": 11, "name": "run"}
        for cache in (False, True):
            stager = ot.AsyncStager(cache_staged_state_dict=cache, type_check=cache)
            staged = stager.stage(nested)
            self.assertFalse(stager.should_synchronize_after_execute)
            stager.synchronize_staging()
            self.assertEqual(staged["step"], 11)
            self.assertEqual(staged["name"], "run")
            for n, t in sd.items():
                self.assertTrue(torch.equal(staged["model"][n], t), n)
                self.assertNotEqual(staged["model"][n].data_ptr(), t.data_ptr())
            self.assertTrue(torch.equal(staged["tied"][1], tied[1]))
            # staged copies are independent of later updates
            sd["i64"].add_(1)
            self.assertFalse(torch.equal(staged["model"]["i64"], sd["i64"]))
            st = stager.stats()
            self.assertEqual(st["stages"], 1)
            self.assertGreaterEqual(st["shared_tensors"], 1)
            stager.close()

    def test_dcp_async_save(self):
        import torch.distributed.checkpoint as dcp
        sd = self.state()
        stager = ot.AsyncStager()
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fut = dcp.async_save({"model": sd}, checkpoint_id=d, async_stager=stager, no_dist=True)
            res = getattr(fut, "upload_completion", fut)
            res.result()
            back = {"model": {n: torch.zeros_like(t) for n, t in sd.items()}}
            dcp.load(back, checkpoint_id=d, no_dist=True)
        stager.close()
        for n, t in sd.items():
            self.assertTrue(torch.equal(back["model"][n], t), n)


class DiskCheckpoint(unittest.TestCase):
    def run_model(self, use_disk, disk_dir=None):
        torch.manual_seed(0)
        layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                          torch.nn.Dropout(0.1),
                                                          torch.nn.Linear(64, 32))
                                      for _ in range(3)])
        torch.manual_seed(1)
        x = torch.randn(8, 32, requires_grad=True)
        h = x
        for layer in layers:
            if use_disk:
                h = ot.disk_checkpoint(layer, h, prefetch_size=1, save_workers=2, disk_dir=disk_dir)
            else:
                h = layer(h)
        h.square().mean().backward()
        return h.detach(), x.grad, [p.grad for p in layers.parameters()]

    def test_bitwise_equal(self):
        with tempfile.TemporaryDirectory() as d:
            a = self.run_model(False)
            b = self.run_model(True, d)
            store = ot.DiskStore.get(d)
            st = store.stats()
            self.assertTrue(torch.equal(a[0], b[0]))
            self.assertTrue(torch.equal(a[1], b[1]))
            for ga, gb in zip(a[2], b[2]):
                self.assertTrue(torch.equal(ga, gb))
            self.assertEqual(st["stored"], 3)
            self.assertEqual(st["extents"], 0)
            self.assertGreater(st["reloads"], 0)

    def test_full_disk_keeps_in_memory(self):
        with tempfile.TemporaryDirectory() as d:
            store = ot.DiskStore(d, budget_bytes=4096)
            ot.DiskStore._stores[d] = store
            a = self.run_model(False)
            b = self.run_model(True, d)
            self.assertTrue(torch.equal(a[1], b[1]))
            st = store.stats()
            self.assertGreater(st["kept_in_memory"], 0)
            ot.DiskStore._stores.pop(d).close()


def _dist_worker(rank, world, init_file, out_dir):
    """One rank of Distributed.test_summary_gathered_on_rank_0 (a spawned
    process: the gloo group on the CPU)."""
    import json
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=world)
    try:
        mgr = ot.PipelineOffloadManager.reset_instance()
        # a batch per rank, so that the ranks' rows differ
        data = make_data(steps=2, microbatches=2, batch=2 + rank, seq=SEQ, vocab=VOCAB)
        train(fresh_model(), data, lambda m, mbs: one_f_one_b(m, mbs, offload=True))
        with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
            json.dump({"text": mgr.summary_text, "rows": mgr.summary_rows,
                       "own": mgr.offload_summary_bytes}, f)
        ot.PipelineOffloadManager.destroy_instance()
    finally:
        dist.destroy_process_group()


@unittest.skipIf(os.environ.get("OFLTEST_TSAN") == "1",
                 "under ThreadSanitizer: torch's gloo process group hands work between its own "
                 "threads through code that is not instrumented, which the runtime reports as "
                 "races in torch (c10d's AsyncAllgatherWork); the summary gather runs in the "
                 "plain suite")
class Distributed(unittest.TestCase):
    def test_summary_gathered_on_rank_0(self):
        import json
        import torch.distributed as dist
        import torch.multiprocessing as mp
        if not dist.is_available() or not dist.is_gloo_available():
            self.skipTest("torch.distributed with gloo is not available")
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_dist_worker, args=(2, os.path.join(d, "init"), d), nprocs=2, join=True)
            res = []
            for r in range(2):
                with open(os.path.join(d, "rank%d.json" % r)) as f:
                    res.append(json.load(f))
        own = [res[r]["own"] for r in range(2)]
        self.assertNotEqual(own[0], own[1])
        self.assertGreater(sum(own[1].values()), sum(own[0].values()))
        # rank 0 holds every rank's row, byte for byte each rank's own
        self.assertEqual(res[0]["rows"], own)
        self.assertIn("Rank 0 ", res[0]["text"])
        self.assertIn("Rank 1 ", res[0]["text"])
        # the other rank: its own row only
        self.assertEqual(res[1]["rows"], [own[1]])
        self.assertNotIn("Rank 1 ", res[1]["text"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
