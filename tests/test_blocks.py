"""Contextual layers, blocks and Pre-LN stacks against independent computations."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from icl_book.blocks import (LAYER_KINDS, MLP, PreLNStack, RankOne, StackConfig,
                             apply_update, check_weights, make_block, make_layer)
from icl_book.core import rel_err

SETTINGS = settings(max_examples=25, deadline=None)


@SETTINGS
@given(heads=st.sampled_from([1, 2, 4]), T=st.integers(1, 12),
       causal=st.booleans(), seed=st.integers(0, 10**6))
def test_softmax_attention_matches_torch_sdpa(heads, T, causal, seed):
    torch.manual_seed(seed)
    att = make_layer("softmax", 8, heads, causal).double()
    Z = torch.randn(2, T, 8, dtype=torch.float64)
    sp = lambda t: t.view(2, T, heads, 8 // heads).transpose(1, 2)
    ref = F.scaled_dot_product_attention(sp(att.q(Z)), sp(att.k(Z)), sp(att.v(Z)),
                                         is_causal=causal)
    ref = att.o(ref.transpose(1, 2).reshape(2, T, 8))
    assert rel_err(att.seq(Z), ref) < 1e-12


@SETTINGS
@given(kind=st.sampled_from(["linear", "softmax"]), T=st.integers(2, 10),
       seed=st.integers(0, 10**6))
def test_attention_query_sees_context_not_future(kind, T, seed):
    torch.manual_seed(seed)
    att = make_layer(kind, 8, 2, causal=True).double()
    Z = torch.randn(1, T, 8, dtype=torch.float64)
    Z2 = Z.clone(); Z2[:, -1] += 1.0
    assert torch.allclose(att.seq(Z)[:, :-1], att.seq(Z2)[:, :-1], atol=1e-12)


def test_linear_attention_formula():
    torch.manual_seed(0)
    att = make_layer("linear", 6, 1, causal=True).double()
    Z = torch.randn(1, 5, 6, dtype=torch.float64)
    q, k, v = att.q(Z)[0], att.k(Z)[0], att.v(Z)[0]
    scores = (q @ k.T / 6 ** 0.5).tril()
    assert rel_err(att.seq(Z)[0], att.o(scores @ v)) < 1e-12


@pytest.mark.parametrize("kind", ["elman", "gru", "lstm"])
def test_recurrent_state_after_context_then_query(kind):
    torch.manual_seed(1)
    layer = make_layer(kind, 5).double()
    C, x = torch.randn(3, 7, 5).double(), torch.randn(3, 5).double()
    # independent: feed tokens one at a time, carrying the state by hand
    state = None
    for t in torch.cat([C, x[:, None]], 1).unbind(1):
        out, state = layer.rnn(t[:, None], state)
    assert rel_err(layer(C, x), out[:, 0]) < 1e-13


@SETTINGS
@given(kind=st.sampled_from(LAYER_KINDS), n=st.integers(0, 6), q=st.integers(1, 3),
       seed=st.integers(0, 10**6))
def test_batched_call_equals_one_at_a_time(kind, n, q, seed):
    torch.manual_seed(seed)
    blk = make_block(kind, d=4, d_hidden=8, heads=2, seed=seed)
    C, x = torch.randn(3, n, 4).double(), torch.randn(3, q, 4).double()
    one = torch.cat([blk(C[i:i + 1], x[i:i + 1]) for i in range(3)])
    assert rel_err(blk(C, x), one) < 1e-12


def test_rank_one_update_equals_dense():
    torch.manual_seed(0)
    u, v, z = torch.randn(5, 7).double(), torch.randn(5, 3).double(), torch.randn(5, 3).double()
    dense = torch.einsum("bh,bd->bhd", u, v)
    assert rel_err(apply_update(RankOne(u, v), z), torch.einsum("bhd,bd->bh", dense, z)) < 1e-13


def test_mlp_rest_is_everything_after_first_layer():
    torch.manual_seed(0)
    mlp = MLP(4, 9, 2, depth=3).double()
    z = torch.randn(6, 4).double()
    assert rel_err(mlp(z), mlp.rest(z @ mlp.W.T + mlp.b)) < 1e-14


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_stack_dtype_and_hidden_states(dtype):
    net = PreLNStack(StackConfig(depth=3, d_model=8, heads=2, d_mlp=16, d_in=3,
                                 d_out=1, dtype=dtype))
    X = torch.randn(2, 5, 3, dtype=getattr(torch, dtype))
    out, hidden = net(X, return_hidden=True)
    assert out.dtype == X.dtype and out.shape == (2, 5, 1) and len(hidden) == 4
    assert torch.equal(hidden[0], net.read_in(X))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="must be one of"):
        make_layer("transformer", 4)
    with pytest.raises(ValueError, match=r"shape \(B, T, d\)"):
        make_layer("softmax", 4)(torch.randn(4, 4), torch.randn(4, 4, 4, 4))
    blk = make_block("softmax", d=4)
    with pytest.raises(ValueError, match="width 4"):
        blk(None, torch.randn(2, 5).double())
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        PreLNStack(StackConfig(depth=0))


def test_weights_and_inputs_must_share_dtype():
    "The one dtype/device check, direct and through a layer's forward."
    layer = make_layer("gru", 4).double()
    check_weights(layer, torch.randn(1, 2, 4).double())        # agree: silent
    with pytest.raises(ValueError, match="the stack's weights are torch.float64"):
        check_weights(layer, torch.randn(1, 2, 4), "the stack")
    with pytest.raises(ValueError, match="the layer's weights are torch.float64 on cpu"):
        layer(None, torch.randn(1, 4))


# ----------------------------------------------------------------------------
# bad input: a clear error (what was wrong, what to do), or a correct result
from _inputs import BAD, C, X, block, f64  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['blocks']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['blocks'][case]
    with pytest.raises(exc, match=words):
        fn()


def test_functional_patch_is_differentiable_in_dW():
    "What is differentiable: block(C, x, dW=...) in dW; patched_weights refuses."
    blk = block(); dW = torch.zeros(16, 8, dtype=f64, requires_grad=True)
    blk(C, X, dW=dW).sum().backward()
    assert dW.grad is not None and dW.grad.abs().sum() > 0
