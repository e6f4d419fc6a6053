"""What the three examples share: a small deterministic model, its data, and
the bitwise comparison of two training runs (losses, weights, gradients)."""
import torch
from torch import nn

VOCAB, DIM, SEQ = 64, 64, 32


class Block(nn.Module):
    """One transformer-like layer: attention and an MLP, each with a norm."""

    def __init__(self, dim):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def attention(self, x):
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        w = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        return self.proj(w @ v)

    def mlp(self, x):
        return self.fc2(torch.nn.functional.silu(self.fc1(self.mlp_norm(x))))

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(layers))
        self.output = nn.Linear(DIM, VOCAB)  # the head: torchtune's name

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def fresh_model(cls=TinyLM, **kw):
    torch.manual_seed(0)
    return cls(**kw)


def batches(steps, batch=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(steps)]


def loss_of(logits, tokens):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def snapshot(model, losses):
    """Everything a run produced, as bytes."""
    out = {"losses": torch.tensor(losses)}
    for name, p in model.named_parameters():
        out["w." + name] = p.detach().clone()
        out["g." + name] = p.grad.detach().clone()
    return out


def same_bits(a, b):
    """The names whose bytes differ between two snapshots."""
    diff = [k for k in a if a[k].view(torch.uint8).ne(b[k].view(torch.uint8)).any()]
    return diff + sorted(set(a) ^ set(b))


def report(base, offl, offloaded_bytes):
    diff = same_bits(base, offl)
    print("offloaded %d bytes" % offloaded_bytes)
    print("bitwise equal to no offload (losses, weights, gradients): %s"
          % ("yes" if not diff else "NO: " + ", ".join(diff[:5])))
    return 0 if not diff and offloaded_bytes > 0 else 1
