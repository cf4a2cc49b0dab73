"""The explorer's computation (`explore`) against a direct computation, its
bad-input errors, and the widget: controls for kind/depth/n/chunk whose
changes redraw the output."""
import random
import time

import numpy as np
import pytest
import torch

from icl_book.blocks import LAYER_KINDS, RankOne
from icl_book.core import rel_err
from icl_book.trajectories import patch_rel_diff
from icl_book.experiments.explorer import (CHUNKS, STACK_CHUNKS, chunk_positions,
                                           explore, explorer, make_setting)

torch.set_num_threads(1)


def _close(a, b, tol=1e-10):
    "Relative agreement of two tensors (any shape)."
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item() <= tol


def _direct_block(kind, n, Y, seed):
    "Depth 1 by hand: run the block with C and without Y, patch W."
    blk, C, x = make_setting(kind, 1, n, seed=seed)
    keep = [i for i in range(n) if i not in set(Y)]
    with torch.no_grad():
        a_full = blk.layer(C, x)                           # A(C, x), (1, d)
        a = blk.layer(C[:, keep], x)                       # A(C \ Y, x)
        u = (a_full - a) @ blk.mlp.W.T                     # W ΔA, (1, H)
        v = a / (a * a).sum(-1, keepdim=True)
        err = rel_err(blk.mlp(a, dW=RankOne(u, v)), blk(C, x))
    return u, v, None, err


def _direct_stack(kind, depth, n, k, seed):
    "Depth L by hand: with C, then the tokens after c_1..c_k, patched."
    net, C, x = make_setting(kind, depth, n, seed=seed)
    X = torch.cat([C, x[:, None]], 1)                      # (1, n + 1, d)
    with torch.no_grad():
        H, h_ctx = X, []
        for blk in net.blocks:                             # with the context
            h = H + blk.layer.seq(blk.ln1(H)); h_ctx.append(h[:, k:])
            H = h + blk.mlp(blk.ln2(h))
        Z, us, vs, ds = X[:, k:], [], [], []
        for blk, hc in zip(net.blocks, h_ctx):             # without c_1..c_k
            h = Z + blk.layer.seq(blk.ln1(Z))
            a_c, a = blk.ln2(hc), blk.ln2(h)
            u = (a_c - a) @ blk.mlp.W.T
            v = a / (a * a).sum(-1, keepdim=True)
            Z = h + blk.mlp(a, dW=RankOne(u, v)) + (hc - h)
            us.append(u[0, -1]); vs.append(v[0, -1]); ds.append((hc - h)[0, -1])
        err = rel_err(Z, H[:, k:])
    return torch.stack(us), torch.stack(vs), torch.stack(ds), err


CASES = [(1, 'whole'), (1, 'suffix'), (1, 'scattered'), (1, [0, 3, 5]),
         (2, 'whole'), (3, 'prefix')]


@pytest.mark.parametrize("kind", LAYER_KINDS)
@pytest.mark.parametrize("depth,chunk", CASES,
                         ids=[f"L{d}-{c}" for d, c in CASES])
def test_explore_matches_direct_computation(kind, depth, chunk):
    n, seed = 11, 3
    r = explore(kind, depth, n, chunk, seed=seed)
    Y = chunk_positions(chunk, n, None, depth, seed)
    assert r.chunk == tuple(Y) and r.depth == depth and r.n == n
    if depth == 1: u, v, db, err = _direct_block(kind, n, Y, seed)
    else:
        assert Y == list(range(len(Y)))                    # a prefix
        u, v, db, err = _direct_stack(kind, depth, n, len(Y), seed)
        assert _close(r.db, db)
    assert _close(r.u, u) and _close(r.v, v)
    assert err <= 1e-12                                    # the theorem
    assert r.max_err('float64') <= 1e-12
    assert r.max_err('float32') <= 1e-5
    assert r.err['float64'].shape == r.err['float32'].shape == (depth,)
    assert r.norm.shape == (depth, n) and r.step.shape == (depth, n - 1)


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_trajectory_steps_and_end_point(kind):
    "Depth 1: steps from dense prefix patches; end point = whole-context patch."
    n = 7
    r = explore(kind, 1, n, 'whole', seed=1)
    blk, C, x = make_setting(kind, 1, n, seed=1)
    with torch.no_grad():
        a0 = blk.layer(None, x)
        P = [((blk.layer(C[:, :i], x) - a0) @ blk.mlp.W.T)[0, :, None]
             * (a0 / (a0 * a0).sum())[0, None, :] for i in range(1, n + 1)]
    norms = torch.stack([p.norm() for p in P])
    steps = torch.stack([(q - p).norm() for p, q in zip(P, P[1:])])
    assert _close(r.norm[0], norms) and _close(r.step[0], steps)
    assert patch_rel_diff(RankOne(r.u, r.v), r.last).max() <= 1e-10
    s = explore(kind, 3, n, 'whole', seed=1)               # a stack too
    assert patch_rel_diff(RankOne(s.u, s.v), s.last).max() <= 1e-10
    assert _close(s.norm[:, -1], s.dW_norm)


