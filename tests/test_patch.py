"""The minimal token-patch: exactness, minimality, rank one, chunks, safety.

Property tests draw shapes, layer kinds, contexts, chunks and query lengths;
exactness is checked in float64 (1e-12) and float32 (1e-5).
"""
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from icl_book.blocks import LAYER_KINDS, RankOne, make_block
from icl_book.core import rel_err
from icl_book.patch import (chunk_mask, chunk_patch, patched_weights, remove_chunk,
                            token_patch, token_patch_factors)

SETTINGS = settings(max_examples=30, deadline=None)
kinds = st.sampled_from([(k, True) for k in LAYER_KINDS]
                        + [("softmax", False), ("linear", False)])


@SETTINGS
@given(H=st.integers(1, 12), d=st.integers(1, 8), lead=st.lists(st.integers(1, 3), max_size=2),
       seed=st.integers(0, 10**6))
def test_token_patch_solves_the_equation_with_rank_one(H, d, lead, seed):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(H, d, generator=g, dtype=torch.float64)
    a_full = torch.randn(*lead, d, generator=g, dtype=torch.float64)
    a_ref = torch.randn(*lead, d, generator=g, dtype=torch.float64)
    dW = token_patch(W, a_full, a_ref)
    assert dW.shape == (*lead, H, d)
    lhs = ((W + dW) @ a_ref[..., None])[..., 0]
    assert torch.allclose(lhs, a_full @ W.T, atol=1e-10, rtol=1e-10)
    ranks = torch.linalg.matrix_rank(dW.reshape(-1, H, d))
    nonzero = (W @ (a_full - a_ref).reshape(-1, d).T).norm(dim=0) > 1e-9
    assert torch.equal(ranks, nonzero.long())


@SETTINGS
@given(H=st.integers(1, 10), d=st.integers(2, 8), seed=st.integers(0, 10**6))
def test_token_patch_is_the_minimum_norm_solution(H, d, seed):
    g = torch.Generator().manual_seed(seed)
    W, a_full, a = (torch.randn(*s, generator=g, dtype=torch.float64)
                    for s in [(H, d), (d,), (d,)])
    dW = token_patch(W, a_full, a)
    # independent: least-norm solution of (aᵀ ⊗ I_H) vec(P) = W ΔA via pinv
    K = torch.kron(a[None], torch.eye(H, dtype=torch.float64))
    P_min = (torch.linalg.pinv(K) @ (W @ (a_full - a))).view(d, H).T
    assert torch.allclose(P_min, dW, atol=1e-10)
    # any other exact patch is dW + N with N a = 0, and is larger by ||N||²
    N = torch.randn(H, d, generator=g, dtype=torch.float64)
    N = N - torch.outer(N @ a, a) / a.dot(a)
    assert torch.allclose((W + dW + N) @ a, W @ a_full, atol=1e-9)
    assert abs((dW + N).norm() ** 2 - dW.norm() ** 2 - N.norm() ** 2) < 1e-8
    assert (dW + N).norm() >= dW.norm()


def _chunk(draw, n):
    kind = draw(st.sampled_from(["whole", "prefix", "suffix", "scattered", "mask"]))
    if kind == "whole":
        return list(range(n))
    k = draw(st.integers(1, n))
    if kind == "prefix":
        return list(range(k))
    if kind == "suffix":
        return list(range(n - k, n))
    if kind == "mask":
        return draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), kc=kinds, n=st.integers(1, 12), q=st.integers(1, 3),
       dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 10**6))
