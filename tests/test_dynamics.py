"""Implicit learning dynamics: the two GD forms, linear attention as GD, and
one-pass trajectories against the naive loop of forward passes.

Property tests draw layer kinds, widths, context lengths, batch sizes and
seeds; identities are checked in float64 against independent computations
(per-prefix token-patches, step-by-step absorption with the theorem, autograd).
No timing is asserted here: speed is the benchmark's business.
"""
import json
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from icl_book.blocks import (LAYER_KINDS, LinearAttention, PreLNStack, RankOne,
                             StackConfig, make_block)
from icl_book.core import rel_err
from icl_book.dynamics import (absorption_gd, additive_gd, end_points,
                               gd_iterates, gd_linear_attention, implicit_loss,
                               product_form, regression_tokens)
from icl_book.experiments.trajectories import bench_trajectory
from icl_book.trajectories import (TrajectoryStats,
                                   block_trajectory, block_trajectory_naive,
                                   prefix_outputs, prefix_streams,
                                   stack_trajectory, stack_trajectory_naive,
                                   trajectory_rel_diff, trajectory_stats,
                                   trajectory_summaries)
from icl_book.patch import chunk_patch, token_patch

SETTINGS = settings(max_examples=25, deadline=None)
kinds = st.sampled_from([(k, True) for k in LAYER_KINDS]
                        + [("softmax", False), ("linear", False)])
F64 = torch.float64


def _data(seed, B, n, d):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, n, d, generator=g, dtype=F64),
            torch.randn(B, d, generator=g, dtype=F64))


def _prefix_loop(layer, C, x):
    return torch.stack([layer(C[:, :i], x) for i in range(C.shape[1] + 1)], 1)


def _suffix_loop(layer, C, x):
    return torch.stack([layer(C[:, k:], x) for k in range(C.shape[1] + 1)], 1)


