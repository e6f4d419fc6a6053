#!/usr/bin/env python3
"""ofl.torch benchmark: per-saved-tensor hook overhead and training-step time.

  OFL_LIBRARY=build/libofl.so PYTHONPATH=python python3 bench/bench_torch_hooks.py

1. Hook overhead: N small tensors saved (pack) and unpacked (unpack) through
   ofl's hooks (one group of N tensors, pushed, committed, popped), against
   torch.autograd.graph.save_on_cpu and against no hooks (default saving).
   Printed in microseconds per tensor (push+pop).
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
os.environ.setdefault("OFL_BACKEND", "host")

import ofl.torch as ot  # noqa: E402
from ofl.torch._core import ManagerCore  # noqa: E402
from model import TinyTransformer, make_data, one_f_one_b  # noqa: E402

torch.set_num_threads(int(os.environ.get("OFL_BENCH_THREADS", "1")))


def hook_overhead(n=2000, shape=(16, 16), reps=5):
    xs = [torch.randn(shape) for _ in range(n)]
    core = ManagerCore(groups=b"", fraction=1.0, rank_delta_bytes=0, summary=False)
    core.min_bytes = 1

    def ofl_round():
        core.chunk_begin(1, 0)
        core.group_start(b"g")
        t0 = time.perf_counter()
        packed = [core.pack(x) for x in xs]
        t1 = time.perf_counter()
        core.commit(b"g")
        core.backward_begin(b"g")
        t2 = time.perf_counter()
        out = [core.unpack(p) for p in reversed(packed)]
        t3 = time.perf_counter()
        core.backward_end(b"g")
        del out, packed
        core.reset()
        return (t1 - t0) + (t3 - t2)

    def cpu_round():
        # save_on_cpu's own pack/unpack functions, called the same way
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=False)
        pack, unpack = ctx.pack_hook, ctx.unpack_hook
        t0 = time.perf_counter()
        packed = [pack(x) for x in xs]
        out = [unpack(p) for p in reversed(packed)]
        return time.perf_counter() - t0

    def none_round():
        t0 = time.perf_counter()
        packed = [x for x in xs]
        out = [p for p in reversed(packed)]
        return time.perf_counter() - t0

    res = {}
    for name, fn in (("ofl hooks", ofl_round), ("save_on_cpu", cpu_round), ("no hooks", none_round)):
        fn()
        res[name] = min(fn() for _ in range(reps)) / n * 1e6
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
    print("== per-saved-tensor hook cost (push+pop, %d tensors of 1 KiB, host backend)" % n)
    for k, v in res.items():
        print("%-14s %8.2f us/tensor" % (k, v))
    print("ofl / save_on_cpu: %.2f; ofl overhead over no hooks: %.2f us/tensor"
          % (res["ofl hooks"] / res["save_on_cpu"], res["ofl hooks"] - res["no hooks"]))

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


if __name__ == "__main__":
    main()
