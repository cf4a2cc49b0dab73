"""The library through the tools researchers hold their models in
(icl_book.wrappers): an nnsight LanguageModel and a TransformerLens 4
TransformerBridge booted around a tiny random transformers model (GPT-2, GPT-J,
Llama) are exact in float64 (<= 1e-10 on logits, cache and hook) and float32
(<= 1e-4); so are native bridges (boot_native) of three block styles (every
block <= 1e-12 in float64); a bridge that computes its own way (GPT-NeoX in
float64, compatibility mode on a gated MLP, a float64 parameter-free norm) is
refused with the route that works.
Skips, with the reason, when nnsight or transformer_lens is absent."""
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")

from conftest import random_ids as ids, snapshot  # noqa: E402
from icl_book.core import rel_err  # noqa: E402
from icl_book.families import tiny_model  # noqa: E402
from icl_book.hf import (context_patches, patch_errors, patched,  # noqa: E402
                         token_updates)
from icl_book.wrappers import unwrap  # noqa: E402


def word_tokenizer(V=97):
    "A word-level tokenizer over '0'..'V-1', built offline."
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {str(i): i for i in range(V)} | {'[UNK]': V}
    return PreTrainedTokenizerFast(
        unk_token='[UNK]', tokenizer_object=Tokenizer(
            models.WordLevel(vocab, unk_token='[UNK]')))


def language_model(arch, dtype, seed=0):
    nnsight = pytest.importorskip(
        "nnsight", reason="nnsight is not installed: pip install nnsight")
    hf = tiny_model(arch, dtype, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')          # LanguageModel is deprecated
        lm = nnsight.LanguageModel(hf, tokenizer=word_tokenizer())
    return lm, hf


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-4)])
def test_nnsight_trace_exact(arch, dtype, tol):
    lm, hf = language_model(arch, dtype)
    C, x = ids(2, 9, 0), ids(2, 3, 1)
    before = snapshot(hf)
    P = context_patches(lm, C, x)
    with torch.no_grad():
        full = hf(torch.cat([C, x], 1)).logits[:, C.shape[1]:]
    with patched(lm, P) as held:
        assert held is lm                        # the wrapper, to trace
        with lm.trace(x):
            traced = lm.output.logits.save()
    with lm.trace(x):
        alone = lm.output.logits.save()
    assert rel_err(traced, full) <= tol
    assert rel_err(alone, full) > 1e-3           # the patches did the work
    after = snapshot(hf)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nnsight_same_patches_as_inside():
    lm, hf = language_model("llama", "float64")
    C, x = ids(2, 9, 2), ids(2, 3, 3)
    assert unwrap(lm) is hf
    a, b = context_patches(lm, C, x), context_patches(hf, C, x)
    assert all(torch.equal(r.u, s.u) and torch.equal(r.v, s.v)
               for la, lb in zip(a.layers, b.layers)
               for r, s in zip(la.dW, lb.dW))


def test_nnsight_undispatched_refused():
    lm, hf = language_model("llama", "float64")
    lm.dispatched = False                  # as built from a name, on 'meta'
    with pytest.raises(TypeError, match="not dispatched.*model.dispatch"):
        context_patches(lm, ids(1, 6, 2), ids(1, 2, 3))


def test_nnsight_patch_errors_and_token_updates():
    lm, hf = language_model("llama", "float64")
    C, x = ids(1, 6, 4), ids(1, 2, 5)
    e = patch_errors(lm, C, x)
    assert e['output'] <= 1e-10 and max(e['per_layer']) <= 1e-12
    assert e['unpatched'] > 1e-3
    assert torch.equal(token_updates(lm, C, x), token_updates(hf, C, x))


def bridge(arch, dtype, compat=False):
    tl = pytest.importorskip(
        "transformer_lens.model_bridge",
        reason="transformer_lens is not installed: pip install transformer-lens")
    tok = word_tokenizer()
    tok.init_kwargs.update(name_or_path='tiny', add_bos_token=True)
    hf = tiny_model(arch, dtype, seed=0)
    br = tl.TransformerBridge.boot_transformers(
        "tiny", hf_model=hf, tokenizer=tok, dtype=getattr(torch, dtype))
    if compat: br.enable_compatibility_mode()
    return br, hf


