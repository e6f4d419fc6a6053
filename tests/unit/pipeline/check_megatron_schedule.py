#!/usr/bin/env python3
"""The project's schedule generator (examples/pipeline_demo/schedule.c, run
through schedule_order_writer) against Megatron-Core's own order of steps,
for 1F1B and interleaved 1F1B over a grid of pp, vpp and microbatches
(microbatches == pp included). TAP, one test per (pp, vpp, microbatches).

Megatron's order is what its schedule functions do: for each rank,
forward_backward_pipelining_without_interleaving (vpp 1) or
forward_backward_pipelining_with_interleaving (vpp > 1, Megatron's default
microbatch_group_size_per_vp_stage, pp) runs in this process with its
forward_step and backward_step replaced by recorders (the forward's output
carries its chunk and microbatch, so a backward names the forward it
undoes), a pipeline communicator whose sends and receives move nothing, and
a config whose other settings are off. Skips (exit 77) where megatron.core
is not installed.

usage: check_megatron_schedule.py WRITER
"""
import os
import subprocess
import sys
import types
import warnings


def load_megatron():
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")
    try:
        import torch
        from megatron.core.pipeline_parallel import schedules
    except Exception as e:  # not installed, or torch missing
        print(f"1..0 # SKIP megatron.core not importable: {e}")
        sys.exit(77)
    return torch, schedules


class Config:
    """Megatron's model-parallel config: the settings given, None (off) for
    every other one the schedules read."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class Communicator:
    """P2PCommunicator with nothing to move: every receive gets None (a
    list of them where 1F1B passes a list of tensor shapes)."""

    def __init__(self, pp, rank, vpp, config):
        self.pp_group = Group(pp, rank)
        self.config = config
        self.virtual_pipeline_model_parallel_size = vpp

    def __getattr__(self, name):
        def exchange(*args, **kwargs):
            if name == "send_forward_backward_recv_forward_backward":
                return None, None
            shapes = [a for a in args if isinstance(a, list) and a
                      and isinstance(a[0], (list, tuple))]
            return [None] * len(shapes[0]) if shapes else None
        return exchange


class Output:
    def __init__(self, chunk, mb):
        self.chunk, self.mb = chunk, mb


def megatron_order(torch, schedules, pp, rank, vpp, mbs):
    steps = []

    def forward_step(forward_step_func, data_iterator, model,
                     num_microbatches, input_tensor, forward_data_store,
                     config, *args, current_microbatch=None, vp_stage=None,
                     **kwargs):
        chunk = vp_stage or 0
        steps.append(f"F{chunk}.{current_microbatch}")
        out = Output(chunk, current_microbatch)
        # forward_step's own convention: a list in, a list out
        return ([out] if isinstance(input_tensor, list) else out), torch.tensor(0)

    def backward_step(input_tensor, output_tensor, output_tensor_grad,
                      model_type, config):
        if isinstance(output_tensor, list):
            output_tensor = output_tensor[0]
        steps.append(f"B{output_tensor.chunk}.{output_tensor.mb}")
        return None

    class Torch:  # the accumulated token count without a GPU
        def __getattr__(self, name):
            return getattr(torch, name)

        def zeros(self, *args, **kwargs):
            kwargs.pop("device", None)
            return torch.zeros(*args, **kwargs)

    config = Config(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        microbatch_group_size_per_vp_stage=pp, hidden_size=8,
        sequence_parallel=False, overlap_p2p_comm=False,
        batch_p2p_comm=False, overlap_moe_expert_parallel_comm=False,
        variable_seq_lengths=False, deallocate_pipeline_outputs=False,
        calculate_per_token_loss=False)
    schedules.forward_step = forward_step
    schedules.backward_step = backward_step
    schedules.torch = Torch()
    schedules.get_model_config = lambda model: config
    schedules.get_model_type = lambda model: schedules.ModelType.encoder_or_decoder
    comm = Communicator(pp, rank, vpp if vpp > 1 else None, config)
    groups = types.SimpleNamespace(tp=Group(1, 0), cp=Group(1, 0), embd=None,
                                   pos_embd=None, pp=comm.pp_group,
                                   dp_cp=Group(1, 0))
    chunks = [torch.nn.Module() for _ in range(vpp)]
    common = dict(forward_step_func=None, num_microbatches=mbs, seq_length=4,
                  micro_batch_size=1, forward_only=False,
                  p2p_communicator=comm, pg_collection=groups)
    if vpp > 1:
        schedules.forward_backward_pipelining_with_interleaving(
            data_iterator=[None] * vpp, model=chunks, **common)
    else:
        schedules.forward_backward_pipelining_without_interleaving(
            data_iterator=None, model=chunks[0], **common)
    return steps


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
    torch, schedules = load_megatron()
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
            try:
                want = megatron_order(torch, schedules, pp, rank, vpp, mbs)
            except Exception as e:  # the stubs no longer fit this version
                want = [f"(megatron raised {type(e).__name__}: {e})"]
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
