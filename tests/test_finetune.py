"""Implicit vs explicit fine-tuning (chapter 07) and the training code it needs
(chapter 05a): the plain block of the paper's main text, the rank-1 and low-rank
cosines against dense matrices, the nulls, and bad inputs.
"""
import signal
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.func import functional_call, grad, vmap

from icl_book.blocks import RankOne
from icl_book.deep import context_patches
from icl_book.patch import chunk_patch
from icl_book.finetune import (
    as_queries, cumulative_cosine, example_grads, explicit_sgd, factor_cosines,
    implicit_steps, increment_terms, lowrank_cosine, rank1_cosine,
    right_factor_moment, stack_example_grads)
from icl_book.experiments.finetune import (
    FinetuneConfig, derangements, null_test, reproduce_finetune_alignment)
from icl_book.regression import TaskConfig, sample_prompts, with_context
from icl_book.train import (CHECKPOINTS, PlainModel, build_model, eval_losses,
                            load_model, train_cli, model_for, predict, train)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@contextmanager
def time_limit(seconds):
    "Fail (instead of hanging) when the body runs longer than `seconds`."
    def boom(*_):
        raise TimeoutError(f"took longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def dense(R):
    return R.dense().flatten(-2)


# --- the plain block ----------------------------------------------------------

def test_plain_model_is_one_contextual_block():
    m = build_model(arch='plain').double()
    assert isinstance(m, PlainModel) and len(m.blocks) == 1
    p = sample_prompts(TaskConfig(), 3, gen(1), n_ctx=5, n_query=1)
    tok = p.tokens.double()
    with torch.no_grad():
        E = m.embed(tok)
        direct = m.block.mlp(m.block.layer(E[:, :5], E[:, 5:]))   # f(W A(C,x) + b)
        assert torch.allclose(m(tok)[:, -1], direct[:, 0], atol=1e-12)
    names = {k for k, _ in m.named_modules()}
    assert not any('ln' in k for k in names)                     # no LayerNorm


def test_plain_model_refuses_what_it_is_not():
    with pytest.raises(ValueError, match="one attention block"):
        build_model(depth=2, arch='plain')
    with pytest.raises(ValueError, match="one attention block"):
        build_model(kind='gru', arch='plain')
    with pytest.raises(ValueError, match="'preln' or 'plain'"):
        build_model(arch='postln')


def test_plain_training_is_deterministic_and_learns_a_little():
    cfg = replace(CHECKPOINTS['plain1'], steps=6, eval_every=3, eval_batch=16, batch=8)
    (m1, l1), (m2, l2) = train(cfg), train(cfg)
    assert all(torch.equal(a, b) for a, b in
               zip(m1.state_dict().values(), m2.state_dict().values()))
    assert l1 == {**l2, 'seconds': l1['seconds']} and l1['step'] == [0, 3, 6]
    assert max(l1['patch_err']) < 1e-4                             # Eq. (8) exact


def test_plain_patched_trajectory_is_exact_in_float64():
    m = load_model('plain1').double()
    p = sample_prompts(CHECKPOINTS['plain1'].task, 4, gen(2), n_ctx=12, n_query=1)
    p = p._replace(X=p.X.double(), y=p.y.double())
    imp = implicit_steps(m, p)
    with torch.no_grad():
        direct = torch.stack([predict(m, with_context(p, i).tokens, i)[:, 0]
                              for i in range(p.n + 1)], 1)
    assert (imp.preds - direct).abs().max() < 1e-12
    assert (imp.db == 0).all()                                     # no steering


# --- training: the issue-16 items that live in 05a ---------------------------

@pytest.mark.parametrize("arch", ['preln', 'plain'])
def test_evaluate_with_many_queries_equals_one_query_prompts(arch):
    m = build_model(arch=arch).double()
    p = sample_prompts(TaskConfig(), 3, gen(3), n_ctx=7, n_query=16)
    p = p._replace(X=p.X.double(), y=p.y.double())
    joint = eval_losses(m, p)
    alone = [eval_losses(m, p._replace(X=p.X[:, keep], y=p.y[:, keep]))
             for keep in ([*range(7), 7 + j] for j in range(16))]
    for k in ('test_ctx', 'test_patched', 'test_free'):
        assert joint[k] == pytest.approx(sum(a[k] for a in alone) / 16, rel=1e-10)
    assert joint['patch_err'] < 1e-10


def test_evaluate_of_a_shipped_model_with_many_queries():
    m = load_model('attn1')
    p = sample_prompts(TaskConfig(), 8, gen(4), n_query=16)
    ev = eval_losses(m, p)
    assert ev['patch_err'] < 1e-4
    assert ev['test_patched'] == pytest.approx(ev['test_ctx'], rel=1e-4)


@pytest.mark.parametrize("field,value", [('eval_every', 0), ('eval_every', -5),
                                         ('batch', 0)])
def test_train_refuses_bad_settings(field, value):
    cfg = replace(CHECKPOINTS['attn1'], steps=2, **{field: value})
    with pytest.raises(ValueError, match=field):
        train(cfg)
    with pytest.raises(ValueError, match="steps"):
        train(CHECKPOINTS['attn1'], steps=-1)


@pytest.mark.parametrize("argv", [['foo'], ['attn1', 'foo'], ['--check', 'foo']])
def test_train_cli_refuses_unknown_names(argv, capsys):
    with time_limit(20), pytest.raises(SystemExit) as e:
        train_cli(argv)
    assert e.value.code == 2
    assert "unknown checkpoint(s) ['foo']" in capsys.readouterr().err


# --- explicit and implicit updates --------------------------------------------

def test_explicit_sgd_needs_context():
    m = load_model('attn1')
    p = sample_prompts(TaskConfig(), 3, gen(), n_ctx=0, n_query=2)
    with pytest.raises(ValueError, match="at least one context example"):
        explicit_sgd(m, p, 1e-3)
    with pytest.raises(ValueError, match="no implicit steps"):
        implicit_steps(m, p)


@pytest.mark.parametrize("name", ['attn1', 'plain1'])
def test_explicit_sgd_equals_dense_sgd_on_w(name):
    "Two steps of online SGD on the weight itself, with autograd."
    m = load_model(name).double()
    p = sample_prompts(CHECKPOINTS[name].task, 2, gen(5), n_ctx=2, n_query=3)
    p = p._replace(X=p.X.double(), y=p.y.double())
    ex = explicit_sgd(m, p, 0.05)
    W = m.blocks[0].mlp.W
    saved = W.detach().clone()
    try:
        for b in range(2):
            with torch.no_grad():
                W.copy_(saved)
            for k in range(2):
                with torch.enable_grad():
                    out = m(as_queries(p.X[b:b + 1, k:k + 1]))[0, 0, 0]
                    (gW,) = torch.autograd.grad(0.5 * (out - p.y[b, k]) ** 2, W)
                with torch.no_grad():
                    W.sub_(0.05 * gW)
            with torch.no_grad():
                q = m(p.tokens[b:b + 1, 2:].reshape(3, 1, -1))[:, 0, 0]
            assert torch.allclose(ex.preds[b, -1], q, atol=1e-10)
    finally:
        with torch.no_grad():
            W.copy_(saved)


def test_examples_are_fed_without_their_labels():
    "The right factor of an example's gradient is that of the query-form token."
    m = load_model('plain1')
    p = sample_prompts(CHECKPOINTS['plain1'].task, 3, gen(6), n_ctx=4, n_query=1)
    ex = explicit_sgd(m, p, 1e-3)
    _, g = example_grads(m, as_queries(p.X[:, :4]), p.y[:, :4])
    assert torch.equal(ex.grads0.v, g.v)


def test_stack_example_grads_match_autograd_in_every_block():
    m = load_model('attn10').double()
    p = sample_prompts(CHECKPOINTS['attn10'].task, 2, gen(7), n_ctx=3, n_query=1)
    X, y = p.X.double(), p.y.double()
    grads = stack_example_grads(m, as_queries(X[:, :3]), y[:, :3])
    Ws = [blk.mlp.W for blk in m.blocks]
    with torch.enable_grad():
        out = m(as_queries(X[1:2, 1:2]))[0, 0, 0]
        gWs = torch.autograd.grad(0.5 * (out - y[1, 1]) ** 2, Ws)
    for l, gW in enumerate(gWs):
        got = RankOne(grads[l].u[1, 1], grads[l].v[1, 1]).dense()
        assert torch.allclose(got, gW, atol=1e-12), l
    assert not any(blk.mlp._forward_pre_hooks for blk in m.blocks)   # hooks gone


# --- cosines of rank-1 and low-rank matrices -----------------------------------

dims = st.integers(1, 9)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), dims, dims, st.integers(0, 10_000))
def test_rank1_cosine_factorises_and_is_bounded_by_the_right_factor(B, H, D, seed):
    g = gen(seed)
    P = RankOne(torch.randn(B, H, generator=g).double(), torch.randn(B, D, generator=g).double())
    Q = RankOne(torch.randn(B, H, generator=g).double(), torch.randn(B, D, generator=g).double())
    c = rank1_cosine(P, Q)
    assert torch.allclose(c, F.cosine_similarity(dense(P), dense(Q), dim=-1), atol=1e-12)
    cu, cv = factor_cosines(P, Q)
    assert (c.abs() <= cv.abs() + 1e-12).all() and (c.abs() <= cu.abs() + 1e-12).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), dims, dims, st.integers(0, 10_000))
