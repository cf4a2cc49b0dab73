"""The thought-patch toolbox on a real model's code path (icl_book.lm_thought),
tested directly: padding, the metrics, the closed-loop fit, applying a patch,
and rank budgets. A tiny random Llama in float64 stands in for
SmolLM2; no weights are downloaded.
"""
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from icl_book.families import tiny_model  # noqa: E402
from icl_book.lm_thought import (  # noqa: E402
    budget_rank, compression_metrics, fit_thought_patch, pad_batch,
    patch_numel, prompt_states, reduced_rank_fit, teacher_forced,
    thought_patched)
from icl_book.thought import fit_linear_patch  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", seed=5)             # 3 layers, float64
    g = torch.Generator().manual_seed(0)
    P = torch.randint(2, 97, (1, 7), generator=g)   # a stand-in prompt
    ids = torch.randint(2, 97, (6, 5), generator=g)
    return model, P, ids, torch.ones_like(ids, dtype=torch.bool)


def test_pad_batch_pads_right_and_refuses_empty():
    ids, mask = pad_batch([[5, 6, 7], [8]], pad=1)
    assert ids.tolist() == [[5, 6, 7], [8, 1, 1]]
    assert mask.tolist() == [[True] * 3, [True, False, False]]
    for bad in ([], [[1], []]):
        with pytest.raises(ValueError, match="non-empty"):
            pad_batch(bad)


def test_compression_metrics_by_hand():
    lp = torch.log(torch.tensor([[[.7, .2, .1], [.1, .8, .1]]],
                                dtype=torch.float64))         # (1, 2, 3)
    # position 0 predicts the answer token ids[0, 1]: its arg-max is 0
    ids, answer = torch.tensor([[1, 0]]), torch.tensor([[True, False]])
    same = compression_metrics(lp, lp, ids, answer)
    assert same["kl"] == 0 and same["accuracy"] == 1.0
    assert same["accuracy_first"] == 1.0
    wrong = torch.tensor([[1, 2]])                 # the answer is not 0
    assert compression_metrics(lp, lp, wrong, answer)["accuracy"] == 0.0
    flat = torch.full_like(lp, -torch.log(torch.tensor(3.)).item())
    kl = (lp[0, 0].exp() * (lp[0, 0] - flat[0, 0])).sum().item()
    assert abs(compression_metrics(lp, flat, ids, answer)["kl"] - kl) < 1e-12


def test_kind_none_is_no_patch_and_lstsq_out_moves_toward_the_prompt(setup):
    model, P, ids, mask = setup
    none = fit_thought_patch(model, P, ids, mask, "none")
    assert all(t is None for t in none.M + none.beta + none.M_out
               + none.delta)
    plain = teacher_forced(model, P, ids)
    assert torch.equal(teacher_forced(model, P, ids, none), plain)
    ref = teacher_forced(model, P, ids, prompt=True)
    kl = lambda lp: (ref.exp() * (ref - lp)).sum(-1).mean().item()
    states = prompt_states(model, P, ids, mask)
    tp = fit_thought_patch(model, P, ids, mask, "lstsq_out", lam=1e-3,
                           states=states)
    assert kl(teacher_forced(model, P, ids, tp)) < 0.5 * kl(plain)
    with pytest.raises(ValueError, match="kind must be one of"):
        fit_thought_patch(model, P, ids, mask, "lstsq_in")


def test_thought_patched_equals_teacher_forced_and_cleans_up(setup):
    model, P, ids, mask = setup
    tp = fit_thought_patch(model, P, ids, mask, "lstsq")
    x = torch.cat([P[:, :1].expand(6, 1), ids], 1)
    pos = torch.cat([torch.zeros(1, dtype=torch.long),
                     torch.arange(P.shape[1], P.shape[1] + ids.shape[1])])
    with torch.no_grad(), thought_patched(model, tp):
        lp = model(x, position_ids=pos.expand(6, -1),
                   attention_mask=torch.ones_like(x)).logits[:, 1:]
    want = teacher_forced(model, P, ids, tp)
    assert (lp.log_softmax(-1) - want).abs().max() < 1e-10
    with torch.no_grad():
        before = model(x).logits
    with pytest.raises(RuntimeError, match="boom"):
        with thought_patched(model, tp):
            raise RuntimeError("boom")
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)       # hooks removed
    assert not model.model._forward_pre_hooks         # the base's too
    short = type(tp)(tp.M[:2], tp.beta[:2], tp.M_out[:2], tp.delta[:2])
    with pytest.raises(ValueError, match="the patch has 2 layers"):
        with thought_patched(model, short):
            pass


