"""End-to-end patches of Pre-LN stacks: exactness, every position, generation, safety.

Property tests draw depths, widths, heads, layer kinds, causal/bidirectional
attention, context and query lengths and both patch forms; exactness is
checked in float64 (1e-10) and float32 (1e-5, or 10x the float32 run's own
error against float64 where the model amplifies round-off).
"""
import copy
import json

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from torch import nn

from icl_book.blocks import LAYER_KINDS, PreLNBlock, PreLNStack, StackConfig
from icl_book.core import rel_err
from icl_book.deep import (MODES, DeepPatch, LMConfig, TinyLM,
                           attention_residual, block_patch_factors,
                           context_patches, greedy, greedy_patched,
                           load_patches, patch_errors, verify)

SETTINGS = settings(max_examples=25, deadline=None)
kinds = st.sampled_from([(k, True) for k in LAYER_KINDS]
                        + [("softmax", False), ("linear", False)])


@st.composite
def stacks(draw, dtype="float64"):
    "Settings of a small random PreLNStack and of a context and query for it."
    kind, causal = draw(kinds)
    heads = draw(st.sampled_from([1, 2, 4]))
    cfg = StackConfig(depth=draw(st.integers(1, 4)),
                      d_model=heads * draw(st.integers(2, 3)), heads=heads,
                      d_mlp=draw(st.integers(2, 24)), kind=kind, causal=causal,
                      seed=draw(st.integers(0, 999)), dtype=dtype)
    sizes = draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(1, 4))
    return cfg, sizes, draw(st.integers(0, 10**6))


def build(case):
    "The model, context C (B, n, d) and query x (B, q, d) of a drawn case."
    cfg, (B, n, q), seed = case
    model = PreLNStack(cfg)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(B, n + q, cfg.d_model, generator=g, dtype=model.ln_f.weight.dtype)
    return model, X[:, :n], X[:, n:]


@SETTINGS
@given(case=stacks(), mode=st.sampled_from(MODES))
def test_end_to_end_exact_at_every_layer_and_position_float64(case, mode):
    model, C, x = build(case)
    err = patch_errors(model, C, x, mode)
    assert len(err["per_layer"]) == len(model.blocks)
    assert max(err["per_layer"] + [err["output"]]) <= 1e-10, err


def own_roundoff(model, C, x) -> float:
    "The float32 with-context run's own error: against the same model in float64."
    X, q = torch.cat([C, x], 1), x.shape[1]
    with torch.no_grad():
        return rel_err(model(X)[:, -q:].double(),
                       copy.deepcopy(model).double()(X.double())[:, -q:])


@SETTINGS
@given(case=stacks("float32"), mode=st.sampled_from(MODES))
@example(case=(StackConfig(depth=2, d_model=2, heads=1, d_mlp=10, kind="softmax",
                           causal=True, seed=40, dtype="float32"), (2, 10, 3), 1127),
         mode="bias")      # a LayerNorm over d = 2 amplifies round-off: 5e-5, the run's own
def test_end_to_end_float32_is_round_off(case, mode):
    "Within 1e-5, or within 10x the error of the with-context run itself in float32."
    model, C, x = build(case)
    err = patch_errors(model, C, x, mode)
    tol = max(1e-5, 10 * own_roundoff(model, C, x))
    assert max(err["per_layer"] + [err["output"]]) <= tol, (err, tol)


@SETTINGS
@given(heads=st.sampled_from([1, 2]), lead=st.lists(st.integers(1, 3), max_size=2),
       q=st.integers(1, 4), mode=st.sampled_from(MODES), seed=st.integers(0, 10**6),
       causal=st.booleans())
def test_block_patch_is_exact_for_any_free_input_and_batched(heads, lead, q, mode, seed, causal):
    torch.manual_seed(seed)
    blk = PreLNBlock(8, heads, 16, causal=causal).double()
    g = torch.Generator().manual_seed(seed)
    h_ctx = torch.randn(*lead, q, 8, generator=g, dtype=torch.float64)
    z_free = torch.randn(*lead, q, 8, generator=g, dtype=torch.float64)
    p = block_patch_factors(blk, h_ctx, z_free, mode)
    assert p.dW.u.shape == (*lead, q, 16) and p.dW.v.shape == (*lead, q, 8)
    h_free = attention_residual(blk, z_free)
    out = h_free + blk.mlp(blk.ln2(h_free), **p.kwargs())
    assert rel_err(out, h_ctx + blk.mlp(blk.ln2(h_ctx))) <= 1e-10


