#!/usr/bin/env python3
"""ofl.torch benchmark: per-saved-tensor hook overhead and training-step time.

  OFL_LIBRARY=build/libofl.so python3 bench/bench_torch_hooks.py

(python/ from this checkout; ofl._ext from the same build, build/python/ofl,
when it was built there.)

1. Hook overhead: N small tensors saved (pack) and unpacked (unpack) through
   ofl's hooks (one group of N tensors, pushed, committed, popped), against
   torch.autograd.graph.save_on_cpu and against no hooks (default saving).
   ofl's hooks (ofl._ext, the one implementation: PYTHONPATH must name
   <build>/python after python/, or the package be pip-installed).
   Printed in microseconds per tensor (pack+unpack calls, the best of 5
   rounds), with the ratio to save_on_cpu and the overhead over no hooks;
   "round" adds the group's commit and backward markers, the release of
   the unpacked tensors and the manager's reset, per tensor.
2. Step time of the small transformer of tests/python (forward+backward+SGD)
   without offload, with torch's save_on_cpu, with ofl's offload_activations
   and with the Megatron-style groups, and the bytes offloaded per step.
"""
import os
import sys
import time

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "python"))
sys.path.insert(0, os.path.join(here, "..", "python"))
# ofl._ext of the build whose libofl runs (<build>/python/ofl), when built
_lib_dir = os.path.dirname(os.environ.get("OFL_LIBRARY", ""))
if _lib_dir and os.path.isdir(os.path.join(_lib_dir, "python", "ofl")):
    sys.path.append(os.path.join(_lib_dir, "python"))
os.environ.setdefault("OFL_BACKEND", "host")

import ofl.torch as ot  # noqa: E402
from ofl.torch import _core  # noqa: E402
from model import TinyTransformer, make_data, one_f_one_b  # noqa: E402

torch.set_num_threads(int(os.environ.get("OFL_BENCH_THREADS", "1")))


def hook_overhead(n=2000, shape=(16, 16), reps=5):
    """{variant: (us per tensor in the pack and unpack calls, us per tensor
    of the whole round)}."""
    xs = [torch.randn(shape) for _ in range(n)]
    clock = time.perf_counter

    def ofl_round(core):
        t0 = clock()
        core.chunk_begin(1, 0)
        core.group_start(b"g")
        t1 = clock()
        packed = [core.pack(x) for x in xs]
        t2 = clock()
        core.commit(b"g")
        core.backward_begin(b"g")
        t3 = clock()
        out = [core.unpack(p) for p in reversed(packed)]
        t4 = clock()
        core.backward_end(b"g")
        del out, packed
        core.reset()
        t5 = clock()
        return (t2 - t1) + (t4 - t3), t5 - t0

    def cpu_round():
        # save_on_cpu's own pack/unpack functions, called the same way
        t0 = clock()
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=False)
        pack, unpack = ctx.pack_hook, ctx.unpack_hook
        t1 = clock()
        packed = [pack(x) for x in xs]
        out = [unpack(p) for p in reversed(packed)]
        t2 = clock()
        del out, packed
        return t2 - t1, clock() - t0

    def none_round():
        t0 = clock()
        packed = [x for x in xs]
        out = [p for p in reversed(packed)]
        t1 = clock()
        del out, packed
        return t1 - t0, clock() - t0

    variants = [("no hooks", none_round, None), ("save_on_cpu", cpu_round, None)]
    if _core.hooks_backend == "c":
        variants.append(("ofl C (_ext)", ofl_round, _core.ManagerCore))
    res = {}
    for name, fn, cls in variants:
        core = None
        if cls is not None:
            core = cls(groups=b"", fraction=1.0, rank_delta_bytes=0, summary=False)
            core.min_bytes = 1
            args = (core,)
        else:
            args = ()
        fn(*args)  # the manager's warmup
        runs = [fn(*args) for _ in range(reps)]
        res[name] = (min(r[0] for r in runs) / n * 1e6, min(r[1] for r in runs) / n * 1e6)
        if core is not None:
            core.close()
    return res