def test_rank_budget_and_reduced_rank_fit(setup):
    model, P, ids, mask = setup
    r = budget_rank(model, 1000)
    tp = fit_thought_patch(model, P, ids, mask, "lstsq_out", rank=r)
    assert patch_numel(tp, r) <= 1000
    assert [torch.linalg.matrix_rank(M).item() for M in tp.M_out] == [r] * 3
    with pytest.raises(ValueError, match="below the rank-1"):
        budget_rank(model, 100)
    with pytest.raises(TypeError, match="an int"):
        budget_rank(model, 1000.0)
    g = torch.Generator().manual_seed(1)
    A = torch.randn(5, 9, dtype=torch.float64, generator=g)    # K < d: dual
    V = torch.randn(5, 4, dtype=torch.float64, generator=g)
    for got, want in zip(reduced_rank_fit(A, V, 0.3),
                         fit_linear_patch(A, V, 0.3, bias=True)):
        assert (got - want).abs().max() < 1e-12



def _J(A, V, M, b, lam):
    "The fit's objective, computed directly."
    return (((A @ M.T + b - V) ** 2).sum() + lam * (M ** 2).sum()).item()


def _brute_rank_r(A, V, lam, r, starts=6, seed=0):
    "min J over rank-r factorisations M = P Qᵀ (β = v̄ − M ā), L-BFGS."
    a, v = A.mean(0), V.mean(0)
    g, best = torch.Generator().manual_seed(seed), float("inf")
    for _ in range(starts):
        P = torch.randn(V.shape[1], r, dtype=A.dtype, generator=g)
        Q = torch.randn(A.shape[1], r, dtype=A.dtype, generator=g)
        P.requires_grad_(), Q.requires_grad_()
        opt = torch.optim.LBFGS([P, Q], max_iter=2000, tolerance_grad=1e-13,
                                tolerance_change=1e-15,
                                line_search_fn="strong_wolfe")

        def loss():
            opt.zero_grad()
            M = P @ Q.T
            J = ((((A - a) @ M.T - (V - v)) ** 2).sum()
                 + lam * (M ** 2).sum())
            J.backward()
            return J
        for _ in range(3):
            opt.step(loss)
        with torch.no_grad():
            M = P @ Q.T
            best = min(best, _J(A, V, M, v - M @ a, lam))
    return best


@pytest.mark.parametrize("K,d,H,lam", [
    (20, 5, 4, 0.0),     # H <= d: eigenvectors of the (H, H) Gram matrix
    (20, 5, 4, 0.4),
    (20, 3, 6, 0.0),     # H > d: through the (d, d) factor B
    (20, 3, 6, 0.4),
    (6, 8, 4, 0.4),      # K < d: the dual ridge solve first
])
def test_reduced_rank_fit_rank_2_beats_brute_force_and_svd(K, d, H, lam):
    g = torch.Generator().manual_seed(K + d + H)
    A = torch.randn(K, d, dtype=torch.float64, generator=g)
    V = (A @ torch.randn(d, H, dtype=torch.float64, generator=g)
         + 0.3 * torch.randn(K, H, dtype=torch.float64, generator=g) + 1.)
    M, b = reduced_rank_fit(A, V, lam, rank=2)
    assert torch.linalg.matrix_rank(M).item() == 2
    J = _J(A, V, M, b, lam)
    brute = _brute_rank_r(A, V, lam, 2)
    assert J <= brute * (1 + 1e-9) and brute - J < 1e-7 * J
    # the closed form written directly: Ŵ V_r V_rᵀ, V_r the top right
    # singular vectors of the augmented fitted values [A_c; √λ I] Ŵᵀ
    Mh, _ = fit_linear_patch(A, V, lam, bias=True)
    aug = torch.cat([A - A.mean(0), lam ** .5 * torch.eye(d,
                                                          dtype=A.dtype)])
    Vr = torch.linalg.svd(aug @ Mh.T).Vh[:2].T                    # (H, 2)
    assert (M - Vr @ Vr.T @ Mh).abs().max() < 1e-10 * Mh.abs().max()
    # the truncated SVD of Ŵ stores as much and fits worse
    U, s, Vh = torch.linalg.svd(Mh, full_matrices=False)
    Ms = (U[:, :2] * s[:2]) @ Vh[:2]
    assert J <= _J(A, V, Ms, V.mean(0) - Ms @ A.mean(0), lam)


