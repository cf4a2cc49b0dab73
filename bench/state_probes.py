"""Probe counts of in-place state (issue 27): Ctrl-C, nesting, threads.

Not a benchmark: it counts how often the in-place patch managers leave a
model wrong. For `patched_weights`, `DeepPatch.inplace` on a PreLNStack and
on a TinyLM it emulates a Ctrl-C (the installed SIGINT handler called with
the frame where it lands) at random instants (a SIGALRM timer, 300 runs) and
at every instant where CPython 3.11 may run a signal handler in one patch
cycle (function entry, after a call, a backward jump), and counts runs that
leave a weight changed. Then it counts the nesting, other-model and
other-thread probes that run without an error and give wrong numbers.

    OMP_NUM_THREADS=1 python bench/state_probes.py
"""
import dis
import json
import random
import signal
import sys
import threading
import time

import torch

from icl_book import blocks, deep, patch

f64 = torch.float64
G = torch.Generator().manual_seed(0)
CHECKS = {'CALL', 'CALL_FUNCTION_EX', 'JUMP_BACKWARD'}


def stack():
    return blocks.PreLNStack(blocks.StackConfig(
        depth=2, d_model=8, heads=2, d_mlp=16, dtype='float64'))


def lm():
    return deep.TinyLM(deep.LMConfig(depth=2, d_model=8, heads=2, d_mlp=16,
                                     vocab=11, n_pos=16, dtype='float64'))


def prompt(model):
    if isinstance(model, deep.TinyLM):
        return (torch.randint(0, 11, (1, 6), generator=G),
                torch.randint(0, 11, (1, 1), generator=G))
    return (torch.randn(1, 6, 8, generator=G, dtype=f64),
            torch.randn(1, 1, 8, generator=G, dtype=f64))


def setup(kind):
    "(model, make the manager, query or None)."
    if kind == 'patched_weights':
        m = stack(); W = m.blocks[0].mlp.W
        dW = torch.randn(W.shape, generator=G, dtype=f64)
        return m, lambda: patch.patched_weights(W, dW), None
    m = lm() if kind == 'TinyLM' else stack(); C, x = prompt(m)
    with torch.no_grad(): p = deep.context_patches(m, C, x)
    return m, lambda: p.inplace(m), x


def cycle(make, m, x):
    with make():
        if x is not None: m(x)


def ctrl_c(frame):
    signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)


def snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def intact(m, before):
    same = all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    return same and not hasattr(m, '_patch_start')


class Points:
    """Trace: count (and interrupt at the k-th of) the signal-check instants.
    `mine(filename)`, when given, limits the opcode-level trace to those files:
    in any other frame only its entry counts (far fewer events, same order)."""
    def __init__(self, stop=None, mine=None):
        self.n, self.stop, self.prev, self.mine, self.where = 0, stop, {}, mine, []

    def __call__(self, frame, event, arg):
        if event == 'call':
            self.point(frame)                      # RESUME checks
            if self.mine is not None and not self.mine(frame.f_code.co_filename):
                return None                        # no line/opcode events here
            frame.f_trace_opcodes = True
        elif event == 'opcode':
            if self.prev.get(id(frame)) in CHECKS: self.point(frame)
            op = frame.f_code.co_code[frame.f_lasti]
            self.prev[id(frame)] = dis.opname[op]  # after calls, back jumps
        return self

    def point(self, frame):
        self.n += 1; self.where.append(frame.f_code.co_filename)
        if self.n == self.stop: sys.settrace(None); ctrl_c(frame)


def traced(tracer, make, m, x) -> bool:
    "Run one cycle under `tracer`; True if a KeyboardInterrupt escaped."
    sys.settrace(tracer)
    try: cycle(make, m, x)
    except KeyboardInterrupt: return True
    finally: sys.settrace(None)
    return False


