"""torchtune / Axolotl style: every activation saved inside the ``with`` block
is offloaded while the forward runs and reloaded for the backward.

    OFL_BACKEND=host python3 examples/torch/offload_activations.py

The object ``offload_activations`` returns is the context: enter it every step
(or make a new one every step, ``with ot.offload_activations(model):``), and
ask it for ``stats()``. torchtune's spelling is the same object:
``ot.OffloadActivations(model=model)``."""
import sys

import torch

import ofl.torch as ot
from common import batches, fresh_model, loss_of, report, snapshot

STEPS = 4


def train(offload):
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # min_offload_size: tensors under it stay (bytes; torchtune's default is
    # 1024); the model's output head stays on the device by torchtune's rule.
    ctx = ot.offload_activations(model, min_offload_size=1024) if offload else None
    losses = []
    for tokens in batches(STEPS):
        opt.zero_grad()
        if ctx is not None:
            with ctx:
                loss = loss_of(model(tokens[:, :-1]), tokens)
        else:
            loss = loss_of(model(tokens[:, :-1]), tokens)
        loss.backward()  # the iteration ends with its backward
        opt.step()
        losses.append(loss.item())
    return snapshot(model, losses), (ctx.stats() if ctx is not None else None)


def main():
    base, _ = train(offload=False)
    offl, stats = train(offload=True)
    print("iterations %d, offloaded tensors %d" % (stats["iterations"], stats["offloaded_tensors"]))
    return report(base, offl, stats["offloaded_bytes"])


if __name__ == "__main__":
    sys.exit(main())
