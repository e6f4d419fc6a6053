#!/usr/bin/env python3
"""ofl against the systems users run today, on real model code: one
invocation trains the same model under each method, each in its own
subprocess (a clean peak), and prints one markdown table per workload and a
capacity table.

Workloads:
  megatron  Megatron-Core's GPTModel (local spec) through Megatron's own
            schedule forward_backward_no_pipelining: no offload; Megatron's
            own fine-grained activation offloading (FGAO: CUDA and
            TransformerEngine); ofl swapped in by the README's one line;
            ofl's auto plan at a device memory target; Megatron's selective
            recompute.
  llama     torchtune's llama builder (random weights, no downloads): no
            offload; torch.autograd.graph.save_on_cpu; torchtune's
            OffloadActivations (CUDA streams); ofl's torchtune drop-in;
            ofl.torch.offload_activations; ofl's auto plan at a device
            memory target; per-layer activation checkpointing; torchtune's
            and ofl's offloading each with per-layer checkpointing; TE's CPU
            offload where TransformerEngine imports.

Per method: the peak torch.cuda.max_memory_allocated after the warmup steps
and its saving against no offload (CPU: "n/a on CPU"; ofl rows add ofl's
activation ledger), the median step time and its ratio to no offload,
tokens/s, the bytes offloaded per step, and exactness against no offload
(bitwise where the method should be exact, else the largest difference).
Capacity: the longest sequence that trains within a memory cap
(torch.cuda.set_per_process_memory_fraction), by a bounded search, with its
tokens/s (CUDA only).

  python3 bench/peers/peers.py                 # GPU defaults, both workloads
  python3 bench/peers/peers.py --smoke         # CPU, tiny, host backend
  python3 bench/peers/peers.py --smoke --check # exit 1 on any exactness miss

Sizes by flag (--layers --hidden --heads --seq --batch --microbatches
--steps --warmup). The GPU defaults aim the no-offload step at about a
quarter of an 80-140 GB card; they were not run on a GPU when this was
written (see docs/perf/README.md)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "PEERS_RESULT "

# method -> (title, exact?): exact methods must match no offload bitwise
METHODS = {
    "megatron": [
        ("none", "no offload", True),
        ("megatron_fgao", "Megatron FGAO (attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm)",
         True),
        ("ofl", "ofl, the README's one line (same modules)", True),
        ("ofl_auto", "ofl auto plan, device target", True),
        ("selective_recompute", "Megatron selective recompute (core_attn)", True),
    ],
    "llama": [
        ("none", "no offload", True),
        ("save_on_cpu", "torch save_on_cpu(pin_memory=CUDA)", True),
        ("torchtune", "torchtune OffloadActivations", True),
        ("ofl_torchtune", "ofl torchtune drop-in", True),
        ("ofl_offload", "ofl.torch.offload_activations", True),
        ("ofl_auto", "ofl auto plan, device target", True),
        ("ckpt", "per-layer activation checkpointing", True),
        ("torchtune_ckpt", "torchtune offload + per-layer checkpointing", True),
        ("ofl_ckpt", "ofl offload + per-layer checkpointing", True),
        ("te_offload", "TransformerEngine CPU offload", False),
    ],
}


class Unavailable(Exception):
    """The method cannot run here; the message is the row's reason."""


# ---- the worker: one method of one workload, in its own process ------------


def _cuda():
    import torch
    return torch.cuda.is_available()


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measure(step, a, tokens_per_step, stats=None):
    """Runs a.steps steps (the first a.warmup untimed); the peak is read
    after the warmup (CUDA). stats() -> offloaded bytes so far, or None."""
    import torch
    times = []
    off0 = None
    losses, grads = [], None
    for i in range(a.steps):
        if i == a.warmup:
            _sync()
            if _cuda():
                torch.cuda.reset_peak_memory_stats()
            off0 = stats() if stats else None
        _sync()
        t0 = time.perf_counter()
        lo, grads = step()
        _sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(lo)
    timed = a.steps - a.warmup
    out = {"step_ms": statistics.median(times) * 1e3 if times else None}
    out["tokens_s"] = tokens_per_step / statistics.median(times) if times else None
    out["peak_bytes"] = int(torch.cuda.max_memory_allocated()) if _cuda() else None
    if stats is not None and off0 is not None:
        out["offloaded_per_step"] = (stats() - off0) // max(1, timed)
    return out, losses, grads