def median_seconds(run, n=21) -> float:
    "Median wall time of `run()` over `n` calls, seconds."
    times = []
    for _ in range(n):
        t = time.perf_counter(); run(); times.append(time.perf_counter() - t)
    return sorted(times)[n // 2]


def interrupted_at_random(run, span, rng) -> bool:
    """Call `run()` with a SIGALRM timer set at a random instant of
    [0, 1.2 span) seconds (`rng.uniform`); True if a KeyboardInterrupt escaped.
    The caller installs the SIGALRM handler that raises it (`ctrl_c`)."""
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL,
                             max(1e-6, rng.uniform(0, 1.2 * span)))
            run()
        finally: signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt: return True
    return False


def ctrl_c_counts(kind, runs=300) -> dict:
    m, make, x = setup(kind); before = snapshot(m)
    old = signal.signal(signal.SIGALRM, lambda s, f: ctrl_c(f))
    span = median_seconds(lambda: cycle(make, m, x))
    rng, hit, bad = random.Random(1), 0, 0
    for _ in range(runs):
        hit += interrupted_at_random(lambda: cycle(make, m, x), span, rng)
        if not intact(m, before):
            bad += 1; m, make, x = setup(kind); before = snapshot(m)
    signal.signal(signal.SIGALRM, old)
    m, make, x = setup(kind); before = snapshot(m)
    pts = Points(); traced(pts, make, m, x); pbad = 0
    for k in range(1, pts.n + 1):
        traced(Points(k), make, m, x)
        if not intact(m, before):
            pbad += 1; m, make, x = setup(kind); before = snapshot(m)
    return dict(timer_runs=runs, timer_interrupted=hit, timer_left_wrong=bad,
                instants=pts.n, instants_left_wrong=pbad)


def nested(same: bool) -> bool:
    m = stack(); C, x = prompt(m)
    with torch.no_grad():
        p1 = deep.context_patches(m, C, x)
        p2 = p1 if same else deep.context_patches(m, C[:, :3], x)
        want = p2.apply(m, x)
        with p1.inplace(m):
            with p2.inplace(m): got = m(x)
    return bool((got - want).norm() > 1e-9)


def tinylm_starts() -> bool:
    m = lm(); C, x = prompt(m); before = snapshot(m)
    with torch.no_grad():
        p6 = deep.context_patches(m, C, x)
        p3 = deep.context_patches(m, C[:, :3], x)
        try:
            with p6.inplace(m):
                with p3.inplace(m): m(x)
        except AttributeError: return True
    return not intact(m, before)


def non_lifo() -> bool:
    m = stack(); W = m.blocks[0].mlp.W; W0 = W.detach().clone()
    a = patch.patched_weights(W, torch.ones_like(W))
    b = patch.patched_weights(W, 2 * torch.ones_like(W))
    a.__enter__(); b.__enter__()
    a.__exit__(None, None, None); b.__exit__(None, None, None)
    return not torch.equal(W.detach(), W0)


def other_model(inplace: bool) -> bool:
    a, b = stack(), stack(); C, x = prompt(a)
    with torch.no_grad():
        p = deep.context_patches(a, C, x)
        if inplace:
            with p.inplace(b): pass
        else: p.apply(b, x)
    return True


def other_thread() -> bool:
    m = stack(); C, x = prompt(m); seen = {}
    with torch.no_grad():
        p = deep.context_patches(m, C, x); plain = m(x)

    def run():
        try:
            with torch.no_grad(): seen['out'] = m(x)
        except RuntimeError: seen['out'] = None
    with p.inplace(m):
        t = threading.Thread(target=run); t.start(); t.join()
    return seen['out'] is not None and bool((seen['out'] - plain).norm() > 0)


def silent(fn, *args) -> int:
    "1 if fn ran without a clear error and left wrong numbers or weights."
    try: return int(fn(*args))
    except (RuntimeError, ValueError): return 0


if __name__ == '__main__':
    out = {k: ctrl_c_counts(k)
           for k in ('patched_weights', 'DeepPatch.inplace', 'TinyLM')}
    out['silently_wrong'] = dict(
        nested_same_patch=silent(nested, True),
        nested_two_contexts=silent(nested, False),
        tinylm_nested_other_start=silent(tinylm_starts),
        non_lifo_exits=silent(non_lifo),
        apply_to_other_model=silent(other_model, False),
        inplace_into_other_model=silent(other_model, True),
        other_thread_plain_call=silent(other_thread))
    print(json.dumps(out, indent=1))
