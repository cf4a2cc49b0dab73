"""Inputs shared by the tests of bad input (tests/test_<module>.py): small
float64 blocks, stacks and TinyLMs, seeded tensors, and `BAD`, for each
module the calls that must raise a clear error: (call, exception, words
its message contains)."""
import math

import torch

from icl_book import blocks, bridges, core, deep, dynamics
from icl_book import trajectories
from icl_book import patch, thought
from icl_book import regression as tasks
from icl_book.experiments import convergence, equivalence, thought_experiment
from icl_book.experiments import bridges as xbridges
from icl_book.experiments import trajectories as xtrajectories


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

eye = torch.eye(8, dtype=f64)
# module -> {case: (a call, the exception it raises, words its message contains)}
BAD = {
    'blocks': {
        'rank-1 batch 3 on query batch 1': (
            lambda: block()(C[:1], X[:1], dW=blocks.RankOne(rand(3, 16), rand(3, 8))),
            ValueError, 'batch'),
        'dense patch batch 3 on query batch 1': (
            lambda: block()(C[:1], X[:1], dW=rand(3, 16, 8)), ValueError, 'batch'),
        'patch of the wrong hidden width': (
            lambda: block()(C, X, dW=blocks.RankOne(rand(2, 15), rand(2, 8))),
            ValueError, 'hidden width'),
        'dense patch of the wrong hidden width': (
            lambda: block()(C, X, dW=rand(15, 8)), ValueError, 'hidden width'),
        'make_block d_hidden=-1': (lambda: blocks.make_block(d_hidden=-1), ValueError,
                                   'd_hidden'),
        'block(NaN C)': (lambda: block()(nan_at(C), X), ValueError, 'C is not finite'),
        'block(dW=NaN)': (lambda: block()(C, X, dW=nan_at(rand(2, 16, 8))),
                          ValueError, r'dW\[0\] is not finite'),
        'make_block(heads=2.0)': (lambda: blocks.make_block(heads=2.0), ValueError,
                                  'heads must be an integer'),
        'make_block(causal="no")': (lambda: blocks.make_block(causal='no'),
                                    TypeError, 'causal must be True or False'),
        'make_block(d=8.0)': (lambda: blocks.make_block(d=8.0), ValueError, 'd '),
        'StackConfig(depth=2.5)': (lambda: blocks.StackConfig(depth=2.5),
                                   ValueError, 'depth must be an integer'),
        'block on a batch of 0': (lambda: block()(C[:0], X[:0]), ValueError,
                                  'batch size 0'),
        'make_block(d=10**7)': (lambda: blocks.make_block(d=10**7, heads=1),
                                MemoryError, 'a block of these sizes needs about'),
        'make_layer(gru, 10**6)': (lambda: blocks.make_layer('gru', 10**6),
                                   MemoryError, 'gru layer of width'),
        'PreLNStack(d_model=10**6)': (
            lambda: blocks.PreLNStack(blocks.StackConfig(d_model=10**6, heads=1)),
            MemoryError, 'Pre-LN stack of these sizes'),
    },
    'bridges': {
        'rome_edit k=0': (lambda: bridges.rome_edit(rand(4, 3), torch.zeros(3, dtype=f64),
                                                    rand(4)), ValueError, 'zero'),
        'rome_edit covariance shape': (
            lambda: bridges.rome_edit(rand(4, 3), rand(3), rand(4), cov=torch.eye(4, dtype=f64)),
            ValueError, 'cov'),
        'memit covariance shape': (
            lambda: bridges.memit_edit(rand(3, 2), rand(4, 2), torch.eye(3, 4, dtype=f64)),
            ValueError, 'C0'),
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
    },
    'core': {
        'rel_err complex': (lambda: core.rel_err(torch.ones(2, dtype=torch.cfloat),
                                                 torch.ones(2, dtype=torch.cfloat)),
                            TypeError, 'complex'),
        'rel_err batch 0': (lambda: core.rel_err(torch.ones(0, 3), torch.ones(0, 3)),
                            ValueError, 'empty'),
        'rel_err query length 0': (lambda: core.rel_err(torch.ones(2, 0, 3), torch.ones(2, 0, 3)),
                                   ValueError, 'empty'),
        'resolve_dtype float16': (lambda: core.resolve_dtype(torch.float16), ValueError,
                                  'float16'),
        'seed_everything 1.5': (lambda: core.seed_everything(1.5), ValueError, 'seed'),
        'seed_everything 2**70': (lambda: core.seed_everything(2**70), ValueError, 'seed'),
        'rel_err(lists)': (lambda: core.rel_err([1.], [1.]), TypeError, 'list'),
        'rel_err(numpy)': (lambda: core.rel_err(C.numpy(), C.numpy()), TypeError,
                           'ndarray'),
        'rel_err(bool)': (lambda: core.rel_err(C > 0, C > 0), TypeError, 'bool'),
    },
    'deep': {
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
        'verify layers=True': (lambda: deep.verify(layers=True), ValueError, 'layers'),
        'greedy k=-1': (lambda: deep.greedy(lm(), tokens(1, 3), -1), ValueError, 'k'),
        'token ids >= vocab': (lambda: lm()(torch.full((1, 3), 11)), ValueError, 'vocab'),
        'token ids negative': (lambda: lm()(torch.full((1, 3), -1)), ValueError, 'vocab'),
        'verify float16': (lambda: deep.verify(dtype=torch.float16), ValueError, 'float16'),
        'verify seed 1.5': (lambda: deep.verify(seed=1.5), ValueError, 'seed'),
        'verify d_model 8.0': (lambda: deep.verify(d_model=8.0), ValueError, 'd_model'),
        'verify d_model 0': (lambda: deep.verify(d_model=0), ValueError, 'd_model'),
    },
    'dynamics': {
        'gd_linear_attention n=0': (
            lambda: dynamics.gd_linear_attention(rand(3), 0.1, 0), ValueError, 'n'),
        'gd_linear_attention(eta=nan)': (
            lambda: dynamics.gd_linear_attention(rand(3), math.nan, 4),
            ValueError, 'eta'),
        'regression_tokens(shapes disagree)': (
            lambda: dynamics.regression_tokens(rand(2, 6, 3), rand(2, 5), rand(2, 3)),
            ValueError, 'must agree'),
        'additive_gd at 1e160': (lambda: dynamics.additive_gd(1e160 * rand(2, 4, 8)),
                                 ValueError, 'too large'),
        'gd_linear_attention(d=10**7)': (
            lambda: dynamics.gd_linear_attention(torch.zeros(10**7, dtype=f64),
                                                 0.1, 3),
            MemoryError, 'linear attention of this width'),
    },
    'experiments': {
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
        'bench_trajectory repeats=0': (
            lambda: xtrajectories.bench_trajectory(n=4, layers=1, d_model=8, repeats=0),
            ValueError, 'repeats'),
    },
    'patch': {
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
        'min_norm negative': (lambda: patch.token_patch(rand(4, 3), rand(3), rand(3, seed=1),
                                                        min_norm=-1),
                              ValueError, 'min_norm'),
        'meta device': (lambda: patch.token_patch(rand(4, 3).to('meta'), rand(3).to('meta'),
                                                  rand(3).to('meta')),
                        ValueError, 'meta'),
        'remove_chunk None': (lambda: patch.remove_chunk(C, None), ValueError, 'None'),
        'chunk of floats in a set': (lambda: patch.chunk_mask({0.5}, 4), ValueError, 'integer'),
        'patched_weights entered twice': (reenter_patched_weights, RuntimeError, 'once'),
        'patched_weights dW requires grad': (
            lambda: patch.patched_weights(torch.nn.Parameter(torch.zeros(2, 3)),
                                          torch.zeros(2, 3, requires_grad=True)).__enter__(),
            ValueError, 'grad'),
        'patched_weights(dW=NaN)': (
            lambda: patch.patched_weights(block().mlp.W, nan_at(rand(16, 8))),
            ValueError, 'dW is not finite'),
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
        'token_patch(complex)': (
            lambda: patch.token_patch(rand(4, 8).cdouble(), rand(8).cdouble(),
                                      rand(8, seed=1).cdouble()),
            TypeError, 'complex'),
        'remove_chunk(2-D context)': (lambda: patch.remove_chunk(C[0], [0]),
                                      ValueError, r'\(B, n, d\)'),
        'token_patch(a_full overflows)': (
            lambda: patch.token_patch(rand(3, 4), torch.full((4,), 1e308,
                                                             dtype=f64),
                                      rand(4)),
            ValueError, 'a_full is too large'),
    },
    'regression': {
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
        'query_mask(10**7, 1)': (lambda: tasks.query_mask(10**7, 1), MemoryError,
                                 'query mask of this size'),
        'sample_prompts(batch=10**10)': (
            lambda: tasks.sample_prompts(tasks.TaskConfig(), 10**10, g()),
            MemoryError, 'a batch of these prompts needs'),
        'sample_prompts(batch=2.0)': (
            lambda: tasks.sample_prompts(tasks.TaskConfig(), 2.0, g()),
            ValueError, 'batch must be an integer'),
        'ridge(NaN X)': (lambda: tasks.ridge(nan_at(rand(2, 5, 3)), rand(2, 5), .1),
                         ValueError, 'X is not finite'),
    },
    'thought': {
        'fit_linear_patch integers': (
            lambda: thought.fit_linear_patch(torch.ones(4, 2, dtype=torch.long),
                                             torch.ones(4, 3, dtype=torch.long)),
            TypeError, 'floating'),
        'fit_linear_patch lam nan': (
            lambda: thought.fit_linear_patch(rand(4, 2), rand(4, 3), lam=math.nan),
            ValueError, 'lam'),
        'thought K=0 block data': (
            lambda: thought.block_thought_data(block(), C[0], X[:0]), ValueError, 'K'),
        'thought K=0 bias': (
            lambda: thought.fit_stack_thought_patch(stack(d_in=3), rand(5, 3), rand(0, 3),
                                                    'bias'), ValueError, 'K'),
        'thought states of another context': (states_of_other_context, ValueError,
                                              'context'),
        'fit_linear_patch(NaN)': (
            lambda: thought.fit_linear_patch(nan_at(rand(6, 3)), rand(6, 2)),
            ValueError, 'A is not finite'),
        'block_thought_data(a stack)': (
            lambda: thought.block_thought_data(stack(), C[0], rand(4, 8)),
            TypeError, 'block_thought_data takes a ContextualBlock'),
        'block_patch_error(a stack)': (
            lambda: thought.block_patch_error(stack(), C[0], rand(4, 8)),
            TypeError, 'block_patch_error takes a ContextualBlock'),
        'with_context_states(a block)': (
            lambda: thought.with_context_states(block(), C[0], rand(4, 8)),
            TypeError, 'with_context_states takes a PreLNStack'),
        'fit_linear_patch(A at 1e200)': (
            lambda: thought.fit_linear_patch(1e200 * rand(6, 3), rand(6, 2), .1),
            ValueError, 'overflows float64'),
    },
    'trajectories': {
        'nan in stack_trajectory context': (
            lambda: trajectories.stack_trajectory(stack(), nan_at(C), X),
            ValueError, 'not finite'),
        'late_over_early empty': (lambda: trajectories.late_over_early(torch.zeros(3, 0)),
                                  ValueError, 'empty'),
        'tail_slope too short': (lambda: trajectories.tail_slope(torch.ones(3, 2)),
                                 ValueError, 'positions'),
        'block_trajectory dtype mismatch': (
            lambda: trajectories.block_trajectory(block(), C.float(), X.float()),
            ValueError, 'float64'),
        'stack_trajectory dtype mismatch': (
            lambda: trajectories.stack_trajectory(stack(), C.float(), X.float()),
            ValueError, 'float64'),
        'trajectory_stats(chunk=-1)': (
            lambda: trajectories.trajectory_stats(block(), C, X, chunk=-1),
            ValueError, 'chunk'),
        'block_trajectory(a stack)': (
            lambda: trajectories.block_trajectory(stack(), C, X), TypeError,
            'block_trajectory takes a ContextualBlock'),
        'late_over_early(NaN)': (
            lambda: trajectories.late_over_early(nan_at(torch.ones(2, 20))),
            ValueError, 'NaN or inf'),
        'trajectory_stats(batch 0)': (
            lambda: trajectories.trajectory_stats(block(), C[:0], X[:0]),
            ValueError, 'batch 0'),
        'tail_slope(1-D)': (lambda: trajectories.tail_slope(torch.ones(10)),
                            ValueError, 'inc must have 2'),
        'tail_slope(zeros)': (lambda: trajectories.tail_slope(torch.zeros(2, 10)),
                              ValueError, 'positive, finite'),
        'tail_slope(start=nan)': (
            lambda: trajectories.tail_slope(torch.ones(2, 10), math.nan),
            ValueError, 'start'),
    },
}
