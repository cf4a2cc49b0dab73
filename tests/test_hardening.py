"""Bad input gets a clear error (what was wrong, what to do) or a correct result.

One parametrised table of cases (issue 16, section 1): each raises the named
exception with a message that contains the given words. Below it, the cases
whose right answer is a correct result rather than an error.
"""
import math

import pytest
import torch

from icl_book import blocks, bridges, core, deep, dynamics
from icl_book import trajectories
from icl_book import patch, thought
from icl_book.experiments import convergence, equivalence, thought_experiment
from icl_book.experiments import bridges as xbridges
from icl_book.experiments import trajectories as xtrajectories
from icl_book.__main__ import main as cli_main

f64 = torch.float64


def g(seed=0):
    return torch.Generator().manual_seed(seed)


def rand(*shape, seed=0, dtype=f64):
    return torch.randn(*shape, generator=g(seed), dtype=dtype)


def block(kind='softmax'):
    return blocks.make_block(kind, d=8, d_hidden=16)


def nan_at(t, idx=0):
    t = t.clone(); t.view(-1)[idx] = float('nan'); return t


def block_with(fn):
    "A float64 block whose parameters were changed by fn(block)."
    b = block()
    with torch.no_grad(): fn(b)
    return b


def stack(depth=2, dtype='float64', **kw):
    return blocks.PreLNStack(blocks.StackConfig(depth=depth, d_model=8, heads=2,
                                                d_mlp=16, dtype=dtype, **kw))


def lm(**kw):
    return deep.TinyLM(deep.LMConfig(depth=2, d_model=8, heads=2, d_mlp=16,
                                     vocab=11, n_pos=16, dtype='float64', **kw))


def tokens(B, T, seed=0):
    return torch.randint(0, 11, (B, T), generator=g(seed))


def shared_mlp_stack():
    s = stack()
    s.blocks[1].mlp = s.blocks[0].mlp                 # one MLP, two blocks
    return s


def inplace_shared():
    s = shared_mlp_stack()
    with patch_of(s, C[:1], X[:1, None]).inplace(s): pass


def patch_of(model, C, x):
    with torch.no_grad(): return deep.context_patches(model, C, x)


def reenter_patched_weights():
    lin = torch.nn.Linear(3, 2).double()
    cm = patch.patched_weights(lin.weight, torch.zeros(2, 3, dtype=f64))
    with cm:
        with cm: pass


def states_of_other_context():
    s = stack(d_in=3)
    C1, C2, X = rand(5, 3, seed=1), rand(5, 3, seed=2), rand(4, 3, seed=3)
    st = thought.with_context_states(s, C1, X)
    thought.fit_stack_thought_patch(s, C2, X, 'bias', states=st)


