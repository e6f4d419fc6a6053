"""An async checkpoint through ofl's stager (PyTorch DCP's ``AsyncStager``):
``stage()`` takes a copy that later training cannot change, the save runs in
the background, and training goes on at once.

    OFL_BACKEND=host python3 examples/torch/async_checkpoint.py

The checkpoint must hold the values at ``stage()``, byte for byte, although
the optimizer changes every weight while the save runs; training itself must
be the same as without the checkpoint."""
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

import ofl.torch as ot
from common import batches, fresh_model, loss_of, same_bits, snapshot

STEPS, SAVE_AT = 6, 2
# one process, no torch.distributed: DCP says it assumes so
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def train(checkpoint_dir):
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stager = ot.AsyncStager() if checkpoint_dir else None
    future, at_save, losses = None, None, []
    for step, tokens in enumerate(batches(STEPS)):
        opt.zero_grad()
        loss = loss_of(model(tokens[:, :-1]), tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if stager is not None and step == SAVE_AT:
            at_save = {k: v.clone() for k, v in model.state_dict().items()}  # to check against
            future = dcp.async_save(model.state_dict(), checkpoint_id=checkpoint_dir,
                                    async_stager=stager, no_dist=True)
    if future is not None:
        future.result()  # the background save is done
    return snapshot(model, losses), at_save


def main():
    base, _ = train(None)
    with tempfile.TemporaryDirectory(prefix="ofl-ckpt-") as d:
        offl, at_save = train(d)
        back = {k: torch.zeros_like(v) for k, v in at_save.items()}
        dcp.load(back, checkpoint_id=d, no_dist=True)
    ckpt_diff = same_bits(at_save, back)
    train_diff = same_bits(base, offl)
    print("checkpoint holds the values at stage(): %s"
          % ("yes" if not ckpt_diff else "NO: " + ", ".join(ckpt_diff[:5])))
    print("bitwise equal to training without the checkpoint: %s"
          % ("yes" if not train_diff else "NO: " + ", ".join(train_diff[:5])))
    # the optimizer went on changing the weights while the save ran
    changed = any(not torch.equal(v, offl["w." + k]) for k, v in at_save.items())
    print("weights changed after the save: %s" % ("yes" if changed else "no"))
    return 0 if not ckpt_diff and not train_diff and changed else 1


if __name__ == "__main__":
    sys.exit(main())
