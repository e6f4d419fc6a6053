"""The injection sweep of the interrupt tests (test_interrupt_sweep.py,
test_stager_sweep.py): an exception raised at every line event of
ofl.torch's own Python code (the .py files under python/ofl/) that one run
of a step reaches, driven by sys.settrace with a counter.

    n = count(step)                 # the line events of one clean run
    for k in points(n):             # every one (OFL_SWEEP_FULL=1) or a stride
        where = inject(step, k, KeyboardInterrupt)

A line event comes before its line runs, so raising there is an interrupt
between any two lines: what a SIGINT's KeyboardInterrupt does at the
interpreter's next check (the sweep also reaches lines where a real signal
lands only at a call or a loop's jump, a superset). A raise inside a
__del__ or a weakref callback is reported by Python as unraisable and the
code goes on (as it does for a real signal there); the sweep counts it.

One line event is not a point: the one at a with statement's line before
its __exit__ call, when the body ends normally (or by return, break or
continue). Raising there skips __exit__ (a lock stays held, grad mode stays
off), which no signal can do: CPython (3.10 and later) checks for signals
at calls, function entries and backward jumps, and nothing between the
body's last instruction and the __exit__ call is one of those (the raise
after that call is the next line's event)."""
import dis
import os
import sys
import time

import ofl

# ofl's Python sources: python/ofl/ (the package __path__ spans the source
# tree and the build's python/ofl for the extension; only .py files trace)
ROOTS = tuple(os.path.join(os.path.realpath(p), "") for p in ofl.__path__)

FULL = os.environ.get("OFL_SWEEP_FULL", "").strip() not in ("", "0")


def _ours(code):
    f = code.co_filename
    return f.endswith(".py") and os.path.realpath(f).startswith(ROOTS)


def _with_exits(code):
    """The offsets of code's normal with-exit sequences: LOAD_CONST None
    three times, then the call of __exit__ (3.11: PRECALL, CALL 2; 3.12:
    CALL 2; 3.10: LOAD_CONST None, DUP_TOP twice, CALL_FUNCTION 3), after
    a SWAP where the body returns a value."""
    ins = list(dis.get_instructions(code))
    out = set()
    for i, a in enumerate(ins):
        if a.opname != "LOAD_CONST" or a.argval is not None:
            continue
        nxt = [b.opname for b in ins[i + 1:i + 5]]
        args = [b.argval for b in ins[i + 1:i + 5]]
        if nxt[:2] == ["LOAD_CONST", "LOAD_CONST"] and args[:2] == [None, None]:
            rest = [n for n in nxt[2:] if n != "PRECALL"]
            if rest and rest[0] == "CALL" and ins[i + 1 + nxt.index("CALL")].arg == 2:
                out.add(a.offset)
                if i > 0 and ins[i - 1].opname == "SWAP":  # a return in the body: its value kept
                    out.add(ins[i - 1].offset)
        elif nxt[:3] == ["DUP_TOP", "DUP_TOP", "CALL_FUNCTION"] and ins[i + 3].arg == 3:
            out.add(a.offset)
    return frozenset(out)


class Injection(Exception):
    """The ordinary exception the sweep raises (an Exception, unlike
    KeyboardInterrupt)."""


_EXITS = {}  # code -> _with_exits(code)


class _Tracer:
    def __init__(self, at, exc):
        self.n = 0
        self.at = at  # 1-based event to raise at; 0: count only
        self.exc = exc
        self.where = None
        self._codes = {}

    def glob(self, frame, event, arg):
        code = frame.f_code
        ours = self._codes.get(code)
        if ours is None:
            ours = self._codes[code] = _ours(code)
            if ours and code not in _EXITS:
                _EXITS[code] = _with_exits(code)
        return self.local if ours else None

    def local(self, frame, event, arg):
        if event == "line":
            if frame.f_lasti in _EXITS[frame.f_code]:
                return self.local  # a with's exit: no signal lands before __exit__
            self.n += 1
            if self.n == self.at:
                self.where = "%s:%d %s" % (os.path.basename(frame.f_code.co_filename),
                                           frame.f_lineno, frame.f_code.co_name)
                sys.settrace(None)
                frame.f_trace = None
                raise self.exc("injected at line event %d (%s)" % (self.n, self.where))
        return self.local


def run_traced(fn, at=0, exc=KeyboardInterrupt):
    """fn() under the tracer: returns (events seen, where it raised or None,
    the exception fn raised or None)."""
    t = _Tracer(at, exc)
    err = None
    sys.settrace(t.glob)
    try:
        fn()
    except BaseException as e:  # noqa: B902 the injected one, or what it caused
        err = e
    finally:
        sys.settrace(None)
    if err is not None and not isinstance(err, (KeyboardInterrupt, Injection)):
        err = "%s: %s" % (type(err).__name__, err)  # no traceback kept
    elif err is not None:
        err = type(err).__name__
    return t.n, t.where, err


def count(fn):
    n, _, err = run_traced(fn)
    if err is not None:
        raise RuntimeError("the clean run raised: %s" % err)
    return n


def points(n, ci_points):
    """Every event 1..n in the full mode, else a deterministic stride that
    takes about ci_points of them (the first and the last included)."""
    if FULL or n <= ci_points:
        return list(range(1, n + 1))
    stride = max(1, n // ci_points)
    pts = list(range(1, n + 1, stride))
    if pts[-1] != n:
        pts.append(n)
    return pts


class Tally:
    """Injection points swept and the ones that left the process unusable."""

    def __init__(self, name):
        self.name = name
        self.events = 0
        self.swept = 0
        self.bad = []
        self.finalizer = []  # points in a __del__ that left something behind
        self.t0 = time.monotonic()

    def add(self, k, where, problem):
        self.swept += 1
        if problem:
            self.bad.append((k, where, problem))

    def line(self):
        return ("sweep %s: events %d, injection points swept %d (%s), left unusable %d, "
                "in a finalizer %d, %.1f s"
                % (self.name, self.events, self.swept, "full" if FULL else "stride",
                   len(self.bad), len(self.finalizer), time.monotonic() - self.t0))

    def report(self, limit=12):
        print(self.line(), flush=True)
        for k, where, problem in self.finalizer[:limit]:
            print("  finalizer: event %d at %s: %s" % (k, where, problem), flush=True)
        for k, where, problem in self.bad[:limit]:
            print("  event %d at %s: %s" % (k, where, problem), flush=True)
        if len(self.bad) > limit:
            print("  ... %d more" % (len(self.bad) - limit), flush=True)