def test_cumulative_cosine_equals_dense_partial_sums(B, n, H, D, seed):
    g = gen(seed)
    mk = lambda: RankOne(torch.randn(B, n, H, generator=g).double(),
                         torch.randn(B, n, D, generator=g).double())
    P, Q = mk(), mk()
    want = F.cosine_similarity(P.dense().cumsum(1).flatten(2),
                               Q.dense().cumsum(1).flatten(2), dim=-1)
    assert torch.allclose(cumulative_cosine(P, Q), want, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), dims, dims, st.integers(0, 10_000))
def test_lowrank_cosine_and_increments_equal_dense(r, s, H, D, seed):
    g = gen(seed)
    P = RankOne(torch.randn(2, r, H, generator=g).double(), torch.randn(2, r, D, generator=g).double())
    Q = RankOne(torch.randn(2, s, H, generator=g).double(), torch.randn(2, s, D, generator=g).double())
    want = F.cosine_similarity(P.dense().sum(-3).flatten(1), Q.dense().sum(-3).flatten(1), dim=-1)
    assert torch.allclose(lowrank_cosine(P, Q), want, atol=1e-12)
    T = RankOne(torch.randn(2, 5, H, generator=g).double(), torch.randn(2, 5, D, generator=g).double())
    full = T.dense()
    inc = full - torch.cat([torch.zeros_like(full[:, :1]), full[:, :-1]], 1)
    assert torch.allclose(increment_terms(T).dense().sum(-3), inc, atol=1e-12)


