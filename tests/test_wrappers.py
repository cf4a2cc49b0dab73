"""The library through the tools researchers hold their models in
(icl_book.wrappers): an nnsight LanguageModel around a tiny random transformers
model is exact in float64 (<= 1e-10 on the logits of a traced run) and float32
(<= 1e-4); a TransformerLens 4 TransformerBridge is refused with the route that
works. Skips, with the reason, when nnsight or transformer_lens is absent."""
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


def test_nnsight_patch_errors_and_token_updates():
    lm, hf = language_model("llama", "float64")
    C, x = ids(1, 6, 4), ids(1, 2, 5)
    e = patch_errors(lm, C, x)
    assert e['output'] <= 1e-10 and max(e['per_layer']) <= 1e-12
    assert e['unpatched'] > 1e-3
    assert torch.equal(token_updates(lm, C, x), token_updates(hf, C, x))


def test_bridge_refused_with_route():
    tl = pytest.importorskip(
        "transformer_lens.model_bridge",
        reason="transformer_lens is not installed: pip install transformer-lens")
    tok = word_tokenizer()
    tok.init_kwargs.update(name_or_path='tiny', add_bos_token=True)
    hf = tiny_model("gpt2", "float64", seed=0)
    bridge = tl.TransformerBridge.boot_transformers(
        "gpt2", hf_model=hf, tokenizer=tok, dtype=torch.float64)
    C, x = ids(1, 6, 6), ids(1, 2, 7)
    P = context_patches(tiny_model("gpt2", "float64", seed=0), C, x)
    calls = [lambda: context_patches(bridge, C, x),
             lambda: patch_errors(bridge, C, x),
             lambda: token_updates(bridge, C, x),
             lambda: patched(bridge, P).__enter__()]
    for call in calls:
        with pytest.raises(TypeError, match="Supported route.*"
                           "AutoModelForCausalLM.*patched\\(hf_model"):
            call()
