"""icl_book.core: its in-place edits (InPlace) and SIGINT guard, rel_err, the
argument checks. Ctrl-C at any instant, nesting and threads: in-place patches
stay exact.

A Ctrl-C is emulated the way Python delivers it: the SIGINT handler that is
installed at that moment is called with the frame where the interrupt lands.
It lands at every call and line event of one patch cycle (construction,
__enter__, body, __exit__), one run per event, and at random instants
(a SIGALRM timer). After each run the weights must be bit-identical to the
originals, nothing may still be held in place, and the model must run.
"""
import gc
import importlib.util
import random
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from icl_book import blocks, core, deep, patch

f64 = torch.float64


def stack():
    return blocks.PreLNStack(blocks.StackConfig(depth=2, d_model=8, heads=2,
                                                d_mlp=16, dtype='float64'))


def lm():
    return deep.TinyLM(deep.LMConfig(depth=2, d_model=8, heads=2, d_mlp=16,
                                     vocab=11, n_pos=16, dtype='float64'))


def setup(kind):
    "(model, make the context manager, body) for one in-place manager."
    g = torch.Generator().manual_seed(0)
    if kind == 'patched_weights':
        m = stack(); W = m.blocks[0].mlp.W
        dW = torch.randn(W.shape, generator=g, dtype=f64)
        return m, lambda: patch.patched_weights(W, dW), None
    if kind.endswith('TinyLM'):
        m = lm(); C = torch.randint(0, 11, (1, 6), generator=g)
        x = torch.randint(0, 11, (1, 1), generator=g)
    else:
        m = stack(); C = torch.randn(1, 6, 8, generator=g, dtype=f64)
        x = torch.randn(1, 1, 8, generator=g, dtype=f64)
    mode = 'rank1' if 'rank1' in kind else 'bias'
    with torch.no_grad(): p = deep.context_patches(m, C, x, mode)
    return m, lambda: p.inplace(m), x


KINDS = ['patched_weights', 'DeepPatch.inplace PreLNStack',
         'DeepPatch.inplace rank1 PreLNStack', 'DeepPatch.inplace TinyLM']


def cycle(make, model, x):
    "One use of a manager; the body runs the model (no no_grad: a Ctrl-C in"
    " torch's own no_grad.__exit__ would leave grad mode off, torch's affair)."
    with make():
        if x is not None: model(x)


def ctrl_c(frame):
    "What a Ctrl-C does when Python handles it in `frame`."
    signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)


def assert_intact(model, before, x):
    assert torch.is_grad_enabled()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"
    for t in model.parameters():
        assert core.held_by(t) is None, "a weight is still held in place"
    assert core.held_by(model) is None
    if x is not None:
        with torch.no_grad(): model(x)        # runs, not refused


# the Ctrl-C instants and random-instant timer of bench/state_probes.py (one copy)
_spec = importlib.util.spec_from_file_location(
    "state_probes", Path(__file__).resolve().parents[1] / "bench" / "state_probes.py")
probes = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(probes)


def mine(filename):
    "The files whose every signal-check instant is probed: ours."
    return filename.endswith(('core.py', 'patch.py', __file__))


def traced_run(pts, fn):
    "Run fn() under tracer `pts`; True if a KeyboardInterrupt escaped it."
    # no garbage collection while tracing: a collection runs finalizers at
    # points that depend on earlier tests, and would shift the count
    was = gc.isenabled(); gc.disable()
    sys.settrace(pts)
    try: fn()
    except KeyboardInterrupt: return True
    finally:
        sys.settrace(None)
        if was: gc.enable()
    return False


