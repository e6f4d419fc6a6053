"""Megatron-Core style: a layer marks the modules whose activations go, with
Megatron's own calls (0.16.1's names; main's ``group_offload`` works too).

    OFL_BACKEND=host python3 examples/torch/megatron_markers.py

What this shows, as Megatron's layers do it:
  * the off switch: ``FineGrainedActivationOffloadingInterface(False, x, name)``
    passes x through, and the commit is guarded by the same flag
    (``if offload: y = group_commit(y, name)``): a commit without its start
    is an error;
  * the requires-grad rule: the tensor a group starts on must require grad
    (here the embedding's output and what follows it; the token ids would
    not do), since the group's backward markers ride on its gradient;
  * per microbatch ``init_chunk_handler``, per schedule call ``reset()``;
  * the auto plan (``--auto``): the manager chooses which modules go to keep
    the activation peak within ``memory_target``. It can only choose among
    the modules that carry markers: in Megatron the layers place them only
    for names listed in ``offload_modules`` (``--offload-modules``), so list
    every candidate there and let ``offload_modules="auto"`` on the manager
    decide. The manager's ``stats()["plan"]`` says what it chose."""
import sys

import torch

import ofl.torch as ot
from common import Block, TinyLM, batches, fresh_model, loss_of, report, snapshot

STEPS, MICROBATCHES = 3, 2
# Megatron's config.offload_modules: the names this model places markers for.
OFFLOAD_MODULES = ["core_attn", "mlp"]


class MarkedBlock(Block):
    def __init__(self, dim, offload_modules=()):
        super().__init__(dim)
        self.offload_modules = set(offload_modules)

    def marked(self, fn, x, name):
        offload = name in self.offload_modules  # Megatron's flag per module
        with ot.FineGrainedActivationOffloadingInterface(offload, x, name) as x:
            y = fn(x)
        if offload:  # the off switch guards the commit too
            y = ot.fine_grained_offloading_group_commit(y, name, forced_released_tensors=[])
        return y

    def forward(self, x):
        x = x + self.marked(self.attention, x, "core_attn")
        return x + self.marked(self.mlp, x, "mlp")


class MarkedLM(TinyLM):
    def __init__(self, offload_modules=()):
        super().__init__()
        for i in range(len(self.layers)):
            self.layers[i] = MarkedBlock(self.layers[i].qkv.in_features, offload_modules)


def train(offload_modules):
    # Megatron's --fine-grained-activation-offloading: the schedule calls
    # init_chunk_handler and reset only when it is on
    enabled = bool(offload_modules)
    model = fresh_model(MarkedLM, offload_modules=offload_modules)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens in batches(STEPS, batch=2 * MICROBATCHES):
        opt.zero_grad()
        # every microbatch's forward, then their backwards in reverse order,
        # as a pipeline stage runs them while microbatches are in flight
        mb_losses = []
        for mb in tokens.chunk(MICROBATCHES):
            if enabled:  # one chunk per microbatch; tensors under 1024 elements stay
                ot.init_chunk_handler(vp_size=1, vp_stage=0, min_offloaded_tensor_size=1024)
            mb_losses.append(loss_of(model(mb[:, :-1]), mb) / MICROBATCHES)
        for loss in reversed(mb_losses):
            loss.backward()
        losses += [loss.item() for loss in mb_losses]
        if enabled:
            ot.reset()  # end of the schedule call: the first one ends the warmup
        opt.step()
    return snapshot(model, losses)


def main():
    auto = "--auto" in sys.argv[1:]
    base = train(offload_modules=[])  # every flag off: markers pass through
    if auto:
        # memory_target: activation bytes this rank may keep at its peak
        mgr = ot.PipelineOffloadManager.reset_instance(offload_modules="auto", memory_target="512K")
    else:
        mgr = ot.PipelineOffloadManager.reset_instance()
    offl = train(offload_modules=OFFLOAD_MODULES)
    st = mgr.stats()
    if auto:
        plan = st["plan"]
        print("auto plan: target %d bytes, predicted peak %d, measured since its last change %d"
              % (plan["target_bytes"], plan["predicted_peak_bytes"],
                 plan["measured_peak_settled_bytes"]))
        print("  (everything offloaded: %d, nothing: %d)" % (plan["peak_all_bytes"], plan["peak_none_bytes"]))
        for n in plan["names"]:
            print("  %-10s %d of %d groups offloaded" % (n["name"], n["chosen"], n["groups"]))
    ot.PipelineOffloadManager.destroy_instance()  # start over for another model
    return report(base, offl, st["offloaded_bytes"])


if __name__ == "__main__":
    sys.exit(main())