def steps(model, loop, data, n):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loop(model, data[i % len(data)])
        opt.step()
        times.append(time.perf_counter() - t0)
    times = times[2:]  # warmup
    return sorted(times)[len(times) // 2] * 1e3


def main():
    n = int(os.environ.get("OFL_BENCH_TENSORS", "2000"))
    res = hook_overhead(n)
    print("== per-saved-tensor hook cost (%d tensors of 1 KiB, host backend; hooks: %s)"
          % (n, _core.hooks_backend_reason))
    print("%-14s %12s %12s %12s %12s" % ("", "us/tensor", "/save_on_cpu", "over none", "round us"))
    soc, none = res["save_on_cpu"][0], res["no hooks"][0]
    for k, (v, rnd) in res.items():
        print("%-14s %12.2f %12.2f %12.2f %12.2f" % (k, v, v / soc, v - none, rnd))
    if "ofl C (_ext)" not in res:
        print("ofl: not measured (%s)" % _core.hooks_backend_reason)

    d, seq, batch = int(os.environ.get("OFL_BENCH_D", "256")), 128, 4
    data = make_data(steps=2, microbatches=2, batch=batch, seq=seq, vocab=256)

    def plain(m, mbs):
        for tok, tgt in mbs:
            (m(tok, tgt) / len(mbs)).backward()

    def soc(m, mbs):
        for tok, tgt in mbs:
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                loss = m(tok, tgt)
            (loss / len(mbs)).backward()

    ctx = ot.offload_activations(min_offload_size=1024)

    def offl(m, mbs):
        for tok, tgt in mbs:
            with ctx:
                loss = m(tok, tgt)
            (loss / len(mbs)).backward()

    mgr = ot.PipelineOffloadManager.reset_instance(summary=False)

    def mega(m, mbs):
        one_f_one_b(m, mbs, offload=True, min_size=256)

    iters = int(os.environ.get("OFL_BENCH_STEPS", "12"))
    print("== training step, transformer d=%d seq=%d batch=%d x 2 microbatches, median of %d"
          % (d, seq, batch, iters - 2))
    for name, loop, stats in (("no offload", plain, None), ("save_on_cpu", soc, None),
                              ("ofl offload_activations", offl, ctx.stats),
                              ("ofl megatron groups", mega, mgr.stats)):
        torch.manual_seed(0)
        model = TinyTransformer(vocab=256, d=d, heads=8, ff=4 * d, layers=2, seq=seq)
        before = stats()["offloaded_bytes"] if stats else 0
        ms = steps(model, loop, data, iters)
        per = ((stats()["offloaded_bytes"] - before) / iters) if stats else 0
        print("%-24s %9.2f ms/step  %10.2f MiB offloaded/step" % (name, ms, per / 2**20))
    ctx.close()
    ot.PipelineOffloadManager.destroy_instance()


def per_tensor_on_a_step():
    """A small GPT step (the tests' transformer, d=64, seq=64, batch 4, 2
    layers): ofl's time per saved tensor it offloads, above the two copies
    it makes of those bytes (to its pool and back: timed here as two plain
    copy_ of each offloaded tensor's bytes into buffers allocated before),
    against save_on_cpu and no hooks. Medians over the steps."""
    d, seq, batch, reps = 64, 64, 4, int(os.environ.get("OFL_BENCH_STEPS", "40"))
    min_size = 1024
    (tok, tgt), = make_data(steps=1, microbatches=1, batch=batch, seq=seq, vocab=128)[0]
    torch.manual_seed(0)
    model = TinyTransformer(vocab=128, d=d, heads=4, ff=4 * d, layers=2, seq=seq)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    ctx = ot.offload_activations(min_offload_size=min_size)

    def step(kind):
        opt.zero_grad(set_to_none=True)
        if kind == "none":
            loss = model(tok, tgt)
        elif kind == "soc":
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                loss = model(tok, tgt)
        else:
            with ctx:
                loss = model(tok, tgt)
        loss.backward()
        opt.step()

    # the tensors ofl offloads in a step: their sizes, for the copy floor
    st0 = ctx.stats()
    step("ofl")
    step("ofl")
    st1 = ctx.stats()
    n = (st1["offloaded_tensors"] - st0["offloaded_tensors"]) // 2
    nbytes = (st1["offloaded_bytes"] - st0["offloaded_bytes"]) // 2
    sizes = []

    def spy(t):
        if (type(t) is torch.Tensor and t.numel() * t.element_size() >= min_size
                and not t.is_conj() and not t.is_neg()):
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(spy, lambda t: t):
        loss = model(tok, tgt)
    del loss
    srcs = [torch.empty(b, dtype=torch.uint8) for b in sizes]
    mids = [torch.empty(b, dtype=torch.uint8) for b in sizes]

    def floor():
        for a, b in zip(srcs, mids):
            b.copy_(a)
        for a, b in zip(srcs, mids):
            a.copy_(b)

    clock, cpu = time.perf_counter, time.process_time
    times = {"none": [], "soc": [], "ofl": [], "floor": []}
    cpus = {k: [] for k in times}
    for _ in range(reps):  # interleaved, so that drift hits every variant
        for kind in ("none", "soc", "ofl"):
            t0, c0 = clock(), cpu()
            step(kind)
            times[kind].append(clock() - t0)
            cpus[kind].append(cpu() - c0)
        t0, c0 = clock(), cpu()
        floor()
        times["floor"].append(clock() - t0)
        cpus["floor"].append(cpu() - c0)
    med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
    # On a loaded machine the median moves with the load; the fastest step
    # and the process's CPU time (every thread) move less.
    best = {k: min(v) * 1e6 for k, v in times.items()}
    cmed = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in cpus.items()}
    print("== per saved tensor on a small GPT step (d=%d seq=%d batch=%d, 2 layers; median of "
          "%d steps; host backend, hooks: %s)" % (d, seq, batch, reps, _core.hooks_backend))
    print("offloaded per step: %d tensors, %.1f KiB (spy saw %d tensors, %.1f KiB)"
          % (n, nbytes / 1024, len(sizes), sum(sizes) / 1024))
    print("%-28s %10s %12s" % ("", "us/step", "us/tensor"))
    for k, label in (("none", "no hooks"), ("soc", "save_on_cpu(pin_memory=False)"),
                     ("ofl", "ofl offload_activations"), ("floor", "copy floor (2 x copy_)")):
        print("%-28s %10.1f %12.2f" % (label, med[k], med[k] / max(n, 1)))
    over = (med["ofl"] - med["none"] - med["floor"]) / max(n, 1)
    print("ofl above no hooks and the copy floor: %.2f us per saved tensor (goal < 10)" % over)
    print("save_on_cpu above no hooks: %.2f us per saved tensor; ofl/none %.3f, soc/none %.3f"
          % ((med["soc"] - med["none"]) / max(n, 1), med["ofl"] / med["none"],
             med["soc"] / med["none"]))
    for label, v in (("fastest step", best), ("CPU time (all threads), median", cmed)):
        print("%s: ofl above no hooks and the copy floor %.2f us per saved tensor; "
              "ofl/none %.3f, soc/none %.3f"
              % (label, (v["ofl"] - v["none"] - v["floor"]) / max(n, 1),
                 v["ofl"] / v["none"], v["soc"] / v["none"]))
    ctx.close()


if __name__ == "__main__":
    if "--step-only" in sys.argv:
        per_tensor_on_a_step()
    else:
        main()
        per_tensor_on_a_step()
