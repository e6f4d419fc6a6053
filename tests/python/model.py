"""A small transformer from torch.nn for the ofl.torch tests and bench:
embedding, 2 pre-norm layers (attention, MLP), a final norm and an output
Linear. ``offload`` selects the Megatron-style groups of interface 1."""
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import ofl.torch as ot


class Layer(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def core_attn(self, q, k, v):
        b, s, d = q.shape
        h = self.heads

        def split(t):
            return t.view(b, s, h, d // h).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(b, s, d)

    def forward(self, x, offload=False):
        start = ot.FineGrainedActivationOffloadingInterface
        commit = ot.fine_grained_offloading_group_commit if offload else (lambda t, *a, **k: t)
        # attention: one group for norm+qkv, one for the core attention
        with start(offload, x, "qkv_linear") as h:
            q, k, v = self.qkv(self.attn_norm(h)).chunk(3, dim=-1)
        q, k, v = commit((q, k, v), "qkv_linear")
        with start(offload, q, "core_attn") as qq:
            a = self.core_attn(qq, k, v)
        a = commit(a, "core_attn")
        x = x + self.proj(a)
        # MLP: the norm's output is the group's input and is force-released
        n = self.mlp_norm(x)
        with start(offload, n, "expert_fc1") as h:
            y = self.fc2(F.gelu(self.fc1(h)))
        y = commit(y, "expert_fc1", forced_released_tensors=[n])
        return x + y


class TinyTransformer(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, ff=64, layers=2, seq=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.ModuleList([Layer(d, heads, ff) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, vocab)

    def forward(self, tokens, targets, offload=False):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, offload)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_data(steps, microbatches, batch, seq, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, vocab, (batch, seq), generator=g),
              torch.randint(0, vocab, (batch, seq), generator=g))
             for _ in range(microbatches)] for _ in range(steps)]


def one_f_one_b(model, mbs, offload, warmup_fwd=2, min_size=1):
    """A 1F1B-like schedule over the microbatches of one step (as a pipeline
    stage with `warmup_fwd` microbatches in flight runs it): forwards run
    ahead, then one forward, one backward. Returns the losses."""
    n = len(mbs)
    losses = [None] * n
    pending = []
    f = 0

    def forward(i):
        if offload:
            ot.init_chunk_handler(1, 0, min_size)
        loss = model(*mbs[i], offload=offload)
        losses[i] = loss.detach().clone()
        pending.append(loss / n)

    def backward():
        pending.pop(0).backward()

    while f < min(warmup_fwd, n):
        forward(f)
        f += 1
    while f < n:
        forward(f)
        f += 1
        backward()
    while pending:
        backward()
    if offload:
        ot.reset()
    return losses


def train(model, data, loop, lr=0.05):
    """Runs `loop(model, microbatches)` per step with SGD; returns the losses
    and the gradients of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    all_losses, all_grads = [], []
    for mbs in data:
        opt.zero_grad(set_to_none=True)
        all_losses.append(loop(model, mbs))
        all_grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return all_losses, all_grads


@contextlib.contextmanager
def nothing():
    yield