def test_right_factor_moment_gives_the_mean_squared_cosine_exactly():
    a = torch.randn(40, 7, generator=gen(8)).double() + 0.3
    N, ah = 40, F.normalize(a, dim=-1)
    c2 = (ah @ ah.T) ** 2
    pairs = (c2.sum() - c2.diagonal().sum()) / (N * (N - 1))
    S = right_factor_moment(a)
    assert torch.allclose(pairs, (N ** 2 * S.pow(2).sum() - N) / (N * (N - 1)), atol=1e-12)
    low = torch.randn(200, 2, generator=gen(9)).double() @ torch.randn(2, 7, generator=gen(10)).double()
    assert right_factor_moment(low).norm() >= 2 ** -0.5 - 1e-12    # rank 2 bound


# --- nulls ----------------------------------------------------------------------

def test_derangements_have_no_fixed_points_and_small_batches_are_refused():
    for B in (3, 4, 10):
        for pm in derangements(B, 6, seed=1):
            assert sorted(pm.tolist()) == list(range(B))
            assert not (pm == torch.arange(B)).any()
    for B in (0, 1, 2):
        with time_limit(5), pytest.raises(ValueError, match="at least 3 tasks"):
            derangements(B, 20)
    with pytest.raises(ValueError, match="k >= 2"):
        derangements(5, 1)


def test_null_test_is_one_formula():
    x = torch.randn(25, 4, generator=gen(11)).double()
    t = null_test(lambda pm: torch.stack([(x * x[pm]).sum(1).mean(),
                                          (x * x[pm]).sum(1).median()]), 25, k=7)
    assert t['value'].shape == t['null'].shape == t['z'].shape == (2,)
    assert torch.allclose(t['z'], (t['value'] - t['null']) / t['null_sd'])
    flat = null_test(lambda pm: x[pm].mean(), 25)                # ignores pm
    assert flat['null_sd'] == 0 and flat['z'].isnan()


@pytest.mark.parametrize("tasks", [0, 1, 2])
def test_reproduce_with_too_few_tasks_is_a_clear_error(tasks):
    cfg = FinetuneConfig(tasks=tasks, lr=3e-3, plain_lr=1.0)
    with time_limit(30), pytest.raises(ValueError, match="at least 3 tasks"):
        reproduce_finetune_alignment(cfg)


