"""The static thought patch: closed form, special cases, layerwise deep fit, errors."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from icl_book.blocks import PreLNStack, StackConfig, make_block
from icl_book.patch import token_patch
from icl_book.thought import (FIT_KINDS, block_patch_error, fit_block_thought_patch,
                              fit_linear_patch, fit_stack_thought_patch,
                              stack_patch_error)

SETTINGS = settings(max_examples=30, deadline=None)


@SETTINGS
@given(K=st.integers(1, 40), d=st.integers(1, 8), H=st.integers(1, 8),
       lam=st.sampled_from([0.0, 1e-2, 1.0]), bias=st.booleans(), seed=st.integers(0, 10**6))
def test_fit_is_a_stationary_point_of_the_ridge_objective(K, d, H, lam, bias, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(K, d, generator=g, dtype=torch.float64)
    V = torch.randn(K, H, generator=g, dtype=torch.float64)
    M, beta = fit_linear_patch(A, V, lam, bias=bias, rcond=1e-12)
    R = A @ M.T + (beta if bias else 0) - V                       # residuals (K, H)
    grad_M = R.T @ A + lam * M                                     # ∂L/∂M / 2
    if lam > 0 or K >= d:   # unique solution: the gradient must vanish
        assert grad_M.abs().max() < 1e-8 * (1 + V.abs().max() * A.abs().max() * K)
    else:                   # K < d, no ridge: the min-norm solution interpolates
        assert R.abs().max() < 1e-8 * (1 + V.abs().max())
        # ... and is the smallest interpolant: its rows lie in the span of the data
        Ac = A - A.mean(0) if bias else A
        assert (M - M @ torch.linalg.pinv(Ac) @ Ac).abs().max() < 1e-8 * (1 + M.abs().max())
    if bias:
        assert R.sum(0).abs().max() < 1e-8 * K * (1 + V.abs().max())


@SETTINGS
@given(H=st.integers(1, 8), d=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_one_query_gives_the_minimal_token_patch(H, d, seed):
    g = torch.Generator().manual_seed(seed)
    W, a_full, a = (torch.randn(*s, generator=g, dtype=torch.float64)
                    for s in [(H, d), (d,), (d,)])
    M, _ = fit_linear_patch(a[None], (W @ (a_full - a))[None])
    assert torch.allclose(M, token_patch(W, a_full, a), atol=1e-10)


def test_rank_budget_and_interpolation():
    g = torch.Generator().manual_seed(0)
    A, V = torch.randn(30, 6, generator=g).double(), torch.randn(30, 9, generator=g).double()
    for r in (1, 2, 3):
        assert torch.linalg.matrix_rank(fit_linear_patch(A, V, rank=r)[0]).item() == r
    M, _ = fit_linear_patch(A[:5], V[:5])
    assert torch.allclose(A[:5] @ M.T, V[:5], atol=1e-10)


def _ridge_objective(A, V, M, b, lam):
    return (((A @ M.T + b - V) ** 2).sum() + lam * (M ** 2).sum()).item()


@settings(max_examples=15, deadline=None)
@given(K=st.integers(3, 20), d=st.integers(2, 5), lam=st.sampled_from([0.0, 0.5, 3.0]),
       bias=st.booleans(), seed=st.integers(0, 10**6))
def test_rank_budget_is_the_constrained_optimum_with_ridge(K, d, lam, bias, seed):
    "rank=1 with H = 2: no rank-1 M (a fine scan of directions u) does better."
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(K, d, generator=g, dtype=torch.float64)
    V = torch.randn(K, 2, generator=g, dtype=torch.float64) + A[:, :2]
    M, b = fit_linear_patch(A, V, lam, rank=1, bias=bias, rcond=1e-12)
    J = _ridge_objective(A, V, M, b if bias else 0, lam)
    Ac, Vc = (A - A.mean(0), V - V.mean(0)) if bias else (A, V)
    G = Ac.T @ Ac + lam * torch.eye(d, dtype=torch.float64)   # M = u wᵀ, |u| = 1:
    t = torch.linspace(0, torch.pi, 100001, dtype=torch.float64)   # best w per u
    us = torch.stack([t.cos(), t.sin()], 1)
    Ws = us @ (torch.linalg.pinv(G) @ Ac.T @ Vc).T              # (N, d)
    F = Ac @ Ws.T
    Ju = ((Vc ** 2).sum() - 2 * (F * (Vc @ us.T)).sum(0) + (F ** 2).sum(0)
          + lam * (Ws ** 2).sum(1))
    best = Ju.min().item()
    assert J <= best + 1e-10 * (1 + J)                          # never beaten
    assert best - J < 1e-7 * (1 + J)                             # and attained


def test_single_block_patch_exact_for_one_query_and_generalises():
    blk = make_block("softmax", d=8, d_hidden=32)
    g = torch.Generator().manual_seed(3)
    C = torch.randn(10, 8, generator=g).double()
    X = torch.randn(400, 8, generator=g).double()
    M, b = fit_block_thought_patch(blk, C, X[:1])
    assert block_patch_error(blk, C, X[:1], M, b) < 1e-20
    M, b = fit_block_thought_patch(blk, C, X[:200], lam=1e-3, bias=True)
    assert block_patch_error(blk, C, X[200:], M, b) < 0.1 * block_patch_error(blk, C, X[200:])


@pytest.mark.parametrize("kind", ["softmax", "linear", "gru"])
def test_deep_fit_is_exact_for_one_query(kind):
    net = PreLNStack(StackConfig(depth=3, d_model=8, heads=2, d_mlp=16, kind=kind,
                                 d_in=5, d_out=1, dtype="float64", seed=1))
    g = torch.Generator().manual_seed(4)
    C, X = torch.randn(7, 5, generator=g).double(), torch.randn(1, 5, generator=g).double()
    tp = fit_stack_thought_patch(net, C, X)
    assert stack_patch_error(net, C, X, tp) < 1e-24 * (1 + stack_patch_error(net, C, X))
    assert tp.numel() == 3 * (16 * 8 + 16 + 8 * 16 + 8)   # M, β, M_out, δ per layer


def test_deep_fit_does_not_mutate_and_orders_baselines():
    net = PreLNStack(StackConfig(depth=2, d_model=8, heads=2, d_mlp=16, dtype="float64"))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    C, X = torch.randn(6, 8, generator=g).double(), torch.randn(200, 8, generator=g).double()
    errs = {k: stack_patch_error(net, C, X[100:], fit_stack_thought_patch(
        net, C, X[:100], k, **({"lam": 1e-3} if k == "lstsq" else {}))) for k in FIT_KINDS}
    assert errs["lstsq"] < errs["none"] and errs["bias"] < errs["none"]
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_bad_inputs():
    A = torch.randn(5, 3).double()
    with pytest.raises(ValueError, match="same K"):
        fit_linear_patch(A, torch.randn(4, 2).double())
    with pytest.raises(ValueError, match="share one dtype"):
        fit_linear_patch(A, torch.randn(5, 2))
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        fit_linear_patch(A, torch.randn(5, 2).double(), rank=0)
    net = PreLNStack(StackConfig(depth=1, d_model=8, heads=2, d_mlp=16, dtype="float64"))
    with pytest.raises(ValueError, match="kind must be one of"):
        fit_stack_thought_patch(net, torch.randn(3, 8).double(), torch.randn(2, 8).double(), "magic")
    with pytest.raises(ValueError, match="one context"):
        fit_stack_thought_patch(net, torch.randn(1, 3, 8).double(), torch.randn(2, 8).double())


# ----------------------------------------------------------------------------
# bad input: a clear error (what was wrong, what to do), or a correct result
from _inputs import BAD  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['thought']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['thought'][case]
    with pytest.raises(exc, match=words):
        fn()