# ---- the MLP bypass and per-layer ranks --------------------------------------
def test_mlp_bypass_is_applied_as_it_was_fitted(setup):
    """Full rank, no ridge to speak of: 30 positions, d = 32 inputs per layer,
    so each layer's fit interpolates and the patched run without the prompt
    reproduces the with-prompt log-probs; off by the MLP's input (reading g,
    or adding nowhere) it would not."""
    from icl_book.lm_thought import MlpPatch
    model, P, ids, mask = setup
    tp = fit_thought_patch(model, P, ids, mask, "lstsq_mlp", lam=1e-12)
    assert isinstance(tp, MlpPatch) and tp.M_out[0].shape == (32, 32)
    ref = teacher_forced(model, P, ids, prompt=True)
    assert (teacher_forced(model, P, ids, tp) - ref).abs().max() < 1e-8
    none = teacher_forced(model, P, ids)
    assert (none - ref).abs().max() > 1e-2             # the prompt matters
    with thought_patched(model, tp):       # a plain call: the same numbers
        x = torch.cat([P[:, :1].expand(6, 1), ids], 1)
        pos = torch.cat([torch.zeros(1, dtype=torch.long),
                         torch.arange(7, 12)])
        with torch.no_grad():
            lp = model(x, position_ids=pos.expand(6, 6),
                       attention_mask=torch.ones_like(x)).logits[:, 1:]
    assert (lp.log_softmax(-1) - ref).abs().max() < 1e-8


def test_per_layer_ranks_and_budget_ranks(setup):
    from icl_book.lm_thought import budget_ranks
    model, P, ids, mask = setup
    for kind, m in (("lstsq_out", 64), ("lstsq_mlp", 32)):
        tp = fit_thought_patch(model, P, ids, mask, kind, [0, 2, 1])
        got = [None if M is None else torch.linalg.matrix_rank(M).item()
               for M in tp.M_out]
        assert got == [None, 2, 1]
        assert patch_numel(tp, [0, 2, 1]) == 3 * (32 + m) + 3 * 32
        assert patch_numel(tp, [0, 2, 1]) == sum(
            r * sum(M.shape) for r, M in zip([2, 1], tp.M_out[1:])) + sum(
            d.numel() for d in tp.delta)
    one = 3 * (1 * 64 + 32)                           # rank 1, lstsq_mlp
    assert budget_ranks(model, one, "lstsq_mlp") == [1, 1, 1]
    assert budget_ranks(model, one + 64, "lstsq_mlp", [2, 1, 0]) == [1, 1, 2]
    assert budget_ranks(model, one + 64, "lstsq_mlp", [0, 1, 2]) == [2, 1, 1]
    assert budget_ranks(model, one + 63, "lstsq_mlp", [2, 1, 0]) == [1, 1, 1]
    with pytest.raises(ValueError, match="below the rank-1 lstsq_mlp"):
        budget_ranks(model, one - 1, "lstsq_mlp")
    for bad in ([1, 2], [1, -1, 1], 0, [1.5, 1, 1]):
        with pytest.raises(ValueError):
            fit_thought_patch(model, P, ids, mask, "lstsq_mlp", bad)


def test_a_budget_below_rank_1_everywhere_starts_from_the_bias(setup):
    """With an order, a budget below rank 1 on every layer keeps δ everywhere
    and gives rank 1 to the layers of the order that fit; without, refused."""
    from icl_book.lm_thought import budget_ranks
    model, P, ids, mask = setup
    bias = 3 * 32                                       # δ on 3 layers
    assert budget_ranks(model, bias + 64, "lstsq_mlp", [2, 1, 0]) == [0, 0, 1]
    assert budget_ranks(model, bias, "lstsq_mlp", [2, 1, 0]) == [0, 0, 0]
    with pytest.raises(ValueError, match="below the rank-0 lstsq_mlp"):
        budget_ranks(model, bias - 1, "lstsq_mlp", [2, 1, 0])
    with pytest.raises(ValueError, match="below the rank-1 lstsq_mlp"):
        budget_ranks(model, bias + 64, "lstsq_mlp")
    tp = fit_thought_patch(model, P, ids, mask, "lstsq_mlp", [0, 0, 1])
    assert patch_numel(tp, [0, 0, 1]) == bias + 64 == tp.numel() - 32 * 32 + 64
