#!/usr/bin/env python3
"""The project's schedule generator (examples/pipeline_demo/schedule.c, run
through schedule_order_writer) against Megatron-Core's own order of steps,
for 1F1B and interleaved 1F1B over a grid of pp, vpp and microbatches
(microbatches == pp included). TAP, one test per (pp, vpp, microbatches).

Megatron's order is taken from its code: the warmup count from
megatron.core.pipeline_parallel.schedules.get_pp_rank_microbatches and the
virtual microbatch layout from get_schedule_table (with Megatron's default
microbatch_group_size_per_vp_stage, pp), played by the loops of
forward_backward_pipelining_with_interleaving / _without_interleaving: the
warmup forwards, then a forward and a backward per steady step, then the
cooldown backwards; a backward on chunk c takes the oldest forward on c
whose backward has not run (Megatron pops input_tensors[c] from the front).
Skips (exit 77) where megatron.core is not installed.

usage: check_megatron_schedule.py WRITER
"""
import collections
import inspect
import os
import subprocess
import sys
import types
import warnings


def load_megatron():
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")
    try:
        from megatron.core.pipeline_parallel import schedules
    except Exception as e:  # not installed, or torch missing
        print(f"1..0 # SKIP megatron.core not importable: {e}")
        sys.exit(77)
    return schedules


def megatron_order(schedules, pp, rank, vpp, mbs):
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    comm = types.SimpleNamespace(
        pp_group=group,
        virtual_pipeline_model_parallel_size=None if vpp == 1 else vpp)
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
        mbs, vpp, pp, forward_only=False, p2p_communicator=comm)
    if vpp == 1:
        # forward_backward_pipelining_without_interleaving's own count
        assert warmup == min(pp - rank - 1, mbs), (pp, rank, warmup)
    table = schedules.get_schedule_table(mbs, vpp, pp)
    chunk_of = [c for _, c in table]
    mb_of = [m for m, _ in table]
    pending = [collections.deque() for _ in range(vpp)]
    order = []

    def forward(k):
        c, m = chunk_of[k % total], mb_of[k]
        pending[c].append(m)
        order.append(f"F{c}.{m}")

    def backward(k):
        c = vpp - 1 - chunk_of[k % total]  # get_model_chunk_id(k, False)
        order.append(f"B{c}.{pending[c].popleft()}")

    for k in range(warmup):
        forward(k)
    for k in range(remaining):
        forward(k + warmup)
        backward(k)
    for k in range(remaining, total):
        backward(k)
    return order


def grid():
    for pp in range(1, 9):
        for mbs in sorted({1, 2, pp, pp + 1, 2 * pp, 3 * pp + 1}):
            yield pp, 1, mbs
    for pp in range(2, 9):  # interleaving needs a pipeline
        for vpp in range(2, 5):
            for k in (1, 2, 3):  # microbatches a multiple of pp; k 1 is == pp
                yield pp, vpp, pp * k


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    schedules = load_megatron()
    for name in ("get_pp_rank_microbatches", "get_schedule_table"):
        if not inspect.isfunction(getattr(schedules, name, None)):
            print(f"1..0 # SKIP this megatron.core has no {name}")
            return 77
    cases = list(grid())
    args = [str(x) for case in cases for x in case]
    out = subprocess.run([sys.argv[1]] + args, check=True,
                         capture_output=True, text=True).stdout
    ours = {}
    for line in out.splitlines():
        key, _, steps = line.partition(":")
        ours[tuple(int(x) for x in key.split())] = steps.split()
    print(f"1..{len(cases)}")
    failed = 0
    for i, (pp, vpp, mbs) in enumerate(cases, 1):
        bad = []
        for rank in range(pp):
            want = megatron_order(schedules, pp, rank, vpp, mbs)
            got = ours.get((pp, vpp, mbs, rank))
            if got != want:
                bad.append(f"rank {rank}: megatron {' '.join(want)} | "
                           f"ofl {' '.join(got or ['(none)'])}")
        kind = "1F1B" if vpp == 1 else "interleaved"
        name = f"{kind} pp {pp} vpp {vpp} microbatches {mbs}"
        if bad:
            failed += 1
            print(f"not ok {i} - {name}")
            for b in bad:
                print(f"# {b}")
        else:
            print(f"ok {i} - {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
