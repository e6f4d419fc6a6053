"""ofl.torch.AsyncStager against the behaviour of torch's StateDictStager
(host backend, CPU tensors). Run by meson (suite python): exits 77 (skip)
when torch cannot be imported.

Part 1 ports the CPU-portable tests of PyTorch's
test/distributed/checkpoint/test_state_dict_stager.py (TestStateDictStager,
and the async_save memory test of TestDTensorStateDictStager) to ofl's
stager: the accelerator tensors there are CPU tensors here, the
pin_memory/share_memory variants (options ofl's stager does not have) run
once, and what torch reads from StateDictStager._cached_storage_mapping is
read from the stager's stats(). Part 2 holds ofl's own cases: a dataclass
leaf updated after dcp.async_save, views, tensor attributes, shared objects
and cycles, non-tensor values, errors.

OFL_STAGER_UNDER_TEST=torch runs part 1 against torch's StateDictStager
instead (the ports' own check)."""
import collections
import dataclasses
import os
import sys
import tempfile
import threading
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks

import torch  # noqa: E402
import ofl.torch as ot  # noqa: E402

torch.set_num_threads(1)
UNDER_TEST = os.environ.get("OFL_STAGER_UNDER_TEST", "ofl")


class TorchStager:
    """torch's StateDictStager behind the calls part 1 makes (its stats read
    from its storage cache)."""

    def __init__(self, cache_staged_state_dict=False, type_check=False):
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
        self.s = StateDictStager()

    def stage(self, sd):
        return self.s.stage(sd)

    def stats(self):
        m = self.s._cached_storage_mapping
        return {"storages_copied": len(m), "bytes_copied": sum(s.nbytes() for s in m.values()),
                "buffer_allocs": len(m)}

    def close(self):
        self.s.close()


def make_stager(**kw):
    return TorchStager(**kw) if UNDER_TEST == "torch" else ot.AsyncStager(**kw)


def storage_ptr(t):
    return t.untyped_storage().data_ptr()


def same_state(test, src, staged):
    """src and its staged copy agree: the same structure and types, equal
    tensors at the same storage offsets, the staged tensors on the cpu in
    storages of their own, shared where (and only where) the sources
    shared."""
    pairs = {}

    def walk(a, b, path):
        if isinstance(a, torch.Tensor):
            test.assertIsInstance(b, torch.Tensor, path)
            test.assertEqual(b.device.type, "cpu", path)
            test.assertEqual((b.dtype, b.shape, b.stride(), b.storage_offset()),
                             (a.dtype, a.shape, a.stride(), a.storage_offset()), path)
            test.assertTrue(torch.equal(a.cpu(), b), path)
            if a.untyped_storage().nbytes():
                test.assertNotEqual(storage_ptr(a), storage_ptr(b), path)
                test.assertEqual(pairs.setdefault(storage_ptr(a), storage_ptr(b)),
                                 storage_ptr(b), "%s: sharing differs" % path)
        elif isinstance(a, dict):
            test.assertIs(type(a), type(b), path)
            test.assertEqual(list(a), list(b), path)
            for k in a:
                walk(a[k], b[k], "%s.%s" % (path, k))
        elif isinstance(a, (list, tuple, set)):
            test.assertIs(type(a), type(b), path)
            test.assertEqual(len(a), len(b), path)
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, "%s[%d]" % (path, i))
        elif hasattr(a, "__dict__"):
            test.assertIs(type(a), type(b), path)
            walk(vars(a), vars(b), path + ".__dict__")
        else:
            test.assertIs(type(a), type(b), path)
            test.assertEqual(a, b, path)
    walk(src, staged, "state_dict")
    # distinct source storages stay distinct
    test.assertEqual(len(set(pairs.values())), len(pairs))


@dataclasses.dataclass
class OneTensor:
    tensor1: torch.Tensor


@dataclasses.dataclass
class Inner:
    tensor: torch.Tensor
    value: int = 42