def test_explore_is_seeded_and_leaves_global_rng_alone():
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    a = explore('gru', 2, 9, 'prefix', k=4, seed=5)
    b = explore('gru', 2, 9, 'prefix', k=4, seed=5)
    c = explore('gru', 2, 9, 'prefix', k=4, seed=6)
    assert torch.equal(a.u, b.u) and torch.equal(a.step, b.step)
    assert not torch.equal(a.u, c.u)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2][1])


@pytest.mark.parametrize("args,kwargs,match", [
    (('transformer', 1, 8), {}, "layer kind must be one of"),
    (('softmax', 1, 0), {}, "n .*positive integer"),
    (('softmax', 0, 8), {}, "depth .*positive integer"),
    (('softmax', 1, 8, 'middle'), {}, "chunk must be one of"),
    (('softmax', 1, 8, [2, 8]), {}, "not part of the context"),
    (('softmax', 1, 8, []), {}, "empty"),
    (('softmax', 1, 8, 'prefix'), dict(k=9), r"1\.\.n = 1\.\.8"),
    (('softmax', 1, 8, 'suffix'), dict(k=0), "chunk size k"),
    (('lstm', 2, 8, 'suffix'), {}, "prefix"),
    (('lstm', 3, 8, [1, 2]), {}, "depth=1"),
])
def test_bad_inputs_raise_clear_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        explore(*args, **kwargs)


def test_update_is_fast():
    "The largest setting the sliders allow computes well under a second."
    explore('gru', 6, 128, 'prefix')                       # warm-up
    t = time.perf_counter(); explore('gru', 6, 128, 'prefix')
    assert time.perf_counter() - t < 1.0


def test_widget_controls_redraw_output():
    W = pytest.importorskip("ipywidgets", reason="ipywidgets not installed "
                            "(pip install ipywidgets, or the dev extra)")
    w = explorer(kind='linear', depth=1, n=12, chunk='scattered', k=3)
    assert isinstance(w, W.Widget)
    c = w.controls
    assert {'kind', 'depth', 'n', 'chunk'} <= set(c)
    assert tuple(c['kind'].options) == LAYER_KINDS
    assert tuple(c['chunk'].options) == CHUNKS
    for name in ('kind', 'depth', 'n', 'chunk'):      # all shown in the box
        assert any(c[name] in row.children for row in w.children[:2])
    first = w.output.outputs
    assert first and 'image/png' in first[0]['data']
    c['n'].value = 20
    second = w.output.outputs
    assert second != first and 'n = 20' in w.info.value
    c['kind'].value = 'lstm'
    assert w.output.outputs != second and 'lstm' in w.info.value
    c['depth'].value = 2                                  # stack: exact chunks
    assert tuple(c['chunk'].options) == STACK_CHUNKS
    assert c['chunk'].value == 'whole' and '2 layers' in w.info.value
    c['chunk'].value = 'prefix'
    assert 'positions 0, 1, 2 (3 tokens)' in w.info.value
    with pytest.raises(ValueError, match="layer kind"):
        explorer(kind='rnn')