def _ofl_ledger(core):
    """ofl's activation ledger (measured activation peak on the device)."""
    try:
        p = core.plan()
        return p["measured_peak_max_bytes"] if p else None
    except Exception:
        return None


# -- llama (torchtune)

def llama_worker(a, method):
    import torch
    from torch import nn
    os.environ.setdefault("OFL_BACKEND", "auto")
    cuda = _cuda()
    if method in ("torchtune", "torchtune_ckpt") and not cuda:
        raise Unavailable("needs CUDA (use_streams=True: CUDA streams)")
    if method == "te_offload":
        try:
            import transformer_engine.pytorch as te  # noqa: F401
        except Exception:
            raise Unavailable("TE not importable")
        if not cuda:
            raise Unavailable("needs CUDA")
    from torchtune.models.llama3_2._component_builders import llama3_2
    import torchtune.training as tt
    from torchtune.modules import TransformerSelfAttentionLayer
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    model = llama3_2(vocab_size=a.vocab, num_layers=a.layers, num_heads=a.heads,
                     num_kv_heads=max(1, a.heads // 4), embed_dim=a.hidden,
                     max_seq_len=a.seq, intermediate_dim=a.hidden * 4 if a.smoke else None,
                     tie_word_embeddings=False).to(device=dev, dtype=dtype)
    if method.endswith("ckpt"):
        tt.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev),
                torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev))
               for _ in range(a.steps * a.microbatches)]
    counter = [0]
    stats = None
    core = None
    ctx = None
    te_hooks = None
    if method == "none" or method == "ckpt":
        import contextlib
        ctx = contextlib.nullcontext()
    elif method == "save_on_cpu":
        class Counting(torch.autograd.graph.save_on_cpu):
            def __init__(self):
                super().__init__(pin_memory=cuda)
                pack = self.pack_hook

                def counted(t):
                    counter[0] += t.numel() * t.element_size()
                    return pack(t)
                self.pack_hook = counted
        ctx = Counting()
        stats = lambda: counter[0]  # noqa: E731
    elif method in ("torchtune", "torchtune_ckpt"):
        ctx = tt.get_act_offloading_ctx_manager(model, True)
    elif method in ("ofl_torchtune", "ofl_ckpt"):
        from ofl.torch.torchtune import get_act_offloading_ctx_manager
        ctx = get_act_offloading_ctx_manager(model, True)
    elif method == "ofl_offload":
        import ofl.torch as ot
        ctx = ot.offload_activations(model)
    elif method == "ofl_auto":
        import ofl.torch as ot
        ctx = ot.offload_activations(model, offload_modules="auto",
                                     device_memory_target=a.device_target)
    elif method == "te_offload":
        from transformer_engine.pytorch import get_cpu_offload_context
        import contextlib
        te_ctx, te_sync = get_cpu_offload_context(enabled=True, num_layers=max(1, a.layers - 2),
                                                  model_layers=a.layers)
        entered = []

        def pre(m, args):
            te_ctx.__enter__()
            entered.append(1)

        def post(m, args, out):
            te_ctx.__exit__(None, None, None)
            return te_sync(out)
        te_hooks = [l.register_forward_pre_hook(pre) for l in model.layers] + \
                   [l.register_forward_hook(post) for l in model.layers]
        ctx = contextlib.nullcontext()
    if hasattr(ctx, "stats"):
        stats = lambda: ctx.stats()["offloaded_bytes"]  # noqa: E731
        core = getattr(ctx, "_core", None)
    it = iter(batches)

    def step():
        opt.zero_grad(set_to_none=True)
        losses = []
        for _ in range(a.microbatches):
            tok, lab = next(it)
            with ctx:
                logits = model(tok)
            loss = nn.functional.cross_entropy(logits.float().view(-1, a.vocab), lab.view(-1))
            (loss / a.microbatches).backward()
            losses.append(loss.detach().cpu())
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        opt.step()
        return losses, grads

    out, losses, grads = _measure(step, a, a.batch * a.seq * a.microbatches, stats)
    if core is not None:
        out["ofl_ledger_bytes"] = _ofl_ledger(core)
        if method == "ofl_auto":
            out["note"] = "device target %s" % _fmt_bytes(a.device_target)
    del te_hooks
    if core is not None:
        from ofl.torch.offload import release_managers
        ctx = core = None
        release_managers()
    return out, losses, grads