@dataclasses.dataclass
class Outer:
    tensor: torch.Tensor
    name: str
    values: list
    nested: Inner


@dataclasses.dataclass(frozen=True)
class Frozen:
    tensor: torch.Tensor
    value: int = 100


def views_state():
    t1 = torch.randn(4, 4)
    t3 = torch.randn(4, 4)
    return t1, t3, {"tensor1": t1, "tensor2": t1.view(16),
                    "recursive": {"tensor3": t3, "type": OneTensor(tensor1=t3.narrow(0, 0, 2))}}


class PortedStateDictStagerTests(unittest.TestCase):
    """PyTorch's TestStateDictStager (and its async_save memory test), on
    the cpu."""

    def test_views(self):
        t1, t3, sd = views_state()
        self.assertEqual(storage_ptr(sd["tensor1"]), storage_ptr(sd["tensor2"]))
        stager = make_stager()
        staged = stager.stage(sd)
        st = stager.stats()
        self.assertEqual(st["storages_copied"], 2)  # t1 with its view, t3 with its slice
        self.assertEqual(st["bytes_copied"], t1.nbytes + t3.nbytes)
        same_state(self, sd, staged)
        self.assertEqual(storage_ptr(staged["tensor1"]), storage_ptr(staged["tensor2"]))
        rec = staged["recursive"]
        self.assertEqual(rec["type"].tensor1.device.type, "cpu")
        self.assertEqual(storage_ptr(rec["tensor3"]), storage_ptr(rec["type"].tensor1))
        stager.close()

    def test_caching(self):
        t1, t3, sd = views_state()
        stager = make_stager(cache_staged_state_dict=True)
        first = stager.stage(sd)
        allocs = stager.stats()["buffer_allocs"]
        same_state(self, sd, first)
        t1.fill_(0)
        t3.fill_(0)
        second = stager.stage(sd)
        same_state(self, sd, second)
        self.assertEqual(stager.stats()["buffer_allocs"], allocs)  # nothing new allocated
        for k in ("tensor1", "tensor2"):
            self.assertEqual(storage_ptr(first[k]), storage_ptr(second[k]), k)
        self.assertEqual(storage_ptr(first["recursive"]["tensor3"]),
                         storage_ptr(second["recursive"]["tensor3"]))
        t1.fill_(42.0)
        third = stager.stage(sd)
        self.assertTrue(bool((third["tensor1"] == 42.0).all()))
        self.assertTrue(bool((third["tensor2"] == 42.0).all()))
        stager.close()

    def test_tensor_attrs(self):
        t1, t3, sd = views_state()
        t1.a, t1.b, t3.c = 42, 43, 44
        stager = make_stager()
        staged = stager.stage(sd)
        self.assertEqual((staged["tensor1"].a, staged["tensor1"].b), (42, 43))
        self.assertEqual(staged["recursive"]["tensor3"].c, 44)
        stager.close()

    def test_different_dtypes(self):
        sd = {"float32": torch.randn(4, 4), "float64": torch.randn(4, 4, dtype=torch.float64),
              "int32": torch.randint(-100, 100, (4, 4), dtype=torch.int32),
              "int64": torch.randint(-100, 100, (4, 4)),
              "bool": torch.randint(0, 2, (4, 4)).bool()}
        stager = make_stager()
        staged = stager.stage(dict(sd))
        for k, t in sd.items():
            self.assertEqual(staged[k].device.type, "cpu", k)
            self.assertEqual(staged[k].dtype, t.dtype, k)
            self.assertTrue(torch.equal(staged[k], t), k)
        stager.close()

    def test_empty_tensors(self):
        sd = {"empty_0d": torch.tensor([]), "empty_1d": torch.tensor([]).reshape(0),
              "empty_2d": torch.tensor([]).reshape(0, 0),
              "empty_3d": torch.tensor([]).reshape(0, 0, 0), "zero_dim": torch.tensor(0.0)}
        stager = make_stager()
        staged = stager.stage(dict(sd))
        for k, t in sd.items():
            self.assertEqual(staged[k].device.type, "cpu", k)
            self.assertEqual(staged[k].shape, t.shape, k)
            self.assertEqual(staged[k].dtype, t.dtype, k)
        self.assertEqual(staged["zero_dim"].item(), 0.0)
        stager.close()

    def test_complex_storage_sharing(self):
        base = torch.randn(10, 10)
        view1 = base.view(100)
        sd = {"base": base, "view1": view1, "view2": base.view(10, 10),
              "slice1": base[2:8, 2:8], "slice2": base[:, :5], "slice3": view1[10:60]}
        stager = make_stager()
        staged = stager.stage(sd)
        same_state(self, sd, staged)
        ptr = storage_ptr(staged["base"])
        for k in sd:
            self.assertEqual(storage_ptr(staged[k]), ptr, k)
        staged["base"].fill_(42.0)
        for k in sd:
            self.assertTrue(bool((staged[k] == 42.0).all()), k)
        stager.close()

    def test_dataclasses(self):
        t1, t2, t3, t4 = torch.randn(4, 4), torch.randn(8, 8), torch.randn(2, 6), torch.randn(3, 5)
        sd = {"regular_tensor": t2,
              "complex_dataclass": Outer(tensor=t1, name="test", values=[1.0, 2.0, 3.0],
                                         nested=Inner(tensor=t3)),
              "frozen_dataclass": Frozen(tensor=t4)}
        stager = make_stager()
        staged = stager.stage(sd)
        self.assertTrue(torch.equal(staged["regular_tensor"], t2))
        outer = staged["complex_dataclass"]
        self.assertEqual((outer.name, outer.values), ("test", [1.0, 2.0, 3.0]))
        self.assertTrue(torch.equal(outer.tensor, t1))
        self.assertEqual(outer.nested.value, 42)
        self.assertTrue(torch.equal(outer.nested.tensor, t3))
        frozen = staged["frozen_dataclass"]
        self.assertEqual(frozen.value, 100)
        self.assertTrue(torch.equal(frozen.tensor, t4))
        for t, v in ((t1, 99.0), (t3, 88.0), (t4, 77.0)):
            t.fill_(v)
        self.assertFalse(torch.allclose(outer.tensor, t1))
        self.assertFalse(torch.allclose(outer.nested.tensor, t3))
        self.assertFalse(torch.allclose(frozen.tensor, t4))
        stager.close()

    def test_cpu_storage_independence(self):
        t1, t2 = torch.randn(4, 4), torch.randn(8, 8)
        stager = make_stager()
        staged = stager.stage({"tensor1": t1, "tensor2": t2})
        self.assertNotEqual(storage_ptr(t1), storage_ptr(staged["tensor1"]))
        self.assertNotEqual(storage_ptr(t2), storage_ptr(staged["tensor2"]))
        was1, was2 = t1.clone(), t2.clone()
        t1.fill_(99.0)
        t2.fill_(88.0)
        self.assertTrue(torch.equal(staged["tensor1"], was1))
        self.assertTrue(torch.equal(staged["tensor2"], was2))
        stager.close()

    def test_tensor_pinned_and_shared(self):
        t1, t2 = torch.randn(4, 4), torch.randn(8, 8)
        stager = make_stager()
        staged = stager.stage({"tensor1": t1, "tensor2": t2})
        # ofl's host copy is pinned on the cuda backend (what torch sees
        # there), plain memory on the host backend; never torch's shared memory
        pinned = UNDER_TEST != "torch" and ot.Runtime.get().is_cuda
        for k, t in (("tensor1", t1), ("tensor2", t2)):
            self.assertEqual(staged[k].device.type, "cpu", k)
            self.assertTrue(torch.equal(staged[k], t), k)
            self.assertEqual(staged[k].is_pinned(), pinned, k)
            self.assertFalse(staged[k].is_shared(), k)
            self.assertFalse(staged[k].untyped_storage().is_shared(), k)
        stager.close()

    def test_async_save_no_memory_leak(self):
        import torch.distributed.checkpoint as dcp
        mib = 32
        sd = {"weights": torch.randn(mib * 2**20 // 4)}
        stager = make_stager()
        if UNDER_TEST == "torch":
            stager = None  # async_save's own default stager

        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")

            def save(name):
                f = dcp.async_save(sd, checkpoint_id=os.path.join(d, name), no_dist=True,
                                   async_stager=stager)
                getattr(f, "upload_completion", f).result()
            save("warmup")
            before = rss_mib()
            for i in range(5):
                save("step_%d" % i)
            growth = rss_mib() - before
        if stager is not None:
            stager.close()
        harness.assert_rss_growth(self, growth, mib * 1.2, "rss grew %.0f MiB over 5 saves" % growth)


# ---- ofl's own cases ------------------------------------------------------------


@dataclasses.dataclass
class Holder:
    t: torch.Tensor


class GatedWriter:
    """A FileSystemWriter whose writes wait for the test's go (what the save
    writes is read from the staged state dict then)."""

    @staticmethod
    def make(path, gate):
        from torch.distributed.checkpoint import FileSystemWriter

        class Writer(FileSystemWriter):
            def write_data(self, plan, planner):
                if not gate.wait(60):
                    raise RuntimeError("the test never opened the gate")
                return super().write_data(plan, planner)
        return Writer(path)


Pair = collections.namedtuple("Pair", "first second")


class Slotted:
    __slots__ = ("t", "tag")

    def __init__(self, t, tag):
        self.t, self.tag = t, tag


class Node:
    def __init__(self, t):
        self.t = t
        self.me = self
        self.peers = []


class Rebuilt:
    """Rebuilt by copy from a tensor it makes anew at each __reduce_ex__."""

    def __init__(self, t):
        self.t = t

    def __reduce_ex__(self, protocol):
        return (Rebuilt, (self.t * 1,))


class OwnCopy:
    def __init__(self, t):
        self.t = t

    def __deepcopy__(self, memo):
        return OwnCopy(self.t.clone() + 1)


class OflStagerCases(unittest.TestCase):
    def test_dataclass_leaf_updated_after_async_save(self):
        import torch.distributed.checkpoint as dcp
        t = torch.randn(64, 16)
        at_stage = t.clone()
        stager = ot.AsyncStager()
        gate = threading.Event()
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f = dcp.async_save({"obj": Holder(t=t), "w": t[:8]},
                               storage_writer=GatedWriter.make(d, gate), async_stager=stager,
                               no_dist=True)
            t.add_(1.0)  # the next step updates the model in place
            gate.set()
            getattr(f, "upload_completion", f).result()
            back = {"obj": Holder(t=torch.zeros(64, 16)), "w": torch.zeros(8, 16)}
            dcp.load(back, checkpoint_id=d, no_dist=True)
        stager.close()
        want = at_stage.numpy().tobytes()
        self.assertTrue(back["obj"].t.numpy().tobytes() == want,
                        "the checkpoint holds obj.t as updated after async_save returned")
        self.assertTrue(back["w"].numpy().tobytes() == at_stage[:8].numpy().tobytes())
        self.assertTrue(t.numpy().tobytes() != want)

    def test_views_share_one_staged_storage(self):
        base = torch.arange(120, dtype=torch.float32).reshape(10, 12)
        sd = {"a": base[2:5], "b": base[:, 3:7], "t": base.t(), "tail": base.view(-1)[100:],
              "other": torch.ones(3)}
        stager = ot.AsyncStager()
        staged = stager.stage(sd)
        same_state(self, sd, staged)
        ptrs = {storage_ptr(staged[k]) for k in ("a", "b", "t", "tail")}
        self.assertEqual(len(ptrs), 1)
        self.assertNotIn(storage_ptr(staged["other"]), ptrs)
        self.assertEqual(staged["b"].storage_offset(), 3)
        self.assertEqual(staged["tail"].storage_offset(), 100)
        self.assertEqual(staged["t"].stride(), (1, 12))
        st = stager.stats()
        self.assertEqual((st["storages_copied"], st["tensors_staged"], st["shared_tensors"]),
                         (2, 5, 3))
        self.assertEqual(st["bytes_copied"], base.nbytes + sd["other"].nbytes)
        staged["a"][0, 3] = -1.0  # one staged storage: seen through every view
        self.assertEqual(staged["b"][2, 0].item(), -1.0)
        self.assertEqual(staged["t"][3, 2].item(), -1.0)
        self.assertEqual(base[2, 3].item(), 27.0)  # and not the source
        stager.close()

    def test_custom_attributes_and_requires_grad(self):
        w = torch.randn(5, 3, requires_grad=True)
        w.note = "embedding"
        w.extra = {"scale": torch.full((3,), 2.0), "ids": [1, 2]}
        p = torch.nn.Parameter(torch.randn(4))
        p.tp_dim = 0
        stager = ot.AsyncStager()
        staged = stager.stage({"w": w, "p": p, "i": torch.arange(3)})
        sw = staged["w"]
        self.assertEqual(sw.note, "embedding")
        self.assertTrue(torch.equal(sw.extra["scale"], w.extra["scale"]))
        self.assertNotEqual(storage_ptr(sw.extra["scale"]), storage_ptr(w.extra["scale"]))
        self.assertIsNot(sw.extra, w.extra)
        self.assertEqual(sw.extra["ids"], [1, 2])
        self.assertTrue(sw.requires_grad)
        self.assertTrue(sw.is_leaf)
        self.assertTrue(torch.equal(sw.detach(), w.detach()))
        self.assertTrue(staged["p"].requires_grad)
        self.assertEqual(staged["p"].tp_dim, 0)
        self.assertFalse(staged["i"].requires_grad)
        stager.close()

    def test_shared_objects_staged_once(self):
        t = torch.randn(6)
        h = Holder(t=t)
        lst = [t]
        lst.append(lst)  # a cycle through a list
        node = Node(torch.randn(2))
        node.peers.append(node)
        sd = {"h1": h, "h2": h, "t": t, "lst": lst, "pair": (h, h), "node": node}
        stager = ot.AsyncStager()
        staged = stager.stage(sd)
        self.assertIsNot(staged["h1"], h)
        self.assertIs(staged["h1"], staged["h2"])
        self.assertIs(staged["h1"].t, staged["t"])  # one staged tensor for t
        self.assertIs(staged["lst"][0], staged["t"])
        self.assertIs(staged["lst"][1], staged["lst"])
        self.assertIs(staged["pair"][0], staged["h1"])
        sn = staged["node"]
        self.assertIsNot(sn, node)
        self.assertIs(sn.me, sn)
        self.assertIs(sn.peers[0], sn)
        self.assertTrue(torch.equal(sn.t, node.t))
        st = stager.stats()
        self.assertEqual((st["tensors_staged"], st["storages_copied"]), (2, 2))
        t.add_(1.0)
        self.assertFalse(torch.equal(staged["t"], t))
        stager.close()

    def test_non_tensor_values_are_deep_copied(self):
        opts = {"betas": [0.9, 0.95], "names": {"a", "b"}}
        slotted = Slotted(torch.randn(3), ["x"])
        sd = {"opts": opts, "step": 7, "name": "run", "atoms": (1, "two", None),
              "pair": Pair(torch.ones(2), {"k": [1]}), "slotted": slotted,
              "od": collections.OrderedDict(a=torch.zeros(2), b=3), "bytes": b"\x00\x01"}
        stager = ot.AsyncStager()
        staged = stager.stage(sd)
        self.assertEqual(staged["opts"], opts)
        self.assertIsNot(staged["opts"], opts)
        self.assertIsNot(staged["opts"]["betas"], opts["betas"])
        self.assertIsNot(staged["opts"]["names"], opts["names"])
        self.assertIs(staged["atoms"], sd["atoms"])  # nothing inside changed: kept
        self.assertIs(staged["name"], "run")
        self.assertIs(type(staged["pair"]), Pair)
        self.assertIsNot(staged["pair"].second, sd["pair"].second)
        self.assertIsNot(staged["pair"].first, sd["pair"].first)
        self.assertIs(type(staged["slotted"]), Slotted)
        self.assertIsNot(staged["slotted"].t, slotted.t)
        self.assertTrue(torch.equal(staged["slotted"].t, slotted.t))
        self.assertEqual(staged["slotted"].tag, ["x"])
        self.assertIs(type(staged["od"]), collections.OrderedDict)
        self.assertIsNot(staged["od"]["a"], sd["od"]["a"])
        opts["betas"].append(0.99)  # later changes of the source do not reach the copy
        opts["names"].add("c")
        sd["pair"].second["k"].append(2)
        slotted.tag.append("y")
        self.assertEqual(staged["opts"], {"betas": [0.9, 0.95], "names": {"a", "b"}})
        self.assertEqual(staged["pair"].second, {"k": [1]})
        self.assertEqual(staged["slotted"].tag, ["x"])
        stager.close()

    def test_objects_that_copy_themselves(self):
        t = torch.randn(4)
        sd = {"rebuilt": Rebuilt(t), "own": OwnCopy(t), "t": t}
        stager = ot.AsyncStager()
        staged = stager.stage(sd)
        self.assertIs(type(staged["rebuilt"]), Rebuilt)
        self.assertTrue(torch.equal(staged["rebuilt"].t, t))
        self.assertNotEqual(storage_ptr(staged["rebuilt"].t), storage_ptr(t))
        self.assertTrue(torch.equal(staged["own"].t, t + 1))  # its __deepcopy__ decides
        self.assertTrue(torch.equal(staged["t"], t))
        t.add_(1.0)
        self.assertFalse(torch.equal(staged["rebuilt"].t, t))
        stager.close()

    def test_staged_memory_goes_with_the_staged_dict(self):
        import gc
        from ofl.torch.checkpoint import _StagedSet

        def live():
            return sum(1 for o in gc.get_objects() if type(o) is _StagedSet)
        stager = ot.AsyncStager()
        gc.collect()
        before = live()
        gc.disable()  # no cycle may hold the staged set: it goes when the dict does
        try:
            staged = stager.stage({"h": Holder(t=torch.randn(8)), "l": [torch.randn(4)]})
            self.assertEqual(live(), before + 1)
            del staged
            self.assertEqual(live(), before)
        finally:
            gc.enable()
        stager.close()

    def test_errors_name_the_call(self):
        stager = ot.AsyncStager()
        with self.assertRaisesRegex(ValueError, r"AsyncStager.stage: state_dict\['m'\]\['x'\]"):
            stager.stage({"m": {"x": torch.empty(3, device="meta")}})
        with self.assertRaisesRegex(ValueError, r"AsyncStager.stage: .*sparse"):
            stager.stage({"s": [torch.eye(3).to_sparse()]})
        ok = stager.stage({"x": torch.ones(2)})  # still usable after a refused stage
        self.assertTrue(torch.equal(ok["x"], torch.ones(2)))
        stager.close()
        with self.assertRaisesRegex(RuntimeError, "AsyncStager.stage: .*closed"):
            stager.stage({"x": torch.ones(2)})
        cached = ot.AsyncStager(cache_staged_state_dict=True, type_check=True)
        cached.stage({"a": torch.ones(2), "b": torch.ones(3)})
        with self.assertRaisesRegex(RuntimeError, r"AsyncStager.stage.*state_dict\['b'\]"):
            cached.stage({"a": torch.ones(2), "b": torch.ones(4)})
        cached.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
