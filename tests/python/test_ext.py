"""ofl._ext, ofl.torch's saved-tensor hooks (host backend, CPU tensors):
every branch of pack byte for byte against the tensors saved, a training run
bitwise against no offload, errors in Python's words, lifetimes. Run by meson
(suite python) with the build's extension on PYTHONPATH: harness exits 77
(skip) without torch, or without the extension unless OFL_EXPECT_EXT=1 (the
build made it: then its absence is a failure)."""
import gc
import os
import sys
import tracemalloc
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch and ofl._ext, or skip; the host backend

import torch  # noqa: E402
import ofl  # noqa: E402
import ofl.torch as ot  # noqa: E402
from ofl.torch import _core  # noqa: E402
from model import TinyTransformer, make_data, one_f_one_b, train  # noqa: E402

from ofl import _ext  # noqa: E402

torch.set_num_threads(1)


def new_core(cls, **kw):
    core = cls(groups=b"", fraction=1.0, rank_delta_bytes=0, summary=False, **kw)
    core.min_bytes = 1
    return core


def cases():
    """(name, tensor) pairs covering every branch of pack: contiguous
    storages, regions of larger storages (views), shared storages (aliases),
    non-contiguous views kept whole or left in Python, dtypes, 0-d and 1-d,
    parameters and their views, marked tensors, sizes under the threshold."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(64, 32, generator=g)
    w = torch.nn.Parameter(torch.randn(8, 8, generator=g))
    marked = torch.randn(32, generator=g)
    marked._ofl_not_offloadable = True
    out = [
        ("f32 2-d", torch.randn(16, 16, generator=g)),
        ("f32 1-d", torch.randn(100, generator=g)),
        ("f32 0-d", torch.tensor(2.5)),
        ("f32 4-d", torch.randn(2, 3, 4, 5, generator=g)),
        ("f16", torch.randn(7, 9, generator=g).half()),
        ("bf16", torch.randn(5, 6, generator=g).bfloat16()),
        ("i64", torch.randint(-1000, 1000, (40,), generator=g)),
        ("i8", torch.randint(-100, 100, (3, 33), generator=g, dtype=torch.int8)),
        ("bool", torch.rand(50, generator=g) > 0.5),
        ("big", big),
        ("big again (alias)", big),
        ("big reshaped (alias)", big.view(32, 64)),
        ("row block (view of big)", big[8:40]),
        ("small row block (view)", big[1:2]),
        ("transposed (whole storage)", big.t()),
        ("every other column (whole)", big[:, ::2]),
        ("small strided view (kept)", big[:3, ::4]),
        ("expanded (whole storage)", torch.randn(1, 8, generator=g).expand(64, 8)),
        ("parameter (kept)", w),
        ("view of a parameter (kept)", w.t()),
        ("marked (kept)", marked),
        ("empty (kept)", torch.empty(0, 4)),
    ]
    return out


def run_round(core, items):
    """One group: pack every tensor, commit, unpack in reverse. Returns the
    unpacked tensors (in items' order) and which ones stayed in Python."""
    core.chunk_begin(1, 0)
    core.group_start(b"g")
    packed = [core.pack(t) for _, t in items]
    kept = [type(p) is _ext.Kept and p.t is t for p, (_, t) in zip(packed, items)]
    core.commit(b"g")
    core.backward_begin(b"g")
    out = [core.unpack(p) for p in reversed(packed)][::-1]
    core.backward_end(b"g")
    del packed
    return out, kept


def same_tensor(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and torch.equal(a, b))


class Loaded(unittest.TestCase):
    def test_extension_is_the_hooks(self):
        self.assertEqual(_core.hooks_backend, "c")
        self.assertTrue(issubclass(_core.ManagerCore, _ext.Hooks))
        self.assertTrue(_ext.is_ready())
        self.assertEqual(_ext.ABI_VERSION, 3)
        mgr = ot.PipelineOffloadManager.reset_instance(summary=False)
        try:
            core = mgr._core
            self.assertIs(type(core).pack, _ext.Hooks.pack)
            self.assertIs(type(core).unpack, _ext.Hooks.unpack)
            self.assertIs(core.Saved, _ext.Saved)
            # the functions torch calls: builtin methods of the extension
            self.assertIs(mgr._hooks.pack_hook.__self__, core)
            self.assertEqual(type(mgr._hooks.pack_hook).__name__, "builtin_function_or_method")
            self.assertEqual(type(mgr._hooks.unpack_hook).__name__, "builtin_function_or_method")
        finally:
            ot.PipelineOffloadManager.destroy_instance()

    def test_bound_to_the_libofl_ctypes_loaded(self):
        path, version = _ext.library()
        self.assertTrue(os.path.samefile(path, ofl._lib.path), (path, ofl._lib.path))
        self.assertRegex(version, r"^\d+\.\d+\.\d+")  # the headers it was built with
        self.assertFalse(hasattr(_ext, "FUNCTIONS"))  # no table of addresses any more
        with self.assertRaises(TypeError):
            _ext.setup(None, torch)  # the error factory must be callable
        _ext.setup(ofl._errors.error, torch)  # the package's own again


class SameBytes(unittest.TestCase):
    def test_pack_unpack_bytes(self):
        items = cases()
        ref = [t.clone() if not isinstance(t, torch.nn.Parameter) else t.detach().clone()
               for _, t in items]
        core = new_core(_core.ManagerCore)
        per_iteration = []
        for _ in range(3):  # warmup, then two steady iterations
            out, kept = run_round(core, items)
            core.reset()
            st = core.stats()  # the iteration's counts
            per_iteration.append({k: st[k] for k in ("offloaded_tensors", "offloaded_bytes",
                                                     "reloaded_tensors", "reloaded_bytes",
                                                     "dedup_tensors")})
            self.assertEqual(st["unpopped_tensors"], 0)
        core.close()
        for (name, t), r, x in zip(items, ref, out):
            self.assertEqual((x.dtype, x.shape), (t.dtype, t.shape), name)
            self.assertTrue(torch.equal(x, r), name)  # byte for byte as saved
            if not t.is_contiguous() and t.numel():
                self.assertEqual((x.stride(), x.storage_offset()),
                                 (t.stride(), t.storage_offset()), name)
        # every iteration moved the same; what went came back; each tensor
        # handed over was copied or found a copy of its storage (dedup)
        self.assertEqual(per_iteration[0], per_iteration[1])
        self.assertEqual(per_iteration[1], per_iteration[2])
        it = per_iteration[2]
        handed = sum(1 for k in kept if not k)
        self.assertEqual(it["offloaded_tensors"] + it["dedup_tensors"], handed)
        self.assertGreater(it["dedup_tensors"], 0)  # the aliases of big
        self.assertEqual((it["reloaded_tensors"], it["reloaded_bytes"]),
                         (it["offloaded_tensors"], it["offloaded_bytes"]))
        big = dict(items)["big"]
        self.assertGreaterEqual(it["offloaded_bytes"], big.numel() * big.element_size())
        self.assertLessEqual(it["offloaded_bytes"],
                             sum(t.numel() * t.element_size() for (_, t), k in zip(items, kept)
                                 if not k))
        kept_names = [n for (n, _), k in zip(items, kept) if k]
        self.assertEqual(kept_names, [n for n, _ in items if "(kept)" in n])

    def test_thresholds_and_switches(self):
        cls = _core.ManagerCore
        core = new_core(cls)
        x = torch.randn(10, 10)
        core.chunk_begin(1, 0)

        def kept(r):
            return type(r) is _ext.Kept and r.t is x and r.version == x._version

        self.assertTrue(kept(core.pack(x)))  # no open group
        core.group_start(b"g")
        core.min_elems = 101
        self.assertTrue(kept(core.pack(x)))
        core.min_elems = 100
        core.min_bytes = 401
        self.assertTrue(kept(core.pack(x)))
        core.min_bytes = 400
        core.set_enabled(False)
        self.assertFalse(core.active)
        self.assertTrue(kept(core.pack(x)))
        core.set_enabled(True)
        self.assertIs(core.active, True)
        r = core.pack(x)
        self.assertIs(type(r), cls.Saved)
        self.assertEqual((r.nbytes, r.whole, tuple(r.size)), (400, False, (10, 10)))
        core.commit(b"g")
        core.backward_begin(b"g")
        self.assertTrue(torch.equal(core.unpack(r), x))
        core.backward_end(b"g")
        core.reset()
        core.close()

    def test_megatron_training_bitwise_against_no_offload(self):
        data = make_data(steps=3, microbatches=4, batch=2, seq=16, vocab=64)
        torch.manual_seed(0)
        plain = train(TinyTransformer(vocab=64, seq=16), data,
                      lambda m, mbs: one_f_one_b(m, mbs, offload=False))
        mgr = ot.PipelineOffloadManager.reset_instance(summary=False)
        try:
            self.assertIs(type(mgr._core), _core.ManagerCore)
            torch.manual_seed(0)
            model = TinyTransformer(vocab=64, seq=16)
            run = train(model, data, lambda m, mbs: one_f_one_b(m, mbs, offload=True))
            offloaded = mgr.stats()["offloaded_bytes"]
        finally:
            ot.PipelineOffloadManager.destroy_instance()
        self.assertGreater(offloaded, 0)
        (la, ga), (lb, gb) = plain[:2], run[:2]
        for sa, sb in zip(la, lb):
            for a, b in zip(sa, sb):
                self.assertTrue(torch.equal(a, b))
        for sa, sb in zip(ga, gb):
            for n in sa:
                self.assertTrue(torch.equal(sa[n], sb[n]), n)


class Errors(unittest.TestCase):
    def test_ofl_error_from_c(self):
        core = new_core(_core.ManagerCore)
        x = torch.randn(8, 8)
        core.chunk_begin(1, 0)
        core.group_start(b"g")
        r = core.pack(x)
        core.commit(b"g")
        core.backward_begin(b"g")
        y = core.unpack(r)
        self.assertIs(core.unpack(r), y)  # a graph used again: the same tensor
        core.backward_end(b"g")
        del y
        core.reset()
        # a tensor of an ended iteration: the manager's error, in Python's words
        core.chunk_begin(1, 0)
        core.group_start(b"g")
        r = core.pack(x)
        core.commit(b"g")
        core.reset()  # destroys the unpopped tensor
        with self.assertRaises(RuntimeError) as cm:
            core.unpack(r)
        b = str(cm.exception)
        self.assertEqual(r.core, core)  # still counted: the record is alive
        del r
        self.assertEqual(core.unpopped, 0)
        core.close()
        self.assertIn("iteration that was already ended", b)
        self.assertIn("Run the backward of every forward before reset()", b)
        self.assertIn("ofl_manager_tensor_pop", b)
        self.assertIn("invalid argument", b)

    def test_bad_state_is_an_exception(self):
        core = new_core(_core.ManagerCore)
        core.chunk_begin(1, 0)
        core.group_start(b"g")
        core.open[-1].bases = None
        with self.assertRaises(TypeError):
            core.pack(torch.randn(4, 4))
        core.open[-1].bases = {}
        core.commit(b"g")
        core.reset()
        core.close()


class Lifetime(unittest.TestCase):
    def test_references_return(self):
        core = new_core(_core.ManagerCore)
        x = torch.randn(32, 32)
        rx, rcore = sys.getrefcount(x), sys.getrefcount(core)
        for _ in range(3):
            out, _ = run_round(core, [("x", x)])
            self.assertEqual(core.live_blocks, 1)
            self.assertGreater(sys.getrefcount(core), rcore)  # the block holds it
            self.assertTrue(torch.equal(out[0], x))
            del out
            self.assertEqual(core.live_blocks, 0)
            core.reset()
        gc.collect()
        self.assertEqual(sys.getrefcount(x), rx)
        self.assertEqual(sys.getrefcount(core), rcore)
        core.close()

    def test_close_waits_for_reloaded_tensors(self):
        core = new_core(_core.ManagerCore)
        x = torch.randn(16, 16)
        out, _ = run_round(core, [("x", x)])
        core.reset()
        core.close()
        self.assertTrue(core.closing)
        self.assertIsNotNone(core.m)  # a reloaded tensor still uses its pool
        self.assertTrue(torch.equal(out[0], x))
        del out
        self.assertIsNone(core.m)  # destroyed by the last block

    def _survives(self, prog):
        """prog in a fresh interpreter with Python objects on glibc malloc
        and freed memory poisoned (PYTHONMALLOC=malloc, MALLOC_PERTURB_): a
        use after free of an object there reads poison and crashes. prog
        must exit 0 having printed "survived"."""
        import subprocess
        env = dict(os.environ, PYTHONMALLOC="malloc", MALLOC_PERTURB_="169",
                   PYTHONFAULTHANDLER="1")
        p = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True,
                           text=True, timeout=240)
        out = p.stdout + p.stderr
        self.assertEqual(p.returncode, 0, out)
        self.assertIn("survived", out)

    def test_unpack_through_a_newer_manager_keeps_the_records_own(self):
        """A record of a manager that only the record still references
        (offload_activations renews a session's manager; the old one's
        records can still be unpacked), unpacked through the new manager's
        unpack_ordered: the pop drops the record's reference to its manager,
        which was then freed under the call."""
        prog = (
            "import gc, torch\n"
            "from ofl.torch import _core\n"
            "torch.set_num_threads(1)\n"
            "def mk():\n"
            "    return _core.ManagerCore(groups=b'', fraction=1.0, rank_delta_bytes=0,\n"
            "        pp_rank=0, max_inflight=5, summary=False, prefetch_groups=5)\n"
            "A, B = mk(), mk()\n"
            "A.chunk_begin(1, 0); A.min_bytes = 0\n"
            "t = torch.randn(64, 64); want = t.clone()\n"
            "marks, live = [], []\n"
            "r = A.pack_offload(t, b'activations', marks, live)\n"
            "del t, A\n"
            "gc.collect()\n"
            "x = B.unpack_ordered(r, [marks], [0, 0], b'activations')\n"
            "junk = [[object() for _ in range(1000)] for _ in range(20)]\n"
            "assert torch.equal(x, want)\n"
            "del x, r, junk\n"
            "gc.collect()\n"
            "print('survived')\n")
        self._survives(prog)

    def test_a_collection_inside_a_records_making_sees_it_whole(self):
        """A record is tracked by the GC before its weak reference to the
        tensor's root is made, and making that weak reference can start a
        collection, which visits the record: its weak-reference field must
        already be set (it was left as malloc returned it, so the GC read
        garbage as an object; under load a crash inside a module's forward,
        in its pack hook). A collection at every allocation
        (gc.set_threshold(1)) makes each record's weak reference start
        one."""
        prog = (
            "import gc, torch\n"
            "from ofl.torch import _core\n"
            "torch.set_num_threads(1)\n"
            "core = _core.ManagerCore(groups=b'', fraction=1.0, rank_delta_bytes=0,\n"
            "    summary=False)\n"
            "core.min_bytes = 1\n"
            "ts = [torch.randn(16, 16) for _ in range(64)]\n"
            "want = [t.clone() for t in ts]\n"
            "gc.set_threshold(1)\n"
            "for it in range(3):\n"
            "    core.chunk_begin(1, 0)\n"
            "    core.group_start(b'g')\n"
            "    rs = [core.pack(t) for t in ts]\n"
            "    core.commit(b'g')\n"
            "    core.backward_begin(b'g')\n"
            "    out = [core.unpack(r) for r in reversed(rs)][::-1]\n"
            "    core.backward_end(b'g')\n"
            "    assert all(torch.equal(a, b) for a, b in zip(out, want))\n"
            "    del rs, out\n"
            "    core.reset()\n"
            "gc.set_threshold(700)\n"
            "core.close()\n"
            "print('survived')\n")
        self._survives(prog)

    def test_last_block_freed_inside_a_pop_of_a_closing_manager(self):
        """close() with a reloaded tensor alive leaves the destroy to its
        last block. When that block is freed by Python run inside a pop on
        the same manager (the allocator's torch.empty starts a GC that
        collects it), the manager and its pool must outlive the pop: the
        destroy waits for the call's end. It used to free the pool under
        the allocation (a hang on its freed mutex, or a crash)."""
        prog = (
            "import gc, torch\n"
            "from ofl.torch import _core\n"
            "torch.set_num_threads(1)\n"
            "flag = [False]\n"
            "orig = _core.Runtime._alloc\n"
            "def alloc(self, n, s):\n"
            "    if flag[0]:\n"
            "        gc.collect()  # as any allocation there may\n"
            "    return orig(self, n, s)\n"
            "_core.Runtime._alloc = alloc\n"
            "A = _core.ManagerCore(groups=b'', fraction=1.0, rank_delta_bytes=0, pp_rank=0,\n"
            "    max_inflight=5, summary=False, prefetch_groups=5)\n"
            "A.chunk_begin(1, 0); A.min_bytes = 0\n"
            "t1, t2 = torch.randn(256, 64), torch.randn(128, 64)\n"
            "w1, w2 = t1.clone(), t2.clone()\n"
            "marks, live = [], []\n"
            "r1 = A.pack_offload(t1, b'activations', marks, live)\n"
            "r2 = A.pack_offload(t2, b'activations', marks, live)\n"
            "del t1, t2\n"
            "A.synchronize()\n"
            "x1 = A.pop_record(r1)\n"
            "assert torch.equal(x1, w1) and A.live_blocks == 1\n"
            "cyc = [x1]; cyc.append(cyc); del x1, cyc, r1\n"
            "A.close()\n"
            "assert A.closing and A.m is not None\n"
            "flag[0] = True\n"
            "x2 = A.pop_record(r2)\n"
            "flag[0] = False\n"
            "assert torch.equal(x2, w2), 'wrong bytes'\n"
            "assert A.m is not None  # x2's block keeps it\n"
            "del x2, r2\n"
            "gc.collect()\n"
            "assert A.m is None, 'not destroyed after its last block'\n"
            "print('survived')\n")
        self._survives(prog)

    def test_no_growth_2000_rounds(self):
        core = new_core(_core.ManagerCore)
        items = cases()
        for _ in range(20):
            run_round(core, items)
            core.reset()
        gc.collect()
        pools0 = core.pool_stats()
        tracemalloc.start()
        snap0 = tracemalloc.take_snapshot()
        for _ in range(200):
            out, _ = run_round(core, items)
            del out
            core.reset()
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        self.assertLess(grown, 64 * 1024, "python heap grew by %d bytes" % grown)
        pools1 = core.pool_stats()
        self.assertEqual(pools1["device_pool"]["in_use_bytes"], 0)
        self.assertEqual(pools0["device_pool"]["in_use_bytes"], 0)
        self.assertEqual(core.stats()["unpopped_tensors"], 0)
        self.assertEqual(core.live_blocks, 0)
        core.close()
        self.assertIsNone(core.m)


if __name__ == "__main__":
    unittest.main(verbosity=2)