# -- Megatron-Core GPTModel

MEGATRON_MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def megatron_worker(a, method):
    import contextlib
    import socket
    import types
    import warnings
    import torch
    cuda = _cuda()
    if method == "megatron_fgao":
        if not cuda:
            raise Unavailable("needs CUDA (and TE: its context manager raises "
                              "'TE CPU offload is not available' without it)")
        try:
            import transformer_engine  # noqa: F401
        except Exception:
            raise Unavailable("TE not importable (FGAO needs TE's cpu_offload)")
    if method in ("ofl", "ofl_auto") or a.ofl_swap:
        import ofl.torch.megatron as ofl_megatron
        sys.modules["megatron.core.pipeline_parallel.fine_grained_activation_offload"] = \
            ofl_megatron
        ofl_megatron.PipelineOffloadManager.destroy_instance()
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.transformer.transformer_config import TransformerConfig
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if cuda else "gloo",
                            init_method="tcp://127.0.0.1:%d" % port, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        # Megatron's three CUDA uses on this path (tests/python/test_client_megatron.py)
        class CpuTorch(types.ModuleType):
            def __getattr__(self, name):
                return getattr(torch, name)

            @staticmethod
            def zeros(*x, device=None, **kw):
                return torch.zeros(*x, device="cpu" if device == "cuda" else device, **kw)
        schedules.torch = CpuTorch("torch")
        parallel_state.get_global_memory_buffer().buffer[("mpu", torch.float32)] = \
            torch.empty(1 << 22)
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
        # selective recompute's checkpoint saves and restores CUDA RNG states;
        # with dropout 0 there is nothing to restore on the CPU
        import megatron.core.tensor_parallel.random as mrandom
        mrandom._get_all_rng_states = lambda: ()
        mrandom._set_all_rng_states = lambda *x: None
        mrandom._fork_rng = contextlib.nullcontext
    offload = method in ("megatron_fgao", "ofl", "ofl_auto")
    kw = {}
    if method == "selective_recompute":
        kw = {"recompute_granularity": "selective"}
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden,
                            num_attention_heads=a.heads, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            fine_grained_activation_offloading=offload,
                            offload_modules=list(MEGATRON_MODULES) if offload else [],
                            min_offloaded_tensor_size=1024 if a.smoke else 1024 * 1024,
                            **kw)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=a.vocab, max_sequence_length=a.seq)
    if cuda:
        model = model.cuda()
    dev = torch.device("cuda" if cuda else "cpu")
    mgr = None
    if method == "ofl_auto":
        mgr = ofl_megatron.PipelineOffloadManager.get_instance(
            offload_modules="auto", device_memory_target=a.device_target, summary=False)
    elif method == "ofl":
        mgr = ofl_megatron.PipelineOffloadManager.get_instance(summary=False)
    S, B = a.seq, a.batch
    pos = torch.arange(S, device=dev).unsqueeze(0).expand(B, S)
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool, device=dev), diagonal=1)
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randint(0, a.vocab, (B, S), generator=g).to(dev),
              torch.randint(0, a.vocab, (B, S), generator=g).to(dev))
             for _ in range(a.microbatches)] for _ in range(a.steps)]

    def forward_step(it, m):
        tok, lab = next(it)
        o = m(tok, pos, mask, labels=lab)

        def loss_func(x):
            loss = x.float().mean()
            return loss, {"loss": loss.detach().clone()}
        return o, loss_func

    fb = get_forward_backward_func()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    steps = iter(data)

    def step():
        mbs = next(steps)
        opt.zero_grad()
        res = fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=[model],
                 num_microbatches=len(mbs), seq_length=S, micro_batch_size=B,
                 forward_only=False)
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        opt.step()
        return [r["loss"].cpu() for r in res], grads

    stats = (lambda: mgr.stats()["offloaded_bytes"]) if mgr is not None else None
    try:
        out, losses, grads = _measure(step, a, B * S * a.microbatches, stats)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    if mgr is not None:
        out["ofl_ledger_bytes"] = _ofl_ledger(mgr._core)
        if method == "ofl_auto":
            out["note"] = "device target %s" % _fmt_bytes(a.device_target)
        ofl_megatron.PipelineOffloadManager.destroy_instance()
    if method == "selective_recompute" and not cuda:
        out["note"] = "CPU: Megatron's RNG-state tracking stubbed, dropout 0"
    return out, losses, grads