@SETTINGS
@given(kind=kinds, n=st.integers(1, 7), d=st.integers(2, 6), H=st.integers(1, 12),
       B=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_additive_form_is_gd_with_the_prefix_patches_as_iterates(kind, n, d, H, B, seed):
    blk = make_block(kind[0], d=d, d_hidden=H, heads=2 if d % 2 == 0 else 1,
                     causal=kind[1], seed=seed)
    C, x = _data(seed, B, n, d)
    W = blk.W.detach()
    with torch.no_grad():
        gd = additive_gd(_prefix_loop(blk.layer, C, x))
    assert torch.allclose(gd.h, gd.h[..., :1].expand_as(gd.h))      # constant step
    for i, Wi in enumerate(gd_iterates(W, gd)):
        if i < n:                                # ∇ tr(Δᵀ W) = Δ, by autograd
            Wg = Wi.detach().clone().requires_grad_()
            implicit_loss(Wg, gd.grad(W, i)).sum().backward()
            assert torch.allclose(Wg.grad, gd.grad(W, i).dense(), atol=1e-12)
        if i == 0:
            continue
        with torch.no_grad():
            ref = W + chunk_patch(blk, C[:, :i], x).dense()
            assert rel_err(Wi.flatten(1), ref.flatten(1)) < 1e-11
            assert rel_err(blk(None, x, dW=Wi - W), blk(C[:, :i], x)) < 1e-10
        sv = torch.linalg.svdvals(Wi - W)                 # rank <= 1 (up to round-off)
        assert (sv[..., 1:] <= 1e-12 * W.norm()).all()


@SETTINGS
@given(kind=kinds, n=st.integers(1, 7), d=st.integers(2, 6), H=st.integers(1, 12),
       B=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_product_form_is_sequential_absorption_and_never_smaller(kind, n, d, H, B, seed):
    blk = make_block(kind[0], d=d, d_hidden=H, heads=1, causal=kind[1], seed=seed)
    C, x = _data(seed, B, n, d)
    W = blk.W.detach()
    with torch.no_grad():
        a = _suffix_loop(blk.layer, C, x)
        target = blk(C, x)
        Wk = W.expand(B, *W.shape)
        for k in range(1, n + 1):                # the theorem, current weights
            Wk = Wk + torch.stack([token_patch(Wk[b], a[b, k - 1], a[b, k])
                                   for b in range(B)])
            assert rel_err(blk(C[:, k:], x, dW=Wk - W), target) < 1e-10
        gd = absorption_gd(a)
        *_, Wn = gd_iterates(W, gd)
        assert rel_err(Wn.flatten(1), Wk.flatten(1)) < 1e-11
        assert rel_err(product_form(W, gd).flatten(1), Wk.flatten(1)) < 1e-11
        e = end_points(W, _prefix_loop(blk.layer, C, x), a)
        for P in (e["P_add"], e["P_prod"]):
            assert rel_err(blk(None, x, dW=P), target) < 1e-10
    fro = lambda M: torch.linalg.matrix_norm(M)
    scale = fro(e["P_prod"]) ** 2 + 1e-300
    assert ((fro(e["P_prod"]) ** 2 - fro(e["P_add"]) ** 2 - fro(e["N"]) ** 2).abs()
            <= 1e-9 * scale).all()
    assert (fro(e["P_prod"]) >= fro(e["P_add"]) * (1 - 1e-12)).all()


@SETTINGS
@given(dx=st.integers(1, 6), m=st.integers(1, 12), B=st.integers(1, 3),
       eta=st.floats(0.05, 2.0), seed=st.integers(0, 10**6))
def test_linear_attention_context_vector_is_one_gd_step(dx, m, B, eta, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, m, dx, generator=g, dtype=F64)
    y = (X @ torch.randn(B, dx, 1, generator=g, dtype=F64))[..., 0]
    x_q = torch.randn(B, dx, generator=g, dtype=F64)
    w0 = torch.randn(dx, generator=g, dtype=F64)
    layer = gd_linear_attention(w0, eta, m)
    assert isinstance(layer, LinearAttention)
    C, xq = regression_tokens(X, y, x_q)
    with torch.no_grad():
        A = prefix_outputs(layer, C, xq)
    for i in range(m + 1):                           # autograd GD on i examples
        w = w0.expand(B, dx).clone().requires_grad_()
        ((X[:, :i] @ w[..., None])[..., 0] - y[:, :i]).pow(2).sum().div(2 * m).backward()
        y_i = ((w - eta * w.grad) * x_q).sum(-1).detach()
        want = torch.zeros(B, dx + 1, dtype=F64)
        want[:, -1] = y_i - (w0 * x_q).sum(-1)
        assert torch.allclose(A[:, i] - A[:, 0], want, atol=1e-10)
    # implicit gradient of token i+1 = explicit per-example gradient along x_q
    blk = make_block("linear", d=dx + 1, d_hidden=8, heads=1, seed=seed)
    blk.layer = layer
    gd, W = additive_gd(A), blk.W.detach()
    e_y = torch.eye(dx + 1, dtype=F64)[-1]
    g_ex = ((X @ w0 - y)[..., None] * X * x_q[:, None]).sum(-1)       # (B, m)
    for i in range(m):
        want = (eta / m * g_ex[:, i, None, None]
                * torch.einsum("h,bd->bhd", W @ e_y, A[:, 0]))
        assert torch.allclose(gd.grad(W, i).dense(), want, atol=1e-10)


@SETTINGS
@given(kind=kinds, n=st.integers(1, 9), B=st.integers(1, 3), heads=st.sampled_from([1, 2]),
       seed=st.integers(0, 10**6))
def test_one_pass_prefix_outputs_and_block_trajectory_match_the_loop(kind, n, B, heads, seed):
    d = 4
    blk = make_block(kind[0], d=d, d_hidden=6, heads=heads, causal=kind[1], seed=seed)
    C, x = _data(seed, B, n, d)
    with torch.no_grad():
        assert torch.allclose(prefix_outputs(blk.layer, C, x),
                              _prefix_loop(blk.layer, C, x), atol=1e-12)
        fast, slow = block_trajectory(blk, C, x), block_trajectory_naive(blk, C, x)
    assert fast.u.shape == (B, n, 6) and fast.v.shape == (B, n, d)
    assert torch.allclose(fast.dense(), slow.dense(), atol=1e-12)


stack_kinds = st.sampled_from(["softmax", "linear", "elman", "gru", "lstm"])


@SETTINGS
@given(kind=stack_kinds, depth=st.integers(1, 3), n=st.integers(1, 7), B=st.integers(1, 2),
       mode=st.sampled_from(["bias", "rank1"]), d_in=st.sampled_from([None, 3]),
       seed=st.integers(0, 10**6))
def test_one_pass_stack_trajectory_matches_the_loop(kind, depth, n, B, mode, d_in, seed):
    attn = kind in ("softmax", "linear")
    net = PreLNStack(StackConfig(depth=depth, d_model=8, heads=2 if attn else 1,
                                 d_mlp=12, kind=kind, d_in=d_in, seed=seed % 1000,
                                 dtype="float64"))
    C, x = _data(seed, B, n, d_in or 8)
    with torch.no_grad():
        fast = stack_trajectory(net, C, x, mode)
        slow = stack_trajectory_naive(net, C, x, mode)
        seen = []
        assert stack_trajectory(net, C, x, mode, on_layer=lambda l, p: seen.append(l)) is None
    assert seen == list(range(depth))
    assert len(fast) == depth and fast[0].dW.u.shape == (B, n, 12)
    assert trajectory_rel_diff(fast, slow) < 1e-10
    some = [1, n] if n > 1 else [1]
    with torch.no_grad():
        part = stack_trajectory_naive(net, C, x, mode, prefixes=some)
    assert trajectory_rel_diff(fast, part, some) < 1e-10


def test_float32_stack_trajectory_is_close_to_the_float64_loop():
    cfg = StackConfig(depth=3, d_model=16, heads=4, d_mlp=32, seed=3)
    C, x = _data(0, 2, 24, 16)
    with torch.no_grad():
        fast = stack_trajectory(PreLNStack(cfg), C.float(), x.float())
        slow = stack_trajectory_naive(PreLNStack(replace(cfg, dtype="float64")), C, x)
    assert trajectory_rel_diff(fast, slow) < 1e-3


@SETTINGS
@given(n=st.integers(3, 8), B=st.integers(1, 4), chunk=st.integers(1, 4),
       seed=st.integers(0, 10**6))
def test_streaming_statistics_equal_dense_ones(n, B, chunk, seed):
    net = PreLNStack(StackConfig(depth=2, d_model=8, heads=2, d_mlp=12,
                                 seed=seed % 1000, dtype="float64"))
    blk = make_block("softmax", d=8, d_hidden=12, seed=seed)
    C, x = _data(seed, B, n, 8)
    with torch.no_grad():
        trajs = [block_trajectory(blk, C, x)] + [p.dW for p in stack_trajectory(net, C, x)]
    for P in trajs:
        f = P.dense().flatten(2)
        Df = f[:, 1:] - f[:, :-1]
        cos = lambda a, b: (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        got = trajectory_summaries(P)
        assert torch.allclose(got["norm"], f.norm(dim=-1), atol=1e-12)
        assert torch.allclose(got["step"], Df.norm(dim=-1), atol=1e-12)
        assert torch.allclose(got["cos_final"], cos(f, f[:, -1:]), atol=1e-9)
        assert torch.allclose(got["cos_step"], cos(Df[:, :-1], Df[:, 1:]), atol=1e-8)
    stats = trajectory_stats(net, C, x, chunk=chunk)
    with torch.no_grad():
        layers = stack_trajectory(net, C, x)
    for l, p in enumerate(layers):
        whole = trajectory_summaries(p.dW, p.db_out)
        for k in ("norm", "step", "cos_step", "db_step"):
            assert torch.allclose(stats.mean(k)[l], whole[k].mean(0), atol=1e-12)
            sd = whole[k].std(0, unbiased=False) if B > 1 else torch.zeros_like(whole[k][0])
            assert torch.allclose(stats.std(k)[l], sd, atol=1e-6)


def test_softmax_attention_step_is_sgd_with_the_new_tokens_weight():
    blk = make_block("softmax", d=6, d_hidden=8, heads=1, seed=1)
    att = blk.layer
    C, x = _data(1, 3, 10, 6)
    with torch.no_grad():
        A = prefix_outputs(att, C, x)
        s = (att.k(C) @ att.q(x)[..., None])[..., 0] / math.sqrt(6)
        s_x = (att.k(x) * att.q(x)).sum(-1, keepdim=True) / math.sqrt(6)
        p = (s - torch.logcumsumexp(torch.cat([s_x, s], 1), 1)[:, 1:]).exp()
        sgd = A[:, :-1] + p[..., None] * (att.o(att.v(C)) - A[:, :-1])
    assert rel_err(sgd, A[:, 1:]) < 1e-12


def test_bad_inputs_are_refused_with_a_reason():
    cfg = StackConfig(depth=2, d_model=8, heads=2, d_mlp=12, dtype="float64")
    C, x = _data(0, 2, 5, 8)
    with pytest.raises(ValueError, match="bidirectionally"):
        stack_trajectory(PreLNStack(replace(cfg, causal=False)), C, x)
    net = PreLNStack(cfg)
    with pytest.raises(ValueError, match="empty"):
        stack_trajectory(net, C[:, :0], x)
    with pytest.raises(ValueError, match="one query per context"):
        stack_trajectory(net, C, x[:1])
    with pytest.raises(ValueError, match=r"1\.\.5"):
        stack_trajectory_naive(net, C, x, prefixes=[0, 3])
    with pytest.raises(TypeError, match="PreLNStack"):
        stack_trajectory(make_block(), C, x)
    with pytest.raises(ValueError, match="stream per prefix"):
        prefix_streams(net.blocks[0].layer, C, C)
    with pytest.raises(TypeError, match="no batched prefix"):
        prefix_streams(torch.nn.Identity(), C, torch.cat([C, x[:, None]], 1))
    with pytest.raises(ValueError, match="n >= 1"):
        additive_gd(torch.randn(2, 1, 8, dtype=F64))
    with pytest.raises(ValueError, match="absorption"):
        product_form(torch.randn(4, 8, dtype=F64), additive_gd(torch.randn(3, 8, dtype=F64)))
    with pytest.raises(ValueError, match="zero norm"):   # w0 = 0: A(x) = 0, no patch
        lin = gd_linear_attention(torch.zeros(3, dtype=F64), 0.5, 4)
        Ct, xt = regression_tokens(torch.randn(1, 4, 3, dtype=F64),
                                   torch.randn(1, 4, dtype=F64), torch.randn(1, 3, dtype=F64))
        blk = make_block("linear", d=4, d_hidden=5, heads=1)
        blk.layer = lin
        with torch.no_grad():
            block_trajectory(blk, Ct, xt)


def test_bench_trajectory_reports_json_with_agreement():
    r = bench_trajectory(n=6, layers=2, d_model=8, heads=2, d_mlp=16, repeats=1, check=3)
    json.dumps(r)
    for k in ("speedup", "max_rel_diff", "forward_ratio", "t_naive", "t_batched",
              "t_forward", "n", "layers", "d_model", "checked_prefixes"):
        assert k in r
    assert r["n"] == 6 and r["layers"] == 2 and r["max_rel_diff"] < 1e-9


def test_trajectories_refuse_weights_of_another_dtype():
    "Block and stack trajectories name the model's dtype (blocks.check_weights)."
    C, x = _data(0, 2, 5, 8)
    net = PreLNStack(StackConfig(depth=2, d_model=8, heads=2, d_mlp=12,
                                 dtype="float64"))
    with pytest.raises(ValueError, match="the model's weights are torch.float64"):
        stack_trajectory(net, C.float(), x.float())
    blk = make_block("softmax", d=8)
    with pytest.raises(ValueError, match="the model's weights are torch.float64"):
        block_trajectory(blk, C.float(), x.float())


# ----------------------------------------------------------------------------
# bad input: a clear error (what was wrong, what to do), or a correct result
from _inputs import BAD  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['dynamics']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['dynamics'][case]
    with pytest.raises(exc, match=words):
        fn()
