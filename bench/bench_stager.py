#!/usr/bin/env python3
"""ofl.torch benchmark: AsyncStager.stage() against torch's stagers.

  OFL_LIBRARY=build/libofl.so python3 bench/bench_stager.py

(python/ from this checkout; host backend unless OFL_BACKEND says otherwise.)

A ~90 MB state dict shaped like a model's and its optimizer's: a few large
tensors (an embedding and its tied head, two flat buffers), 32 layers of
mixed sizes and dtypes, optimizer state with many small tensors and step
counters, a dataclass and a namedtuple leaf, and views of one base. Every
stager stages the same dict; printed is the time until stage() returns
(the staged dict is complete then: all of them copy before returning), the
median and the best of OFL_BENCH_RUNS runs (7) after one warmup, the stagers
taking turns, and the median's ratio to torch's
default stager, the one dcp.async_save creates when given none
(DefaultStager(StagingOptions(False, False, False, False)), a new one per
save). torch runs OFL_BENCH_THREADS threads (1; ofl copies on its own
stream's thread).

Two settings:
  fresh   a new stager per stage, as dcp.async_save's own default does;
  reused  one stager for every stage: torch's StateDictStager keeps its
          staged storages while the sources live (DefaultStager too), ofl's
          AsyncStager keeps them with cache_staged_state_dict=True, torch's
          BlockingAsyncStager likewise (its cache is pinned memory: measured
          where cuda is available).
"""
import collections
import dataclasses
import os
import statistics
import sys
import time

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
os.environ.setdefault("OFL_BACKEND", "host")

import ofl.torch as ot  # noqa: E402

try:
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
except ImportError:  # older torch
    StateDictStager = None
from torch.distributed.checkpoint import staging as _staging  # noqa: E402

torch.set_num_threads(int(os.environ.get("OFL_BENCH_THREADS", "1")))


@dataclasses.dataclass
class Leaf:
    weight: torch.Tensor
    scale: float


Moments = collections.namedtuple("Moments", "exp_avg exp_avg_sq")


def make_state(seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    embed = r(6144, 512)  # 12 MiB
    model = {"embed.weight": embed, "lm_head.weight": embed,  # tied
             "buf0": r(3 << 20), "buf1": r(3 << 20)}  # 12 MiB each
    for i in range(32):
        model["layers.%d" % i] = {
            "attn.qkv": r(256, 768), "attn.proj": r(256, 256),
            "mlp.up": r(256, 512, dtype=torch.bfloat16), "mlp.down": r(512, 256),
            "norm.weight": r(256), "norm.bias": r(256), "ids": torch.arange(64)}
    base = r(64, 64)
    model["views"] = [base, base[8:16], base[:, 3], base.view(-1)[100:200]]
    model["leaf"] = Leaf(r(128, 128), 0.5)
    optim = {"state": {i: {"step": torch.tensor(10.0), "exp_avg": r(64 + 16 * (i % 64)),
                           "exp_avg_sq": r(64 + 16 * (i % 64))} for i in range(600)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(range(600))}],
             "moments": Moments(r(1024, 128), r(1024, 128))}
    return {"model": model, "optim": optim, "step": 1000, "rng": "seed-%d" % seed}


def state_bytes(sd):
    seen, total = set(), 0

    def walk(o):
        nonlocal total
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif dataclasses.is_dataclass(o):
            walk(vars(o))
    walk(sd)
    return total


def time_stages(makers, sd, runs, fresh):
    """{name: (median, min) seconds of stage()}; make() gives a stager. The
    stagers take turns, run by run, so that a busy spell of the machine
    falls on all of them."""
    kept = {name: None if fresh else make() for name, make in makers}
    times = {name: [] for name, _ in makers}
    for i in range(runs + 1):
        for name, make in makers:
            s = make() if fresh else kept[name]
            t0 = time.perf_counter()
            out = s.stage(sd)
            if hasattr(out, "result"):  # a Future (async staging)
                out = out.result()
            dt = time.perf_counter() - t0
            del out
            if fresh:
                s.close()
            if i:  # the first is a warmup
                times[name].append(dt)
    for s in kept.values():
        if s is not None:
            s.close()
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def stagers(fresh):
    v = []
    if hasattr(_staging, "DefaultStager"):
        v.append(("torch DefaultStager (default)", lambda: _staging.DefaultStager(
            _staging.StagingOptions(False, False, False, False))))
    if StateDictStager is not None:
        v.append(("torch StateDictStager", StateDictStager))
    if fresh or torch.cuda.is_available():  # its cache is pinned memory, cuda only
        v.append(("torch BlockingAsyncStager", lambda: _staging.BlockingAsyncStager(
            cache_staged_state_dict=not fresh)))
    v.append(("ofl AsyncStager", lambda: ot.AsyncStager(cache_staged_state_dict=not fresh)))
    return v


def main():
    runs = int(os.environ.get("OFL_BENCH_RUNS", "7"))
    sd = make_state()
    mib = state_bytes(sd) / 2**20
    print("== stage() of a %.1f MiB state dict, torch %s, %d threads, ofl backend %s, "
          "%d runs" % (mib, torch.__version__, torch.get_num_threads(), os.environ["OFL_BACKEND"],
                       runs))
    for fresh in (True, False):
        res = time_stages(stagers(fresh), sd, runs, fresh)
        ref = (res.get("torch DefaultStager (default)") or res["torch StateDictStager"])[0]
        print("-- %s" % ("a new stager per stage (ofl: cache_staged_state_dict=False)" if fresh
                         else "one stager reused (ofl and BlockingAsyncStager: "
                              "cache_staged_state_dict=True)"))
        print("%-32s %10s %10s %10s %10s" % ("", "median ms", "min ms", "GB/s", "/default"))
        for name, (t, lo) in res.items():
            print("%-32s %10.2f %10.2f %10.2f %10.2f"
                  % (name, t * 1e3, lo * 1e3, mib * 2**20 / t / 1e9, t / ref))

if __name__ == "__main__":
    main()