def test_patch_keeps_factors_and_per_position_size():
    model = PreLNStack(StackConfig(depth=3, d_model=8, heads=2, d_mlp=16, dtype="float64"))
    C, x = torch.randn(2, 5, 8).double(), torch.randn(2, 3, 8).double()
    p = context_patches(model, C, x)
    assert p.shape == (2, 3) and len(p) == 3 and p.numel() == 3 * (16 + 2 * 8)
    assert context_patches(model, C, x, "rank1").numel() == 3 * 2 * (16 + 8)
    for lp in p.layers:                                  # never (.., H, d)
        assert lp.dW.u.shape == (2, 3, 16) and lp.db_out.shape == (2, 3, 8)
    # positions differ -> factors differ
    assert not torch.allclose(p.layers[0].dW.u[:, 0], p.layers[0].dW.u[:, 1])


def test_functional_application_does_not_mutate():
    model = PreLNStack(StackConfig(depth=2, d_model=8, heads=2, d_mlp=16, dtype="float64"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    C, x = torch.randn(1, 6, 8).double(), torch.randn(1, 2, 8).double()
    for mode in MODES: context_patches(model, C, x, mode).apply(model, x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _lm(dtype="float64", n_pos=40, depth=3):
    return TinyLM(LMConfig(depth=depth, d_model=16, heads=2, d_mlp=32, vocab=23,
                           n_pos=n_pos, dtype=dtype))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 12), q=st.integers(1, 3), k=st.integers(1, 6),
       mode=st.sampled_from(MODES), seed=st.integers(0, 10**6), use_pos=st.booleans())
def test_generation_without_context_equals_generation_with_it(n, q, k, mode, seed, use_pos):
    lm = _lm(n_pos=40 if use_pos else None)
    g = torch.Generator().manual_seed(seed)
    C, x = torch.randint(0, 23, (2, n), generator=g), torch.randint(0, 23, (2, q), generator=g)
    ref, ref_logits = greedy(lm, torch.cat([C, x], 1), k, return_logits=True)
    out, logits = greedy_patched(lm, C, x, k, mode, return_logits=True)
    assert torch.equal(out, ref)
    assert rel_err(logits, ref_logits) <= 1e-10


def test_generation_float32_same_tokens():
    lm = _lm("float32")
    g = torch.Generator().manual_seed(0)
    C, x = torch.randint(0, 23, (4, 20), generator=g), torch.randint(0, 23, (4, 2), generator=g)
    assert torch.equal(greedy_patched(lm, C, x, 8), greedy(lm, torch.cat([C, x], 1), 8))


@pytest.mark.parametrize("mode", MODES)
def test_inplace_matches_functional_and_restores_on_exception(mode):
    lm = _lm()
    C, x = torch.randint(0, 23, (1, 10)), torch.randint(0, 23, (1, 1))
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    p = context_patches(lm, C, x, mode)
    target = lm(torch.cat([C, x], 1))[:, -1:]
    with p.inplace(lm):
        assert rel_err(lm(x, start=10), target) <= 1e-10
    assert all(torch.equal(v, before[k]) for k, v in lm.state_dict().items())
    with pytest.raises(RuntimeError, match="boom"):
        with p.inplace(lm):
            assert not torch.equal(lm.blocks[0].mlp.W, before["stack.blocks.0.mlp.layers.0.weight"])
            raise RuntimeError("boom")
    assert all(torch.equal(v, before[k]) for k, v in lm.state_dict().items())
    assert rel_err(p.apply(lm, x), target) <= 1e-10


def test_inplace_refuses_a_second_patch_on_a_patched_model():
    lm = _lm()
    C, x = torch.randint(0, 23, (1, 10)), torch.randint(0, 23, (1, 1))
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    p = context_patches(lm, C, x)
    with p.inplace(lm):
        with pytest.raises(RuntimeError, match="already patched"):
            p.inplace(lm).__enter__()                    # the same patch again
        with pytest.raises(RuntimeError, match="already patched"):
            context_patches(lm, C[:, :5], x).inplace(lm).__enter__()  # another C
    assert all(torch.equal(v, before[k]) for k, v in lm.state_dict().items())


def test_bad_inputs_raise_clear_errors():
    lm = _lm(n_pos=16)
    C, x = torch.randint(0, 23, (1, 10)), torch.randint(0, 23, (1, 3))
    with pytest.raises(ValueError, match="context C is empty"):
        context_patches(lm, C[:, :0], x)
    with pytest.raises(ValueError, match="query x is empty"):
        context_patches(lm, C, x[:, :0])
    with pytest.raises(ValueError, match="exceed the model's 16 learned positions"):
        context_patches(lm, C, torch.randint(0, 23, (1, 7)))
    with pytest.raises(ValueError, match="do not exist"):
        lm(torch.randint(0, 23, (1, 17)))
    with pytest.raises(ValueError, match="integer ids"):
        context_patches(lm, C.float(), x)
    with pytest.raises(ValueError, match="agree in batch size"):
        context_patches(lm, C.expand(2, -1), x)
    with pytest.raises(TypeError, match="expected an icl_book PreLNStack or TinyLM"):
        context_patches(nn.Sequential(nn.Linear(2, 2)), C, x)
    broken = _lm(n_pos=16); del broken.blocks[0].ln2
    with pytest.raises(TypeError, match=r"block 0 .*missing or wrong \['ln2'\]"):
        context_patches(broken, C, x)
    broken = _lm(n_pos=16); broken.blocks[2].mlp = nn.Linear(16, 16)
    with pytest.raises(TypeError, match="block 2 .*icl_book MLP"):
        context_patches(broken, C, x)
    with pytest.raises(ValueError, match="mode must be one of"):
        context_patches(lm, C, x, mode="dense")
    p = context_patches(lm, C, x)
    with pytest.raises(ValueError, match=r"computed for \(B, q\)"):
        p.apply(lm, x[:, :2])
    with pytest.raises(ValueError, match="one query token"):
        p.inplace(lm).__enter__()
    with pytest.raises(ValueError, match="3 layers, the model 2"):
        p.apply(_lm(n_pos=16, depth=2), x)
    stack = PreLNStack(StackConfig(depth=1, d_model=8, heads=2, d_mlp=16))
    Cf, xf = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        context_patches(stack, Cf.double(), xf.double())
    with pytest.raises(ValueError, match=r"\(B, n, d\) features"):
        context_patches(stack, Cf[0], xf)
    with pytest.raises(TypeError, match="token model"):
        greedy(stack, xf, 2)
    with pytest.raises(ValueError, match=r"must both be \(\.\.\., q, 8\)"):
        block_patch_factors(stack.blocks[0], xf, xf[:, :1])


def test_verify_meets_the_targets_and_is_json():
    for dtype, tol in (("float32", 1e-6), ("float64", 1e-12)):
        r = verify(layers=10, context=256, dtype=dtype)
        assert r["ok"] and r["max_rel_err"] <= tol, r
        assert len(r["per_layer_rel_err"]) == 10
    r = json.loads(json.dumps(verify(layers=2, context=8, query=3, dtype="float64",
                                     layer_kind="lstm", d_model=8, heads=2,
                                     d_mlp=16, mode="rank1")))
    for key in ("max_rel_err", "layers", "context", "query", "dtype", "layer_kind",
                "seed", "mode", "d_model", "heads", "d_mlp", "causal"):
        assert key in r
    assert r["max_rel_err"] <= 1e-12 and r["layer_kind"] == "lstm"
    with pytest.raises(ValueError, match="context must be a positive integer"):
        verify(context=0)
    with pytest.raises(TypeError, match="unknown settings"):
        verify(widht=3)
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'float64'"):
        verify(dtype="float16")


# --- keeping a patch: save / load_patches, repr, copies ---------------------

def _kept(tmp_path, mode="bias", dtype="float64", seed=0):
    "A TinyLM, its patch for one context and query, and the file it is saved to."
    lm = TinyLM(LMConfig(depth=3, d_model=8, heads=2, d_mlp=12, vocab=17,
                         n_pos=32, seed=seed, dtype=dtype))
    g = torch.Generator().manual_seed(seed)
    C, x = torch.randint(0, 17, (2, 5), generator=g), torch.randint(0, 17, (2, 3), generator=g)
    P = context_patches(lm, C, x, mode)
    f = tmp_path / "p.safetensors"
    P.save(f)
    return lm, C, x, P, f


def _tensors(P):
    return [t for p in P.layers for t in (*p.dW, p.db_out, *(p.dW_out or ()))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_saved_patch_loads_bit_for_bit(tmp_path, mode, dtype):
    lm, C, x, P, f = _kept(tmp_path, mode, dtype)
    P2 = load_patches(f, lm)
    for a, b in zip(_tensors(P), _tensors(P2)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert (P2.start, P2.mode, P2.shape) == (P.start, P.mode, P.shape)
    assert torch.equal(P2.query, x)
    assert torch.equal(P2.apply(lm, x), P.apply(lm, x))
    twin = TinyLM(lm.cfg)                        # a new object, same weights
    twin.load_state_dict(lm.state_dict())
    assert torch.equal(load_patches(f, twin).apply(twin, x), P.apply(lm, x))
    with pytest.raises(ValueError, match="another TinyLM"):
        P2.apply(twin, x)                        # bound to the model it loaded into


def test_saved_features_stack_patch_loads(tmp_path):
    m = PreLNStack(StackConfig(depth=2, d_model=8, heads=2, d_mlp=8, dtype="float64"))
    X = torch.randn(1, 6, 8, dtype=torch.float64)
    P = context_patches(m, X[:, :4], X[:, 4:], "rank1")
    P.save(tmp_path / "s.safetensors")
    P2 = load_patches(tmp_path / "s.safetensors", m)
    assert torch.equal(P2.apply(m, X[:, 4:]), P.apply(m, X[:, 4:]))


def test_load_patches_refuses_another_stack(tmp_path):
    from dataclasses import replace
    lm, C, x, P, f = _kept(tmp_path)
    other = TinyLM(replace(lm.cfg, seed=1))       # same config, other weights
    with pytest.raises(ValueError, match="weights differ"):
        load_patches(f, other)
    one_bit = TinyLM(lm.cfg)
    one_bit.load_state_dict(lm.state_dict())
    with torch.no_grad():
        one_bit.pos.weight.view(-1).view(torch.int64)[-1] ^= 1
    with pytest.raises(ValueError, match="weights differ"):
        load_patches(f, one_bit)
    with pytest.raises(ValueError, match="d_mlp: 12 there, 16 here"):
        load_patches(f, TinyLM(replace(lm.cfg, d_mlp=16)))
    with pytest.raises(ValueError, match="the patches are float64, the model is float32"):
        load_patches(f, TinyLM(replace(lm.cfg, dtype="float32")))
    with pytest.raises(ValueError, match="patches of a TinyLM, this is a PreLNStack"):
        load_patches(f, PreLNStack(StackConfig(depth=3, d_model=8, heads=2, d_mlp=12)))
    torch.save({"a": 1}, tmp_path / "x.pt")
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="is not a icl_book.deep_patch/1 file"):
        load_patches(tmp_path / "plain.safetensors", lm)


def test_save_refuses_written_or_gone_model(tmp_path):
    lm, C, x, P, f = _kept(tmp_path)
    with torch.no_grad():
        lm.blocks[1].mlp.W.mul_(1.0)                # written (even unchanged)
    with pytest.raises(ValueError, match="written to since context_patches"):
        P.save(tmp_path / "q.safetensors")
    P3 = context_patches(TinyLM(lm.cfg), C, x)      # its model is gone
    import gc
    gc.collect()
    with pytest.raises(ValueError, match="no longer exists"):
        P3.save(tmp_path / "r.safetensors")


def test_deep_patch_repr_summarises(tmp_path):
    import statistics
    lm, C, x, P, f = _kept(tmp_path, "rank1")
    r = repr(P)
    assert "tensor(" not in r and max(map(len, r.splitlines())) <= 78   # a page column
    assert f"(B, q) = {P.shape}" in r
    assert f"positions {P.start}..{P.start + P.shape[1] - 1}" in r
    assert f"{P.numel() * P.shape[0] * P.shape[1]:,} in all" in r
    w = [float(p.dW.norm().max()) for p in P.layers]   # ||u|| ||v|| per position
    dense = max(float(torch.linalg.matrix_norm(p.dW.dense()).max()) for p in P.layers)
    assert abs(max(w) - dense) <= 1e-12 * dense
    assert f"max {max(w):.3g}, median {statistics.median(w):.3g}" in r


def test_deep_patch_pickle_refused_deepcopy_kept(tmp_path):
    import pickle
    lm, C, x, P, f = _kept(tmp_path)
    with pytest.raises(TypeError, match=r"P.save\(path\).*load_patches\(path, model\)"):
        pickle.dumps(P)
    Q = copy.deepcopy(P)
    assert Q.layers[0].dW.u is not P.layers[0].dW.u
    assert torch.equal(Q.apply(lm, x), P.apply(lm, x))
    Q.layers[0].dW.u.zero_()                           # the copy is its own
    assert not torch.equal(Q.apply(lm, x), P.apply(lm, x))


# ----------------------------------------------------------------------------
# bad input: a clear error (what was wrong, what to do), or a correct result
from icl_book import core, deep  # noqa: E402
from icl_book.__main__ import main as cli_main  # noqa: E402
from _inputs import BAD, lm, patch_of, tokens  # noqa: E402


@pytest.mark.parametrize('case', list(BAD['deep']))
def test_bad_input_is_a_clear_error(case):
    fn, exc, words = BAD['deep'][case]
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

def test_verify_reports_what_it_ran():
    r = deep.verify(layers=1, context=2, dtype='float64', d_model=8, heads=2, d_mlp=8)
    assert type(r['layers']) is int and r['ok']