def capacity_worker(a, method):
    """The longest sequence (doubling, then halving the gap: a bounded
    search) that trains two steps within a.cap of the card, and its
    tokens/s."""
    import torch
    if not _cuda():
        raise Unavailable("needs CUDA")
    torch.cuda.set_per_process_memory_fraction(a.cap)
    lo, hi, best = 0, None, None
    seq = a.seq
    for _ in range(a.capacity_tries):
        b = argparse.Namespace(**vars(a))
        b.seq, b.steps, b.warmup = seq, 3, 1
        try:
            out, _, _ = WORKERS[a.workload](b, method)
            lo, best = seq, out
        except torch.cuda.OutOfMemoryError:
            hi = seq
        torch.cuda.empty_cache()
        seq = seq * 2 if hi is None else (lo + hi) // 2
        if hi is not None and hi - lo <= a.seq // 8:
            break
    if best is None:
        return {"capacity_seq": 0}, None, None
    return {"capacity_seq": lo, "tokens_s": best["tokens_s"]}, None, None


WORKERS = {"llama": llama_worker, "megatron": megatron_worker}


def worker(a):
    """Runs the methods of --method (comma-separated: the smoke mode runs a
    workload's methods in one process) and prints one result line each."""
    import torch
    torch.set_num_threads(max(1, a.threads))
    methods = a.method.split(",")
    a.ofl_swap = a.workload == "megatron" and any(m.startswith("ofl") for m in methods)
    for m in methods:
        res = {"method": m, "status": "ok"}
        try:
            fn = capacity_worker if a.capacity else WORKERS[a.workload]
            out, losses, grads = fn(a, m)
            res.update(out)
            if a.dump and losses is not None:
                torch.save({"losses": losses, "grads": grads}, _dump_path(a.dump, a.workload, m))
        except Unavailable as e:
            res["status"] = str(e)
        except Exception as e:  # a row that failed says how
            msg = (str(e).splitlines() or [""])[0][:160]
            res["status"] = "failed: %s: %s" % (type(e).__name__, msg)
        print(RESULT + json.dumps(res), flush=True)


def _dump_path(d, workload, method):
    return os.path.join(d, "%s-%s.pt" % (workload, method))


# ---- the parent: one subprocess per method, the tables -----------------------


def _fmt_bytes(b):
    if b is None:
        return "n/a"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return "%.2f %s" % (b / div, unit)
    return "%d B" % b


def exactness(base_path, path):
    """'bitwise', or the largest |difference| of losses and last gradients."""
    import torch
    a, b = torch.load(base_path), torch.load(path)
    for d in (a, b):  # checkpoint_wrapper's prefix
        d["grads"] = {n.replace("_checkpoint_wrapped_module.", ""): v
                      for n, v in d["grads"].items()}
    worst = 0.0
    same = True
    la = [x for s in a["losses"] for x in s]
    lb = [x for s in b["losses"] for x in s]
    pairs = list(zip(la, lb)) + [(a["grads"][n], b["grads"][n]) for n in a["grads"]]
    if len(la) != len(lb) or set(a["grads"]) != set(b["grads"]):
        return "different structure"
    for x, y in pairs:
        if not torch.equal(x, y):
            same = False
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return "bitwise" if same else "max |diff| %.3g" % worst