def test_reproduce_with_three_tasks_gives_finite_results():
    cfg = FinetuneConfig(tasks=3, lr=3e-3, plain_lr=1.0)
    with time_limit(60):
        res = reproduce_finetune_alignment(cfg)
    for k in ('z', 'plain_z', 'untrained_z', 'function_z'):
        assert torch.isfinite(torch.tensor(res[k])), k


def as_tokens(X):
    "Tokens (x, 0) of inputs X (B, m, d), written out here."
    return torch.cat([X, X.new_zeros(*X.shape[:-1], 1)], -1)


def _direct_cosines(model, p):
    "cos(D_i, -∇_W ℓ_{i+1}(W)) (B, n), dense, without icl_book.finetune."
    B, n = p.X.shape[0], p.n
    C, x = p.tokens[:, :n], p.tokens[:, n:n + 1]
    blk, W = model.blocks[0], model.blocks[0].mlp.W
    with torch.no_grad():                          # ΔW_i for i = 0..n, dense
        if isinstance(model, PlainModel):          # Eq. (8) of the one block
            E, e = model.embed(C), model.embed(x)
            dW = [chunk_patch(blk, E[:, :i], e).dense()[:, 0] for i in range(1, n + 1)]
        else:
            dW = [context_patches(model, C[:, :i], x).layers[0].dW.dense()[:, 0]
                  for i in range(1, n + 1)]
    dW = torch.stack([torch.zeros_like(dW[0])] + dW, 1).double()  # (B, n+1, H, D)
    D = dW.diff(dim=1)                                            # (B, n, H, D)
    name = next(k for k, q in model.named_parameters() if q is W)
    params = {k: q.detach() for k, q in model.named_parameters()}

    def loss(Wv, t, y):                            # ½(f_W(t) - y)², t = (x, 0) alone
        return 0.5 * (functional_call(model, {**params, name: Wv}, (t,))[0, 0, 0] - y) ** 2
    t = as_tokens(p.X[:, :n]).reshape(B * n, 1, 1, -1)
    G = -vmap(grad(loss), in_dims=(None, 0, 0))(W.detach(), t, p.y[:, :n].reshape(-1))
    G = G.view(B, n, *W.shape).double()            # per-example gradients, autograd
    def cos(pm):
        Dp, Gp = D.flatten(2), G[pm].flatten(2)
        return F.cosine_similarity(Dp, Gp, dim=-1)                 # (B, n)
    return cos


def _direct_summary(cos, B, k, seed):
    "Median, null median, z and share of positive cosines, by hand."
    med = cos(torch.arange(B)).median().item()
    nulls = torch.tensor([cos(pm).median().item() for pm in derangements(B, k, seed)],
                         dtype=torch.float64)
    mu, sd = nulls.mean().item(), nulls.std().item()
    return dict(median=med, null_median=mu, z=(med - mu) / sd,
                positive=(cos(torch.arange(B)) > 0).double().mean().item())


def test_reproduce_agrees_with_a_direct_computation():
    "The claim's numbers, recomputed densely from the shipped models."
    cfg = FinetuneConfig(tasks=6, lr=3e-3, plain_lr=1.0, nulls=5)
    res = reproduce_finetune_alignment(cfg)
    for prefix, model in (('', load_model('attn1')), ('plain_', load_model('plain1')),
                          ('untrained_', model_for(CHECKPOINTS['attn1']).eval())):
        name = 'plain1' if prefix == 'plain_' else 'attn1'
        p = sample_prompts(CHECKPOINTS[name].task, cfg.tasks, gen(cfg.seed), n_query=1)
        want = _direct_summary(_direct_cosines(model, p), cfg.tasks, cfg.nulls, cfg.seed)
        assert res[f'{prefix}cosine_median'] == pytest.approx(want['median'], abs=1e-6)
        assert res[f'{prefix}z'] == pytest.approx(want['z'], rel=5e-3, abs=1e-2)
        if prefix != 'untrained_':
            assert res[f'{prefix}null_cosine_median'] == pytest.approx(
                want['null_median'], abs=2e-6)
            assert res[f'{prefix}positive_fraction'] == pytest.approx(want['positive'], abs=0.01)
    assert reproduce_finetune_alignment(cfg) == res                # deterministic
