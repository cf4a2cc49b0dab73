"""The library through the tools researchers hold their models in
(icl_book.wrappers): an nnsight LanguageModel and a TransformerLens 4
TransformerBridge booted around a tiny random transformers model (GPT-2, GPT-J,
Llama) are exact in float64 (<= 1e-10 on logits, cache and hook) and float32
(<= 1e-4); a bridge that computes its own way (GPT-NeoX in float64,
compatibility mode) or a native one is refused with the route that works.
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


@pytest.mark.parametrize("arch", ["gpt2", "gptj", "llama"])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-4)])
def test_bridge_exact(arch, dtype, tol):
    br, hf = bridge(arch, dtype)
    C, x = ids(2, 9, 0), ids(2, 3, 1)
    n, k, seen = C.shape[1], 'blocks.1.hook_out', []
    kinds = [type(m) for m in hf.modules()]
    before = snapshot(hf)
    P = context_patches(br, C, x)
    with torch.no_grad():
        full, fc = br.run_with_cache(torch.cat([C, x], 1),
                                     output_attentions=False)
        with patched(br, P) as held:
            assert held is br
            out = br(x)
            _, cache = br.run_with_cache(x, output_attentions=False)
            br.run_with_hooks(x, fwd_hooks=[(k, lambda t, hook: seen.append(t))])
        alone = br(x)
    assert rel_err(out, full[:, n:]) <= tol
    assert rel_err(cache[k], fc[k][:, n:]) <= tol
    assert rel_err(seen[0], fc[k][:, n:]) <= tol
    assert rel_err(alone, full[:, n:]) > 1e-3        # the patches did the work
    assert [type(m) for m in hf.modules()] == kinds  # the bridge put back
    after = snapshot(hf)
    assert all(torch.equal(before[k], after[k]) for k in before)


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


@pytest.mark.parametrize("style", [
    dict(act_fn='gelu', normalization_type='LN'),
    dict(act_fn='gelu', normalization_type='LN', parallel_attn_mlp=True,
         positional_embedding_type='rotary'),
    dict(act_fn='silu', normalization_type='RMS', gated_mlp=True,
         positional_embedding_type='rotary')])
def test_native_bridge_refused_with_route(style):
    tl = pytest.importorskip("transformer_lens.model_bridge",
                             reason="transformer_lens is not installed")
    from transformer_lens.config import TransformerBridgeConfig
    native = tl.TransformerBridge.boot_native(TransformerBridgeConfig(
        d_model=16, n_layers=2, n_ctx=32, d_head=4, n_heads=4, d_vocab=97,
        d_mlp=32, seed=0, **style), dtype=torch.float64)
    C, x = ids(1, 6, 6), ids(1, 2, 7)
    P = context_patches(tiny_model("gpt2", "float64", seed=0), C, x)
    for call in (lambda: context_patches(native, C, x),
                 lambda: patch_errors(native, C, x),
                 lambda: token_updates(native, C, x),
                 lambda: patched(native, P).__enter__()):
        with pytest.raises(TypeError, match="NativeModel, not a transformers "
                           "model.*Supported route.*boot_transformers"):
            call()