def run_methods(a, workload, methods, tmp, extra=()):
    """Runs methods in one subprocess (each in its own unless the smoke
    mode groups them); {method: result}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--workload", workload,
           "--method", ",".join(methods), "--dump", tmp] + _size_args(a) + list(extra)
    env = dict(os.environ)
    if a.smoke:
        env.setdefault("OFL_BACKEND", "host")
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=a.method_timeout)
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith(RESULT):
            r = json.loads(line[len(RESULT):])
            out[r["method"]] = r
    tail = " | ".join(p.stdout.strip().splitlines()[-3:])
    for m in methods:
        r = out.setdefault(m, {"method": m, "status": "failed: exit %d: %s" % (p.returncode,
                                                                                tail[:200])})
        r["wall_s"] = (time.time() - t0) / len(methods)
        path = _dump_path(tmp, workload, m)
        r["dump"] = path if os.path.exists(path) else None
    if a.verbose:
        sys.stderr.write(p.stdout)
    return out


def unavailable_here(workload, method, cuda):
    """The reason a method cannot run on this machine, known without
    starting it (the rows of CUDA-only peers), else None."""
    import importlib.util
    te = importlib.util.find_spec("transformer_engine") is not None
    pkg = {"megatron": "megatron", "llama": "torchtune"}[workload]
    if importlib.util.find_spec(pkg) is None:
        return "%s not importable" % ("megatron-core" if pkg == "megatron" else pkg)
    if method in ("torchtune", "torchtune_ckpt") and not cuda:
        return "needs CUDA (use_streams=True: CUDA streams)"
    if method == "megatron_fgao":
        if not cuda:
            return ("needs CUDA (and TE: its context manager raises 'TE CPU offload is not "
                    "available' without it)")
        if not te:
            return "TE not importable (FGAO needs TE's cpu_offload)"
    if method == "te_offload":
        return None if te and cuda else ("TE not importable" if not te else "needs CUDA")
    return None


def _size_args(a):
    out = []
    for k in ("layers", "hidden", "heads", "seq", "batch", "microbatches", "steps", "warmup",
              "vocab", "threads", "device_target", "cap", "capacity_tries"):
        v = getattr(a, k)
        if v is not None:
            out += ["--" + k.replace("_", "-"), str(v)]
    out += ["--dtype", a.dtype]
    if a.smoke:
        out.append("--smoke")
    return out


def table(workload, rows, base):
    cuda = base.get("peak_bytes") is not None
    head = ("| method | peak (after warmup) | saving | median step | vs none | tokens/s "
            "| offloaded / step | exact vs none |")
    lines = [head, "|" + "---|" * 8]
    for title, exact_expected, r in rows:
        if r["status"] != "ok":
            lines.append("| %s | %s |  |  |  |  |  |  |" % (title, r["status"]))
            continue
        if cuda:
            peak = _fmt_bytes(r["peak_bytes"])
            save = "%.1f%%" % (100.0 * (1 - r["peak_bytes"] / base["peak_bytes"]))
        else:
            peak = "n/a on CPU"
            if r.get("ofl_ledger_bytes"):
                peak += " (ofl ledger %s)" % _fmt_bytes(r["ofl_ledger_bytes"])
            save = "n/a"
        ratio = ("%.2fx" % (r["step_ms"] / base["step_ms"])
                 if r.get("step_ms") and base.get("step_ms") else "n/a")
        off = _fmt_bytes(r.get("offloaded_per_step")) if "offloaded_per_step" in r else "0"
        ex = r.get("exact", "n/a")
        if r.get("note"):
            title = "%s (%s)" % (title, r["note"])
        lines.append("| %s | %s | %s | %.1f ms | %s | %.0f | %s | %s |" % (
            title, peak, save, r["step_ms"], ratio, r["tokens_s"], off, ex))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["megatron", "llama", "all"], default="all")
    ap.add_argument("--methods", default=None, help="comma-separated subset")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on the CPU (host backend)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a method that should be exact is not bitwise")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--microbatches", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device-target", type=int, default=None,
                    help="bytes for the auto rows (default: 3/4 of no offload's peak on "
                         "CUDA; 1 GiB on the CPU)")
    ap.add_argument("--cap", type=float, default=0.5,
                    help="capacity rows: the fraction of the card (CUDA)")
    ap.add_argument("--capacity-tries", type=int, default=6)
    ap.add_argument("--no-capacity", action="store_true")
    ap.add_argument("--method-timeout", type=int, default=1800)
    ap.add_argument("--out", help="also write the tables to this markdown file")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--capacity", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    ap.add_argument("--ofl-swap", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    defaults = (dict(layers=2, hidden=64, heads=4, seq=32, batch=2, microbatches=2, steps=3,
                     warmup=1, vocab=128, threads=1)
                if a.smoke else
                dict(layers=8, hidden=4096, heads=32, seq=4096, batch=1, microbatches=2,
                     steps=8, warmup=3, vocab=32000, threads=4))
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.worker:
        return worker(a)

    try:
        import torch
    except ImportError as e:
        print("SKIP: torch is not importable (%s)" % e)
        return 77
    cuda = torch.cuda.is_available() and not a.smoke
    workloads = ["megatron", "llama"] if a.workload == "all" else [a.workload]
    want = set(a.methods.split(",")) if a.methods else None
    out, misses = [], []
    out.append("ofl peers bench: torch %s, %s; layers %d hidden %d heads %d seq %d batch %d "
               "microbatches %d, %d steps (%d warmup), %s" % (
                   torch.__version__, torch.cuda.get_device_name() if cuda else "CPU (host backend)",
                   a.layers, a.hidden, a.heads, a.seq, a.batch, a.microbatches, a.steps, a.warmup,
                   a.dtype))
    given_target = a.device_target
    if a.device_target is None and not cuda:
        a.device_target = 1 << 30

    def todo_of(w):
        return [m for m, _, _ in METHODS[w] if m != "none" and (not want or m in want)
                and not unavailable_here(w, m, cuda)]

    with tempfile.TemporaryDirectory(prefix="ofl-peers-") as tmp:
        grouped = {}
        if a.smoke:
            # one process per workload, the two at once: the CPU has no
            # peak to keep clean
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(max_workers=len(workloads)) as ex:
                futs = {w: ex.submit(run_methods, a, w, ["none"] + todo_of(w), tmp)
                        for w in workloads}
                grouped = {w: f.result() for w, f in futs.items()}
        for w in workloads:
            rows = []
            a.device_target = given_target if cuda else a.device_target
            todo = todo_of(w)
            if a.smoke:
                results = grouped[w]
                base = results["none"]
            else:
                base = run_methods(a, w, ["none"], tmp)["none"]
                if a.device_target is None and base.get("peak_bytes"):
                    a.device_target = int(base["peak_bytes"] * 0.75)
                results = {"none": base}
                for m in todo:
                    results.update(run_methods(a, w, [m], tmp))
            for m, title, exact in METHODS[w]:
                if want and m not in want and m != "none":
                    continue
                why = unavailable_here(w, m, cuda)
                r = results.get(m) or {"method": m, "status": why or "not run", "wall_s": 0}
                if r["status"] == "ok" and r.get("dump") and base.get("dump"):
                    r["exact"] = exactness(base["dump"], r["dump"])
                    if exact and r["exact"] != "bitwise" and m != "none":
                        misses.append("%s/%s: %s" % (w, m, r["exact"]))
                elif r["status"].startswith("failed"):
                    misses.append("%s/%s: %s" % (w, m, r["status"]))
                rows.append((title, exact, r))
                sys.stderr.write("%s/%s: %s (%.1f s)\n" % (w, m, r["status"], r["wall_s"]))
            out.append("\n### %s\n\n%s" % ("Megatron-Core GPTModel, forward_backward_no_pipelining"
                                           if w == "megatron" else "Llama-style decoder (torchtune)",
                                           table(w, rows, base)))
            cap = ["| method | longest sequence within %.0f%% of the card | tokens/s |" % (
                a.cap * 100), "|---|---|---|"]
            for m, title, _ in METHODS[w]:
                if want and m not in want and m != "none":
                    continue
                why = unavailable_here(w, m, cuda)
                if a.no_capacity or not cuda or why:
                    cap.append("| %s | %s |  |" % (title, why or ("needs CUDA" if not cuda
                                                                  else "not run")))
                    continue
                r = run_methods(a, w, [m], tmp, extra=["--capacity"])[m]
                if r["status"] != "ok":
                    cap.append("| %s | %s |  |" % (title, r["status"]))
                else:
                    cap.append("| %s | %d | %s |" % (title, r["capacity_seq"],
                                                    "%.0f" % r["tokens_s"] if r.get("tokens_s")
                                                    else "n/a"))
            out.append("\nCapacity, %s:\n\n%s" % (w, "\n".join(cap)))
    text = "\n".join(out) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if misses:
        print("exactness misses:\n  " + "\n  ".join(misses))
        if a.check:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