C, X = rand(2, 6, 8, seed=1), rand(2, 8, seed=2)
BAD = {
    # --- non-finite input where it enters ---------------------------------
    'nan in C': (lambda: patch.chunk_patch(block(), nan_at(C), X),
                 ValueError, 'not finite'),
    'inf in x': (lambda: patch.chunk_patch(block(), C, X.clone().fill_(math.inf)),
                 ValueError, 'not finite'),
    'nan in layer weights': (
        lambda: patch.chunk_patch(block_with(
            lambda b: b.layer.q.weight.fill_(math.nan)), C, X),
        ValueError, 'not finite'),
    'nan in MLP weight W': (
        lambda: patch.chunk_patch(block_with(
            lambda b: b.mlp.W.fill_(math.nan)), C, X),
        ValueError, 'W'),
    'nan in token_patch W': (
        lambda: patch.token_patch(nan_at(rand(4, 3)), rand(3), rand(3, seed=1)),
        ValueError, 'not finite'),
    'rel_err complex': (lambda: core.rel_err(torch.ones(2, dtype=torch.cfloat),
                                             torch.ones(2, dtype=torch.cfloat)),
                        TypeError, 'complex'),
    'nan in stack_trajectory context': (
        lambda: trajectories.stack_trajectory(stack(), nan_at(C), X),
        ValueError, 'not finite'),
    # --- silent wrong results -----------------------------------------------
    'min_norm negative': (lambda: patch.token_patch(rand(4, 3), rand(3), rand(3, seed=1),
                                                    min_norm=-1),
                          ValueError, 'min_norm'),
    'rank-1 batch 3 on query batch 1': (
        lambda: block()(C[:1], X[:1], dW=blocks.RankOne(rand(3, 16), rand(3, 8))),
        ValueError, 'batch'),
    'dense patch batch 3 on query batch 1': (
        lambda: block()(C[:1], X[:1], dW=rand(3, 16, 8)), ValueError, 'batch'),
    'inplace with a shared MLP': (inplace_shared, ValueError, 'share'),
    'apply to another query': (
        lambda: (lambda s: patch_of(s, C, X[:, None]).apply(s, X[:, None] + 1))(
            stack()), ValueError, 'another query'),
    'apply to another model of the same shape': (
        lambda: patch_of(stack(), C, X[:, None]).apply(stack(), X[:, None]),
        ValueError, 'another PreLNStack'),
    'inplace into another model of the same shape': (
        lambda: patch_of(lm(), tokens(1, 6), tokens(1, 1)).inplace(lm()),
        ValueError, 'another TinyLM'),
    'fit_linear_patch integers': (
        lambda: thought.fit_linear_patch(torch.ones(4, 2, dtype=torch.long),
                                         torch.ones(4, 3, dtype=torch.long)),
        TypeError, 'floating'),
    'fit_linear_patch lam nan': (
        lambda: thought.fit_linear_patch(rand(4, 2), rand(4, 3), lam=math.nan),
        ValueError, 'lam'),
    'gd_linear_attention n=0': (
        lambda: dynamics.gd_linear_attention(rand(3), 0.1, 0), ValueError, 'n'),
    'rome_edit k=0': (lambda: bridges.rome_edit(rand(4, 3), torch.zeros(3, dtype=f64),
                                                rand(4)), ValueError, 'zero'),
    'rome_edit covariance shape': (
        lambda: bridges.rome_edit(rand(4, 3), rand(3), rand(4), cov=torch.eye(4, dtype=f64)),
        ValueError, 'cov'),
    'memit covariance shape': (
        lambda: bridges.memit_edit(rand(3, 2), rand(4, 2), torch.eye(3, 4, dtype=f64)),
        ValueError, 'C0'),
    'thought K=0 block data': (
        lambda: thought.block_thought_data(block(), C[0], X[:0]), ValueError, 'K'),
    'thought K=0 bias': (
        lambda: thought.fit_stack_thought_patch(stack(d_in=3), rand(5, 3), rand(0, 3),
                                                'bias'), ValueError, 'K'),
    'thought states of another context': (states_of_other_context, ValueError,
                                          'context'),
    'thought Ks empty': (lambda: thought_experiment.ThoughtConfig(Ks=()), ValueError, 'Ks'),
    'monitor j=-1': (lambda: xbridges.monitor_increments(j=-1), ValueError, 'j'),
    'monitor j=n': (lambda: xbridges.monitor_increments(n=10, j=10), ValueError, 'j'),
    'reproduce_equivalence ns=()': (
        lambda: equivalence.reproduce_equivalence(ns=()), ValueError, 'ns'),
    'reproduce_equivalence unknown name': (
        lambda: equivalence.reproduce_equivalence('foo'), ValueError, 'attn10'),
    'ConvergenceConfig n_ctx=1': (lambda: convergence.ConvergenceConfig(n_ctx=1),
                                  ValueError, 'n_ctx'),
    'ConvergenceConfig names=()': (lambda: convergence.ConvergenceConfig(names=()),
                                   ValueError, 'names'),
    'late_over_early empty': (lambda: trajectories.late_over_early(torch.zeros(3, 0)),
                              ValueError, 'empty'),
    'tail_slope too short': (lambda: trajectories.tail_slope(torch.ones(3, 2)),
                             ValueError, 'positions'),
    'bench_trajectory repeats=0': (
        lambda: xtrajectories.bench_trajectory(n=4, layers=1, d_model=8, repeats=0),
        ValueError, 'repeats'),
    'verify layers=True': (lambda: deep.verify(layers=True), ValueError, 'layers'),
    'greedy k=-1': (lambda: deep.greedy(lm(), tokens(1, 3), -1), ValueError, 'k'),
    # --- unclear errors made clear -------------------------------------------
    'meta device': (lambda: patch.token_patch(rand(4, 3).to('meta'), rand(3).to('meta'),
                                              rand(3).to('meta')),
                    ValueError, 'meta'),
    'rel_err batch 0': (lambda: core.rel_err(torch.ones(0, 3), torch.ones(0, 3)),
                        ValueError, 'empty'),
    'rel_err query length 0': (lambda: core.rel_err(torch.ones(2, 0, 3), torch.ones(2, 0, 3)),
                               ValueError, 'empty'),
    'patch of the wrong hidden width': (
        lambda: block()(C, X, dW=blocks.RankOne(rand(2, 15), rand(2, 8))),
        ValueError, 'hidden width'),
    'dense patch of the wrong hidden width': (
        lambda: block()(C, X, dW=rand(15, 8)), ValueError, 'hidden width'),
    'remove_chunk None': (lambda: patch.remove_chunk(C, None), ValueError, 'None'),
    'chunk of floats in a set': (lambda: patch.chunk_mask({0.5}, 4), ValueError, 'integer'),
    'token ids >= vocab': (lambda: lm()(torch.full((1, 3), 11)), ValueError, 'vocab'),
    'token ids negative': (lambda: lm()(torch.full((1, 3), -1)), ValueError, 'vocab'),
    'block_trajectory dtype mismatch': (
        lambda: trajectories.block_trajectory(block(), C.float(), X.float()),
        ValueError, 'float64'),
    'stack_trajectory dtype mismatch': (
        lambda: trajectories.stack_trajectory(stack(), C.float(), X.float()),
        ValueError, 'float64'),
    'verify float16': (lambda: deep.verify(dtype=torch.float16), ValueError, 'float16'),
    'resolve_dtype float16': (lambda: core.resolve_dtype(torch.float16), ValueError,
                              'float16'),
    'verify seed 1.5': (lambda: deep.verify(seed=1.5), ValueError, 'seed'),
    'verify d_model 8.0': (lambda: deep.verify(d_model=8.0), ValueError, 'd_model'),
    'verify d_model 0': (lambda: deep.verify(d_model=0), ValueError, 'd_model'),
    'seed_everything 1.5': (lambda: core.seed_everything(1.5), ValueError, 'seed'),
    'seed_everything 2**70': (lambda: core.seed_everything(2**70), ValueError, 'seed'),
    'make_block d_hidden=-1': (lambda: blocks.make_block(d_hidden=-1), ValueError,
                               'd_hidden'),
    'patched_weights entered twice': (reenter_patched_weights, RuntimeError, 'once'),
    'patched_weights dW requires grad': (
        lambda: patch.patched_weights(torch.nn.Parameter(torch.zeros(2, 3)),
                                      torch.zeros(2, 3, requires_grad=True)).__enter__(),
        ValueError, 'grad'),
}