def _patched_bridge_runs(br, parts, weights, tol, **run_kw):
    """The patched bridge against its own run with the context: forward,
    run_with_cache (run_kw) and a hook inside `patched`; the patches do the
    work; `parts`' module types and `weights`' tensors are put back. The
    patches (for their self-check)."""
    C, x = ids(2, 9, 0), ids(2, 3, 1)
    n, k, seen = C.shape[1], 'blocks.1.hook_out', []
    kinds = [type(m) for m in parts.modules()]
    before = snapshot(weights)
    P = context_patches(br, C, x)
    with torch.no_grad():
        full, fc = br.run_with_cache(torch.cat([C, x], 1), **run_kw)
        with patched(br, P) as held:
            assert held is br
            out = br(x)
            _, cache = br.run_with_cache(x, **run_kw)
            br.run_with_hooks(x, fwd_hooks=[(k, lambda t, hook: seen.append(t))])
        alone = br(x)
    assert rel_err(out, full[:, n:]) <= tol
    assert rel_err(cache[k], fc[k][:, n:]) <= tol
    assert rel_err(seen[0], fc[k][:, n:]) <= tol
    assert rel_err(alone, full[:, n:]) > 1e-3        # the patches did the work
    assert [type(m) for m in parts.modules()] == kinds   # components put back
    after = snapshot(weights)
    assert all(torch.equal(before[k], after[k]) for k in before)
    return P


@pytest.mark.parametrize("arch", ["gpt2", "gptj", "llama"])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-4)])
def test_bridge_exact(arch, dtype, tol):
    br, hf = bridge(arch, dtype)
    _patched_bridge_runs(br, hf, hf, tol, output_attentions=False)


def test_bridge_weight_written_inside_patched_is_refused():
    """Inside `patched` the bridge files the model's modules under
    `_original_component`; a weight written in place there is the same
    weight, and the next patched call must see the write."""
    br, hf = bridge("llama", "float64")
    C, x = ids(1, 6, 4), ids(1, 2, 5)
    assert_write_refused(br, C, x, hf.model.layers[0].mlp.up_proj.weight)


def assert_write_refused(br, C, x, w):
    "A weight `w` of bridge `br` written in place inside `patched`: refused."
    P = context_patches(br, C, x)
    with pytest.raises(ValueError, match="changed inside patched"):
        with patched(br, P), torch.no_grad():
            w.add_(1.)                             # a write the check must see
            br(x)


def test_bridge_patch_errors():
    br, _ = bridge("llama", "float64")
    e = patch_errors(br, ids(1, 6, 2), ids(1, 2, 3))
    assert e['output'] <= 1e-10 and max(e['per_layer']) <= 1e-12
    assert e['unpatched'] > 1e-3


def test_bridge_token_updates():
    """boot_transformers switches the model to eager attention (Llama's
    softmax then runs in float32): the loop matches an eager twin bit for bit,
    and the one-pass method refuses, as it does on the twin."""
    br, _ = bridge("llama", "float64")
    twin = tiny_model("llama", "float64", seed=0)
    twin.set_attn_implementation("eager")
    C, x = ids(1, 6, 4), ids(1, 2, 5)
    assert torch.equal(token_updates(br, C, x, method="loop"),
                       token_updates(twin, C, x, method="loop"))
    for m in (br, twin):
        with pytest.raises(ValueError, match="use method='loop'"):
            token_updates(m, C, x)


def test_bridge_refusals():
    C, x = ids(1, 6, 6), ids(1, 2, 7)
    neox, _ = bridge("gpt_neox", "float64")        # computes its own way
    with pytest.raises(TypeError, match="logits differ by .* Supported route"):
        context_patches(neox, C, x)
    P = context_patches(tiny_model("llama", "float64", seed=0), C, x)
    compat, _ = bridge("llama", "float64", compat=True)   # logits unchanged
    for call in (lambda: context_patches(compat, C, x),
                 lambda: patched(compat, P).__enter__(),
                 lambda: token_updates(compat, C, x)):
        with pytest.raises(TypeError, match="does not call .* Supported route"):
            call()
    gpt2, _ = bridge("gpt2", "float64", compat=True)      # logits move
    with pytest.raises(TypeError, match="logits differ by"):
        context_patches(gpt2, C, x)


STYLES = {                                    # the three block styles
    'gpt2': dict(act_fn='gelu', normalization_type='LN'),
    'parallel': dict(act_fn='gelu', normalization_type='LN',
                     parallel_attn_mlp=True,
                     positional_embedding_type='rotary'),
    'llama': dict(act_fn='silu', normalization_type='RMS', gated_mlp=True,
                  positional_embedding_type='rotary')}