def test_patched_block_without_chunk_equals_block_with_context(data, kc, n, q, dtype, seed):
    kind, causal = kc
    blk = make_block(kind, d=6, d_hidden=12, heads=2, causal=causal, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    C = torch.randn(4, n, 6, generator=g).to(blk.W.dtype)
    x = torch.randn(4, q, 6, generator=g).to(blk.W.dtype)
    Y = _chunk(data.draw, n)
    with torch.no_grad():
        target = blk(C, x)
        dW = chunk_patch(blk, C, x, Y)
        out = blk(remove_chunk(C, Y), x, dW=dW)
    assert rel_err(out, target) <= (1e-12 if dtype == "float64" else 1e-5)


def test_functional_application_does_not_mutate():
    blk = make_block("gru")
    before = {k: v.clone() for k, v in blk.state_dict().items()}
    C, x = torch.randn(2, 5, 8).double(), torch.randn(2, 8).double()
    blk(None, x, dW=chunk_patch(blk, C, x))
    assert all(torch.equal(before[k], v) for k, v in blk.state_dict().items())


def test_in_place_patch_restores_bit_identical_weights_on_exception():
    blk = make_block("lstm", dtype="float32")
    C, x = torch.randn(1, 5, 8), torch.randn(1, 8)
    p = chunk_patch(blk, C, x)
    before = blk.W.detach().clone()
    with pytest.raises(KeyError):
        with patched_weights(blk.mlp.layers[0].weight, RankOne(p.u[0], p.v[0])):
            assert not torch.equal(blk.W, before)
            raise KeyError("boom")
    assert torch.equal(blk.W, before)


def test_in_place_patch_gives_the_context_output():
    blk = make_block("softmax")
    C, x = torch.randn(1, 9, 8).double(), torch.randn(1, 8).double()
    target = blk(C, x).detach()
    p = chunk_patch(blk, C, x)
    with patched_weights(blk.mlp.layers[0].weight, p.dense()[0]):
        assert rel_err(blk(None, x), target) < 1e-12


def test_zero_or_tiny_reference_norm_raises():
    W = torch.randn(4, 3).double()
    with pytest.raises(ValueError, match="zero norm"):
        token_patch(W, torch.ones(3).double(), torch.zeros(3).double())
    with pytest.raises(ValueError, match="zero norm"):
        token_patch(W, torch.ones(3).double(), torch.full((3,), 1e-200).double())
    with pytest.raises(ValueError, match="zero norm"):
        token_patch(W.float(), torch.ones(3) * 1e8, torch.ones(3) * 1e-3)
    with pytest.raises(ValueError, match="zero norm"):
        token_patch(W, torch.ones(3).double(), torch.ones(3).double(), min_norm=10.0)


def test_shape_and_dtype_errors_name_the_culprits():
    W = torch.randn(4, 3).double()
    with pytest.raises(ValueError, match=r"W: torch.float64, a_full: torch.float32"):
        token_patch(W, torch.ones(3), torch.ones(3).double())
    with pytest.raises(ValueError, match=r"same shape"):
        token_patch(W, torch.ones(2, 3).double(), torch.ones(3).double())
    with pytest.raises(ValueError, match=r"must be \(\.\.\., 3\)"):
        token_patch(W, torch.ones(5).double(), torch.ones(5).double())
    with pytest.raises(ValueError, match="matrix"):
        token_patch(W[0], torch.ones(3).double(), torch.ones(3).double())


def test_chunks_not_in_the_context_raise():
    C = torch.randn(1, 4, 2)
    with pytest.raises(ValueError, match="not part of the context"):
        remove_chunk(C, [4])
    with pytest.raises(ValueError, match="not part of the context"):
        remove_chunk(C, [-1])
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        chunk_mask([True, False], 4)
    with pytest.raises(ValueError, match="integer positions"):
        chunk_mask([0.5], 4)
    blk = make_block("softmax")
    with pytest.raises(ValueError, match="context tensor"):
        chunk_patch(blk, None, torch.randn(1, 8).double())
    with pytest.raises(ValueError, match="weights are torch.float64"):
        chunk_patch(blk, torch.randn(1, 3, 8), torch.randn(1, 8))


def test_empty_chunk_gives_zero_patch():
    blk = make_block("elman")
    C, x = torch.randn(2, 5, 8).double(), torch.randn(2, 8).double()
    p = token_patch_factors(blk.W.detach(), blk.A(C, x).detach(), blk.A(C, x).detach())
    assert torch.equal(p.u, torch.zeros_like(p.u))
    assert rel_err(blk(remove_chunk(C, []), x, dW=chunk_patch(blk, C, x, [])), blk(C, x)) < 1e-14


# ----------------------------------------------------------------------------
# bad input: a clear error (what was wrong, what to do), or a correct result
from icl_book import patch  # noqa: E402
from _inputs import BAD  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['patch']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['patch'][case]
    with pytest.raises(exc, match=words):
        fn()


@pytest.mark.parametrize('Y', [
    torch.tensor([3, 0], dtype=torch.uint8), torch.tensor([0, 3], dtype=torch.int8),
    torch.tensor([0, 3], dtype=torch.int16), {3, 0}, (i for i in (0, 3)), range(0, 4, 3)])
def test_chunk_of_any_integer_kind_means_its_positions(Y):
    want = torch.tensor([True, False, False, True, False])
    assert torch.equal(patch.chunk_mask(Y, 5), want)
