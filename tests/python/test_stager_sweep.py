"""An interrupt anywhere in the async stager's stage() or in a disk
checkpoint leaves nothing behind (host backend): KeyboardInterrupt, and
separately an ordinary exception, raised at every line event of ofl.torch's
own Python code that one call reaches (sweep.py).

After each injection into ``AsyncStager.stage`` (with and without
cache_staged_state_dict), the state dict is changed in place and staged
again by the same stager, then saved with ``dcp.async_save(...,
async_stager=stager)`` and loaded back: both are bitwise the state dict at
that later call (nothing half-staged is picked up), and nothing raises.

After each injection into a step through ``disk_checkpoint`` (its forward,
its backward), the disk directory holds no file (the store keeps its data
in an unlinked file: a name left there is a file behind) and a following
step's gradients are bitwise those without the disk tier.

CI takes a stride of about OFL_SWEEP_POINTS (default 40) points per case;
OFL_SWEEP_FULL=1 sweeps every line event."""
import gc
import os
import sys
import tempfile
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  torch or skip; the host backend; which hooks
import sweep  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import ofl.torch as ot  # noqa: E402
from ofl.torch import disk as odisk  # noqa: E402

torch.set_num_threads(1)
CI_POINTS = int(os.environ.get("OFL_SWEEP_POINTS", "40"))


def state_dict(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {"model": {"w": w, "w_t": w.t(), "b": torch.randn(32, generator=g),
                      "steps": torch.tensor(seed)},
            "optim": {"state": {0: {"exp_avg": torch.randn(64, 32, generator=g)}},
                      "lr": 0.1 * seed}}


def leaves(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        name = "%s/%s" % (prefix, k)
        if isinstance(v, dict):
            out.update(leaves(v, name))
        else:
            out[name] = v
    return out


def same(a, b):
    """Bitwise equal state dicts (tensors by their bytes, the rest by ==)."""
    la, lb = leaves(a), leaves(b)
    if set(la) != set(lb):
        return "keys %s, expected %s" % (sorted(la), sorted(lb))
    for k in la:
        x, y = la[k], lb[k]
        if isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    == y.contiguous().view(-1).view(torch.uint8).numpy().tobytes()):
                return "%s differs" % k
        elif x != y:
            return "%s: %r, expected %r" % (k, x, y)
    return None


def snapshot(sd):
    return {k: snapshot(v) if isinstance(v, dict) else
            (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


class StagerSweep(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tallies = []

    @classmethod
    def tearDownClass(cls):
        print("stager and disk: swept %d injection points, %d left something behind"
              % (sum(t.swept for t in cls.tallies), sum(len(t.bad) for t in cls.tallies)),
              flush=True)

    def _after_stage(self, stager, sd, seed):
        """Later calls: stage() and dcp.async_save are the state dict at
        their call. Returns the first problem, or None."""
        import torch.distributed.checkpoint as dcp
        try:
            sd["model"]["w"].add_(float(seed))  # the next step changes the model in place
            sd["optim"]["lr"] = 0.5 * seed
            want = snapshot(sd)
            p = same(stager.stage(sd), want)
            if p:
                return "a later stage(): " + p
            sd["model"]["b"].mul_(-1.0)
            want = snapshot(sd)
            with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f = dcp.async_save(sd, checkpoint_id=d, async_stager=stager, no_dist=True)
                getattr(f, "upload_completion", f).result()
                back = state_dict(0)
                back["optim"]["lr"] = None
                dcp.load(back, checkpoint_id=d, no_dist=True)
            back["model"]["w_t"] = back["model"]["w"].t()
            p = same({k: v for k, v in leaves(back).items() if not k.endswith("/lr")},
                     {k: v for k, v in leaves(want).items() if not k.endswith("/lr")})
            if p:
                return "dcp.async_save then dcp.load: " + p
            return None
        except BaseException as e:  # noqa: B902 a later call raised
            return "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")

    def sweep_stage(self, cache, exc):
        tally = sweep.Tally("stage/cache %d/%s" % (cache, exc.__name__))
        stager = ot.AsyncStager(cache_staged_state_dict=cache)
        sd = state_dict(1)
        stager.stage(sd)  # a first stage (the cache, when on, is made)
        tally.events = sweep.count(lambda: stager.stage(sd))
        for k in sweep.points(tally.events, CI_POINTS):
            sd = state_dict(1)
            _, where, err = sweep.run_traced(lambda: stager.stage(sd), k, exc)
            problem = self._after_stage(stager, sd, 2 + k % 5)
            tally.add(k, where, problem)
            if problem:  # judge the next point on its own
                stager.close()
                stager = ot.AsyncStager(cache_staged_state_dict=cache)
        stager.close()
        self.tallies.append(tally)
        tally.report()
        return tally

    def _disk_step(self, model, x, d):
        model.zero_grad(set_to_none=True)
        h = model[0](x)
        h = ot.disk_checkpoint(model[1], h, disk_dir=d)
        model[2](h).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def sweep_disk(self, exc):
        tally = sweep.Tally("disk_checkpoint/%s" % exc.__name__)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.GELU()),
                              nn.Linear(32, 4))
        x = torch.randn(8, 16)
        model.zero_grad(set_to_none=True)
        model[2](model[1](model[0](x))).sum().backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        with tempfile.TemporaryDirectory() as d:
            self._disk_step(model, x, d)
            tally.events = sweep.count(lambda: self._disk_step(model, x, d))
            for k in sweep.points(tally.events, CI_POINTS):
                _, where, err = sweep.run_traced(lambda: self._disk_step(model, x, d), k, exc)
                gc.collect()
                problem = None
                left = os.listdir(d)
                if left:
                    problem = "files left in the disk directory: %s" % left[:4]
                try:
                    g = self._disk_step(model, x, d)
                    for n in ref:
                        if not torch.equal(g[n], ref[n]):
                            problem = problem or "a later step: gradient %s differs" % n
                except BaseException as e:  # noqa: B902
                    problem = problem or "a later step: %s: %s" % (type(e).__name__, e)
                if not problem and os.listdir(d):
                    problem = "files left after a later step: %s" % os.listdir(d)[:4]
                tally.add(k, where, problem)
            odisk.DiskStore.close_all()
        self.tallies.append(tally)
        tally.report()
        return tally

    def check(self, tallies):
        bad = ["%s: event %d at %s: %s" % (t.name, k, w, p) for t in tallies for k, w, p in t.bad]
        self.assertEqual(bad, [], "%d injection points left something behind:\n%s"
                         % (len(bad), "\n".join(bad[:20])))

    def test_stage(self):
        self.check([self.sweep_stage(cache, exc) for cache in (False, True)
                    for exc in (KeyboardInterrupt, sweep.Injection)])

    def test_disk_checkpoint(self):
        self.check([self.sweep_disk(exc) for exc in (KeyboardInterrupt, sweep.Injection)])


if __name__ == "__main__":
    unittest.main(verbosity=2)