@pytest.mark.parametrize('case', list(BAD))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD[case]
    with pytest.raises(exc, match=words):
        fn()


@pytest.mark.parametrize('args,words', [
    (['verify', '--d-model', '0'], 'd_model'),
    (['verify', '--d-mlp', '-1'], 'd_mlp'),
    (['verify', '--seed', str(2**70)], 'seed'),
])
def test_cli_bad_numbers_are_a_message(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and 'Traceback' not in err


# --- correct results instead of silent wrong ones ------------------------------

@pytest.mark.parametrize('Y', [
    torch.tensor([3, 0], dtype=torch.uint8), torch.tensor([0, 3], dtype=torch.int8),
    torch.tensor([0, 3], dtype=torch.int16), {3, 0}, (i for i in (0, 3)), range(0, 4, 3)])
def test_chunk_of_any_integer_kind_means_its_positions(Y):
    want = torch.tensor([True, False, False, True, False])
    assert torch.equal(patch.chunk_mask(Y, 5), want)


def test_tinylm_under_inplace_uses_the_query_positions():
    model, Ct, xt = lm(), tokens(1, 6), tokens(1, 1, seed=1)
    p = patch_of(model, Ct, xt)
    with torch.no_grad():
        ref = model(torch.cat([Ct, xt], 1))[:, -1:]
        with p.inplace(model):
            out = model(xt)                                  # no start=n
            out_n = model(xt, start=6)
        with pytest.raises(ValueError, match='start'):
            with p.inplace(model): model(xt, start=2)
        after = model(xt)
    assert core.rel_err(out, ref) < 1e-12 and core.rel_err(out_n, ref) < 1e-12
    assert core.rel_err(after, ref) > 1e-3                   # restored


def test_trajectories_keep_no_autograd_graph_unless_asked():
    blk = block(); Cg, xg = C.clone().requires_grad_(), X.clone().requires_grad_()
    r = trajectories.block_trajectory(blk, Cg, xg)
    assert not r.u.requires_grad and not r.v.requires_grad
    s = trajectories.stack_trajectory(stack(), Cg, xg)
    assert not s[0].dW.u.requires_grad
    r = trajectories.block_trajectory(blk, Cg, xg, grad=True)
    r.u.sum().backward()
    assert Cg.grad is not None and Cg.grad.abs().sum() > 0


def test_functional_patch_is_differentiable_in_dW():
    "What is differentiable: block(C, x, dW=...) in dW; patched_weights refuses."
    blk = block(); dW = torch.zeros(16, 8, dtype=f64, requires_grad=True)
    blk(C, X, dW=dW).sum().backward()
    assert dW.grad is not None and dW.grad.abs().sum() > 0


def test_verify_reports_what_it_ran():
    r = deep.verify(layers=1, context=2, dtype='float64', d_model=8, heads=2, d_mlp=8)
    assert type(r['layers']) is int and r['ok']


def test_attention_at_n_20000_stays_within_2_gb():
    "The trajectory of a block at n = 20,000 without a (n, n) score matrix."
    import json, subprocess, sys
    from conftest import ROOT
    r = subprocess.run([sys.executable, str(ROOT / 'bench' / 'memory.py'), '--one',
                        'block_trajectory', 'softmax', '20000'], capture_output=True,
                       text=True, timeout=600, env={'OMP_NUM_THREADS': '1', 'PATH': ''})
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row['peak_growth_mb'] < 2048 and row['max_rel_diff'] < 1e-12, row


# --- issue 27: invalid and non-finite values where no right answer exists ----

from icl_book import regression as tasks  # noqa: E402

eye = torch.eye(8, dtype=f64)
BAD27 = {
    'block(NaN C)': (lambda: block()(nan_at(C), X), ValueError, 'C is not finite'),
    'block(dW=NaN)': (lambda: block()(C, X, dW=nan_at(rand(2, 16, 8))),
                      ValueError, r'dW\[0\] is not finite'),
    'patched_weights(dW=NaN)': (
        lambda: patch.patched_weights(block().mlp.W, nan_at(rand(16, 8))),
        ValueError, 'dW is not finite'),
    'gd_linear_attention(eta=nan)': (
        lambda: dynamics.gd_linear_attention(rand(3), math.nan, 4),
        ValueError, 'eta'),
    'TaskConfig(noise=nan)': (lambda: tasks.TaskConfig(noise=math.nan),
                              ValueError, 'noise'),
    'TaskConfig(noise=-1)': (lambda: tasks.TaskConfig(noise=-1), ValueError,
                             'noise .*>= 0'),
    'TaskConfig(d=0)': (lambda: tasks.TaskConfig(d=0), ValueError, 'd must'),
    'ridge(lam=nan)': (lambda: tasks.ridge(rand(2, 6, 3), rand(2, 6), math.nan),
                       ValueError, 'lam'),
    'ridge(lam=-1)': (lambda: tasks.ridge(rand(2, 6, 3), rand(2, 6), -1),
                      ValueError, 'lam'),
    'ridge(y of the wrong shape)': (
        lambda: tasks.ridge(rand(2, 6, 3), rand(2, 5)), ValueError, 'y must be'),
    'query_mask(-1, 2)': (lambda: tasks.query_mask(-1, 2), ValueError,
                          'n \\(context length\\)'),
    'regression_tokens(shapes disagree)': (
        lambda: dynamics.regression_tokens(rand(2, 6, 3), rand(2, 5), rand(2, 3)),
        ValueError, 'must agree'),
    'rome_edit(NaN key)': (
        lambda: bridges.rome_edit(rand(4, 8), nan_at(rand(8)), rand(4)),
        ValueError, 'k is not finite'),
    'rome_edit(indefinite cov)': (
        lambda: bridges.rome_edit(rand(4, 8), torch.ones(8, dtype=f64), rand(4),
                                  torch.diag(torch.tensor([-1.] + [1.] * 7,
                                                          dtype=f64))),
        ValueError, 'not positive definite'),
    'memit_edit(singular system)': (
        lambda: bridges.memit_edit(rand(8, 2), rand(4, 2), 0 * eye),
        ValueError, 'not positive definite'),
    'memit_edit(NaN residuals)': (
        lambda: bridges.memit_edit(rand(8, 2), nan_at(rand(4, 2)), eye),
        ValueError, 'R is not finite'),
    'memit_edit(indefinite Lambda0)': (
        lambda: bridges.memit_edit(rand(8, 20), rand(4, 20), -eye),
        ValueError, 'negative eigenvalue'),
    'make_block(heads=2.0)': (lambda: blocks.make_block(heads=2.0), ValueError,
                              'heads must be an integer'),
    'make_block(causal="no")': (lambda: blocks.make_block(causal='no'),
                                TypeError, 'causal must be True or False'),
    'make_block(d=8.0)': (lambda: blocks.make_block(d=8.0), ValueError, 'd '),
    'StackConfig(depth=2.5)': (lambda: blocks.StackConfig(depth=2.5),
                               ValueError, 'depth must be an integer'),
    'block on a batch of 0': (lambda: block()(C[:0], X[:0]), ValueError,
                              'batch size 0'),
    'chunk Y="01"': (lambda: patch.chunk_mask('01', 6), TypeError,
                     'collection of positions'),
    'chunk Y=3': (lambda: patch.chunk_mask(3, 6), TypeError, r'write \[i\]'),
    'chunk Y=[10**20]': (lambda: patch.chunk_mask([10**20], 6), ValueError,
                         'integer positions'),
    'min_norm=True': (lambda: patch.chunk_patch(block(), C, X, min_norm=True),
                      ValueError, 'min_norm'),
    'a PreLNStack where a block is expected': (
        lambda: patch.chunk_patch(stack(), C, X), TypeError, 'ContextualBlock'),
    'overflow is not called a zero norm': (
        lambda: patch.token_patch(rand(4, 8), 1e200 * rand(8), 1e200 * rand(8)),
        ValueError, 'too large'),
    'fit_linear_patch(NaN)': (
        lambda: thought.fit_linear_patch(nan_at(rand(6, 3)), rand(6, 2)),
        ValueError, 'A is not finite'),
    'rel_err(lists)': (lambda: core.rel_err([1.], [1.]), TypeError, 'list'),
    'rel_err(numpy)': (lambda: core.rel_err(C.numpy(), C.numpy()), TypeError,
                       'ndarray'),
    'rel_err(bool)': (lambda: core.rel_err(C > 0, C > 0), TypeError, 'bool'),
    'token_patch(complex)': (
        lambda: patch.token_patch(rand(4, 8).cdouble(), rand(8).cdouble(),
                                  rand(8, seed=1).cdouble()),
        TypeError, 'complex'),
    'remove_chunk(2-D context)': (lambda: patch.remove_chunk(C[0], [0]),
                                  ValueError, r'\(B, n, d\)'),
    'trajectory_stats(chunk=-1)': (
        lambda: trajectories.trajectory_stats(block(), C, X, chunk=-1),
        ValueError, 'chunk'),
    'additive_gd at 1e160': (lambda: dynamics.additive_gd(1e160 * rand(2, 4, 8)),
                             ValueError, 'too large'),
    'block_trajectory(a stack)': (
        lambda: trajectories.block_trajectory(stack(), C, X), TypeError,
        'block_trajectory takes a ContextualBlock'),
    'block_thought_data(a stack)': (
        lambda: thought.block_thought_data(stack(), C[0], rand(4, 8)),
        TypeError, 'block_thought_data takes a ContextualBlock'),
    'make_block(d=10**7)': (lambda: blocks.make_block(d=10**7, heads=1),
                            MemoryError, 'a block of these sizes needs about'),
    'make_layer(gru, 10**6)': (lambda: blocks.make_layer('gru', 10**6),
                               MemoryError, 'gru layer of width'),
    'PreLNStack(d_model=10**6)': (
        lambda: blocks.PreLNStack(blocks.StackConfig(d_model=10**6, heads=1)),
        MemoryError, 'Pre-LN stack of these sizes'),
    'query_mask(10**7, 1)': (lambda: tasks.query_mask(10**7, 1), MemoryError,
                             'query mask of this size'),
    'sample_prompts(batch=10**10)': (
        lambda: tasks.sample_prompts(tasks.TaskConfig(), 10**10, g()),
        MemoryError, 'a batch of these prompts needs'),
    'sample_prompts(batch=2.0)': (
        lambda: tasks.sample_prompts(tasks.TaskConfig(), 2.0, g()),
        ValueError, 'batch must be an integer'),
    'gd_linear_attention(d=10**7)': (
        lambda: dynamics.gd_linear_attention(torch.zeros(10**7, dtype=f64),
                                             0.1, 3),
        MemoryError, 'linear attention of this width'),
    'token_patch(a_full overflows)': (
        lambda: patch.token_patch(rand(3, 4), torch.full((4,), 1e308,
                                                         dtype=f64),
                                  rand(4)),
        ValueError, 'a_full is too large'),
    'ridge(NaN X)': (lambda: tasks.ridge(nan_at(rand(2, 5, 3)), rand(2, 5), .1),
                     ValueError, 'X is not finite'),
    'late_over_early(NaN)': (
        lambda: trajectories.late_over_early(nan_at(torch.ones(2, 20))),
        ValueError, 'NaN or inf'),
    'trajectory_stats(batch 0)': (
        lambda: trajectories.trajectory_stats(block(), C[:0], X[:0]),
        ValueError, 'batch 0'),
    'block_patch_error(a stack)': (
        lambda: thought.block_patch_error(stack(), C[0], rand(4, 8)),
        TypeError, 'block_patch_error takes a ContextualBlock'),
    'with_context_states(a block)': (
        lambda: thought.with_context_states(block(), C[0], rand(4, 8)),
        TypeError, 'with_context_states takes a PreLNStack'),
    'fit_linear_patch(A at 1e200)': (
        lambda: thought.fit_linear_patch(1e200 * rand(6, 3), rand(6, 2), .1),
        ValueError, 'overflows float64'),
    'tail_slope(1-D)': (lambda: trajectories.tail_slope(torch.ones(10)),
                        ValueError, 'inc must have 2'),
    'tail_slope(zeros)': (lambda: trajectories.tail_slope(torch.zeros(2, 10)),
                          ValueError, 'positive, finite'),
    'tail_slope(start=nan)': (
        lambda: trajectories.tail_slope(torch.ones(2, 10), math.nan),
        ValueError, 'start'),
}


@pytest.mark.parametrize('case', list(BAD27))
def test_issue27_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD27[case]
    with pytest.raises(exc, match=words):
        fn()


# --- issue 27: numbers that were silently wrong -------------------------------

@pytest.mark.parametrize('scale', [1e200, 1e-170, 1.0])
def test_rel_err_is_exact_at_any_magnitude(scale):
    y = rand(3, 64); yh = y + 1e-3 * rand(3, 64, seed=5)
    want = ((yh - y).norm(dim=-1) / y.norm(dim=-1)).max().item()
    assert core.rel_err(scale * yh, scale * y) == pytest.approx(want, rel=1e-12)


def test_rel_err_of_a_zero_reference_is_zero_or_inf():
    z = torch.zeros(2, 3, dtype=f64)
    assert core.rel_err(z, z) == 0.0 and core.rel_err(z + 1e-300, z) == math.inf


def test_patch_rel_diff_of_a_zero_true_patch_is_zero_or_inf():
    zero = blocks.RankOne(torch.zeros(2, 4, dtype=f64), rand(2, 3))
    some = blocks.RankOne(rand(2, 4), rand(2, 3))
    assert trajectories.patch_rel_diff(zero, zero).tolist() == [0.0, 0.0]
    assert trajectories.patch_rel_diff(some, zero).tolist() == [math.inf] * 2


def test_trajectory_std_does_not_cancel():
    "Norms 1e8 ± 1 over tasks: the population std is exactly 1."
    B, n = 8, 5
    sign = torch.tensor([1., -1.] * (B // 2), dtype=f64)[:, None, None]
    u = torch.zeros(B, n, 4, dtype=f64); u[..., 0] = 1e8
    u = u + sign * torch.nn.functional.one_hot(torch.zeros(B, n, dtype=torch.long),
                                               4).double()
    v = torch.zeros(B, n, 3, dtype=f64); v[..., 0] = 1.
    stats = trajectories.TrajectoryStats()
    for s in (slice(0, 3), slice(3, 8)):              # two unequal chunks
        stats.update(0, blocks.RankOne(u[s], v[s]))
    assert torch.allclose(stats.std('norm')[0], torch.ones(n, dtype=f64),
                          rtol=1e-9, atol=0)
    assert torch.allclose(stats.mean('norm')[0],
                          torch.full((n,), 1e8, dtype=f64), rtol=1e-15, atol=0)