def native(style, dtype="float64", compat=False, **cfg):
    "A tiny random native bridge (boot_native, offline), in eval mode."
    tl = pytest.importorskip("transformer_lens.model_bridge",
                             reason="transformer_lens is not installed")
    from transformer_lens.config import TransformerBridgeConfig
    br = tl.TransformerBridge.boot_native(TransformerBridgeConfig(
        d_model=16, n_layers=2, n_ctx=32, d_head=4, n_heads=4, d_vocab=97,
        d_mlp=32, seed=0, **STYLES.get(style, {}), **cfg),
        dtype=getattr(torch, dtype)).eval()
    if compat: br.enable_compatibility_mode()
    return br


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("dtype,tol,layer_tol", [
    ("float64", 1e-10, 1e-12), ("float32", 1e-4, 1e-5)])
def test_native_bridge_exact(style, dtype, tol, layer_tol):
    """Against the bridge's own run with the context: the patched forward,
    run_with_cache (plain: the view drops output_attentions, which the
    native model never reads) and a hook inside patched; the self-check's
    blocks; the bridge intact afterwards."""
    br = native(style, dtype)
    P = _patched_bridge_runs(br, br, br.original_model, tol)
    assert max(P.errors) <= layer_tol


@pytest.mark.parametrize("style", list(STYLES))
def test_native_patch_errors_and_token_updates(style):
    br = native(style)
    C, x = ids(1, 6, 2), ids(1, 2, 3)
    e = patch_errors(br, C, x)
    assert e['output'] <= 1e-10 and max(e['per_layer']) <= 1e-12
    assert e['unpatched'] > 1e-3
    U = token_updates(br, C[:, :4], x, method='loop')
    assert U.shape == (4, 2) and bool(U.isfinite().all()) and U.abs().sum() > 0
    with pytest.raises(TypeError, match="method='loop'"):   # no KV cache
        token_updates(br, C, x)


def test_native_parallel_flag_is_sequential():
    """TransformerLens 4.3's NativeBlock does not read parallel_attn_mlp:
    the 'parallel' bridge computes the sequential block (if a release
    changes this, the record read off the blocks follows; this test says
    the chapter's sentence must change)."""
    seq = native('gpt2', positional_embedding_type='rotary')
    par = native('parallel')
    t = ids(1, 8, 4)
    with torch.no_grad():
        assert torch.equal(seq(t), par(t))


def test_native_compatibility_mode():
    """Compatibility mode folds the norms into the native weights in place:
    GPT-2 style still calls every native map (exact, a patch of the folded
    matrix), patches from before the switch are stale; the gated style
    computes from processed copies (refused)."""
    br = native('gpt2')
    C, x = ids(1, 6, 6), ids(1, 2, 7)
    P0 = context_patches(br, C, x)
    br.enable_compatibility_mode()
    with pytest.raises(ValueError, match="changed since context_patches"):
        patched(br, P0).__enter__()
    P = context_patches(br, C, x)
    with torch.no_grad(), patched(br, P):
        out = br(x)
    assert rel_err(out, br(torch.cat([C, x], 1))[:, 6:]) <= 1e-10
    with pytest.raises(TypeError, match="does not call .* Supported route"):
        context_patches(native('llama', compat=True), C, x)


def test_native_refusals():
    C, x = ids(1, 6, 6), ids(1, 2, 7)
    with pytest.raises(TypeError, match="no MLP"):
        context_patches(native('gpt2', attn_only=True), C, x)
    with pytest.raises(TypeError, match="logits differ by"):   # float32 norm
        context_patches(native(None, act_fn='gelu', normalization_type='LNPre'),
                        C, x)
    br = native('gpt2')
    assert_write_refused(br, C, x, br.original_model.layers[0].mlp.fc_in.weight)


def test_native_training_mode_reads_as_eval():
    """boot_native returns its bridge in training mode, which changes none of
    its numbers (no dropout anywhere): the same patches as after .eval(),
    patched runs exact, the flags put back; a module that does read the flag
    (a dropout) keeps the refusal."""
    C, x = ids(1, 6, 8), ids(1, 2, 9)
    br = native('llama').train()
    P, Q = context_patches(br, C, x), context_patches(native('llama'), C, x)
    assert all(torch.equal(r.u, s.u) and torch.equal(r.v, s.v)
               for la, lb in zip(P.layers, Q.layers) for r, s in zip(la.dW, lb.dW))
    with torch.no_grad(), patched(br, P):
        out = br(x)
    assert rel_err(out, br(torch.cat([C, x], 1))[:, 6:]) <= 1e-10
    assert all(m.training for m in br.modules())
    br.original_model.layers[0].mlp.add_module('drop', torch.nn.Dropout(0.1))
    with pytest.raises(ValueError, match="training mode.*eval"):
        context_patches(br, C, x)