@pytest.mark.parametrize('kind', KINDS)
def test_ctrl_c_at_every_event_leaves_weights_exact(kind):
    model, make, x = setup(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = lambda: cycle(make, model, x)
    run(); pts = probes.Points(mine=mine); traced_run(pts, run)
    own = [k + 1 for k, f in enumerate(pts.where) if mine(f)]
    rest = [k + 1 for k, f in enumerate(pts.where) if not mine(f)]
    assert len(own) > 20                           # the cycle was traced
    ks = own + random.Random(0).sample(rest, min(len(rest), 60))
    hit = 0
    for k in ks:
        hit += traced_run(probes.Points(k, mine), run)
        assert_intact(model, before, x)
    assert hit == len(ks)            # every Ctrl-C reached the caller


@pytest.mark.parametrize('kind', KINDS)
def test_ctrl_c_at_random_instants_leaves_weights_exact(kind):
    model, make, x = setup(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old = signal.signal(signal.SIGALRM, lambda s, frame: ctrl_c(frame))
    run = lambda: cycle(make, model, x)
    gc.disable()          # a Ctrl-C inside another library's gc callback is
    try:                  # swallowed by Python ("unraisable"): keep them out
        span = probes.median_seconds(run)              # median cycle, seconds
        rng, hits = random.Random(1), 0
        for _ in range(200):
            hits += probes.interrupted_at_random(run, span, rng)
            assert_intact(model, before, x)
    finally: signal.signal(signal.SIGALRM, old); gc.enable()
    assert hits >= 20                # the timer did interrupt many cycles


@pytest.mark.parametrize('kind', KINDS)
def test_nesting_is_refused_and_leaves_the_outer_patch(kind):
    model, make, x = setup(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with make():
        inside = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match="already patched in place"):
            with make(): pass
        for k, v in model.state_dict().items():
            assert torch.equal(v, inside[k])       # outer patch untouched
    assert_intact(model, before, x)


def test_two_patched_weights_on_one_weight_cannot_interleave():
    m = stack(); W = m.blocks[0].mlp.W; W0 = W.detach().clone()
    a = patch.patched_weights(W, torch.ones_like(W))
    b = patch.patched_weights(W, 2 * torch.ones_like(W))
    a.__enter__()
    with pytest.raises(RuntimeError, match="already patched"): b.__enter__()
    b.__exit__(None, None, None)                   # a stray exit: no effect
    assert torch.equal(W.detach(), W0 + 1)
    a.__exit__(None, None, None)
    assert torch.equal(W.detach(), W0)


def test_tinylm_nested_with_another_start_is_refused():
    model = lm(); g = torch.Generator().manual_seed(0)
    C = torch.randint(0, 11, (1, 6), generator=g)
    x = torch.randint(0, 11, (1, 1), generator=g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        p6 = deep.context_patches(model, C, x)
        p3 = deep.context_patches(model, C[:, :3], x)
        with p6.inplace(model):
            with pytest.raises(RuntimeError, match="already patched"):
                with p3.inplace(model): pass
            out = model(x)                         # still at start 6
    want = model(torch.cat([C, x], 1))[:, -1:]
    assert core.rel_err(out, want) < 1e-12
    assert_intact(model, before, x)


@pytest.mark.parametrize('kind', ['DeepPatch.inplace PreLNStack',
                                  'DeepPatch.inplace TinyLM'])
def test_another_thread_is_refused_while_patched(kind):
    model, make, x = setup(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    entered, done, seen = threading.Event(), threading.Event(), {}

    def other():
        entered.wait(10)
        for name, fn in (('call', lambda: model(x)),
                         ('enter', lambda: make().__enter__())):
            try:
                with torch.no_grad(): fn()
                seen[name] = 'ran'
            except RuntimeError as e: seen[name] = str(e)
        done.set()

    t = threading.Thread(target=other); t.start()
    with make():
        with torch.no_grad(): mine = model(x)      # this thread may run it
        entered.set(); done.wait(10)
    t.join(10)
    assert 'another thread' in seen['call']
    assert 'already patched in place' in seen['enter']
    assert_intact(model, before, x)
    with torch.no_grad():                          # and runs freely after
        t2 = threading.Thread(target=lambda: seen.update(after=model(x)))
        t2.start(); t2.join(10)
    assert seen['after'].shape == mine.shape


# ----------------------------------------------------------------------------
# bad input: a clear error (what was wrong, what to do), or a correct result
import math  # noqa: E402
from _inputs import BAD, rand  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['core']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['core'][case]
    with pytest.raises(exc, match=words):
        fn()


@pytest.mark.parametrize('scale', [1e200, 1e-170, 1.0])
def test_rel_err_is_exact_at_any_magnitude(scale):
    y = rand(3, 64); yh = y + 1e-3 * rand(3, 64, seed=5)
    want = ((yh - y).norm(dim=-1) / y.norm(dim=-1)).max().item()
    assert core.rel_err(scale * yh, scale * y) == pytest.approx(want, rel=1e-12)

def test_rel_err_of_a_zero_reference_is_zero_or_inf():
    z = torch.zeros(2, 3, dtype=f64)
    assert core.rel_err(z, z) == 0.0 and core.rel_err(z + 1e-300, z) == math.inf


def test_every_table_of_bad_inputs_is_run_by_its_module_tests():
    "Each module's table in tests/_inputs.py is parametrised in tests/test_<module>.py."
    from conftest import ROOT
    for m in BAD:
        assert f"BAD[{m!r}]" in (ROOT / "tests" / f"test_{m}.py").read_text(), m
