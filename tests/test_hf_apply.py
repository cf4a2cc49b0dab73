"""icl_book.hf_apply on a PEFT `PeftModel`: with active LoRA adapters (on the
MLP's first maps and on attention) the patches are computed against the
effective maps W + s B A and applied beside the adapters (hooks) or written
into the base weight and restored bit for bit; disable_adapter() inside
patched is refused; pooled outputs that read a context position are refused.

Below, patched's guards: heads that read outside the query, classifiers'
padding, writes through `.data`, changed configurations, generation without a
cache, nesting, threads, training mode, Ctrl-C at any instant, offloaded
weights: each exact, or refused naming the cause (tiny random models)."""
import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")

from icl_book.core import rel_err  # noqa: E402
from icl_book.families import tiny_model  # noqa: E402
from icl_book.hf import context_patches, patched  # noqa: E402

TARGETS = ["up_proj", "gate_proj", "q_proj", "v_proj"]


def lora(m, targets=TARGETS, seed=1, **kw):
    "m wrapped with random LoRA adapters (B != 0), in eval."
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                          init_lora_weights=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(m, cfg).eval()


def ids(n, q, seed=0, vocab=97, B=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(2, vocab, (B, s), generator=g) for s in (n, q))


def errors(pm, C, x, inplace=False):
    "(patched vs the PeftModel's own with-context run, query alone vs it)."
    n = C.shape[1]
    with torch.no_grad():
        ref = pm(input_ids=torch.cat([C, x], 1), use_cache=False).logits[:, n:]
        p = context_patches(pm, C, x)
        with patched(pm, p, inplace=inplace):
            out = pm(input_ids=x, use_cache=False).logits
        alone = pm(input_ids=x, use_cache=False).logits
    return p, rel_err(out, ref), rel_err(alone, ref)


@pytest.mark.parametrize("targets", [TARGETS, ["up_proj", "gate_proj"],
                                     ["q_proj", "v_proj"]])
def test_lora_peft_model_is_exact_in_float64(targets):
    torch.set_num_threads(1)
    pm = lora(tiny_model("llama", "float64", seed=0), targets)
    C, x = ids(6, 3)
    with torch.no_grad(), pm.disable_adapter():    # the adapters matter
        base = pm(input_ids=torch.cat([C, x], 1), use_cache=False).logits
    with torch.no_grad():
        own = pm(input_ids=torch.cat([C, x], 1), use_cache=False).logits
    assert rel_err(own, base) > 1e-3
    p, err, alone = errors(pm, C, x)
    assert max(p.errors) <= 1e-12 and err <= 1e-10, (p.errors, err)
    assert alone > 1e-3


def test_lora_written_into_the_base_weight_is_exact_and_restored():
    torch.set_num_threads(1)
    pm = lora(tiny_model("llama", "float64", seed=2))
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    C, x = ids(5, 1, seed=3)
    p, err, _ = errors(pm, C, x, inplace=True)
    assert err <= 1e-10, err
    after = pm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_disable_adapter_inside_patched_is_refused():
    pm = lora(tiny_model("llama", "float64", seed=0))
    C, x = ids(6, 3)
    p = context_patches(pm, C, x)
    with pytest.raises(ValueError, match="PEFT adapters"):
        with patched(pm, p), pm.disable_adapter():
            pm(input_ids=x, use_cache=False)
    with patched(pm, p):                           # still usable after
        pm(input_ids=x, use_cache=False)


def test_lora_on_smollm2_float32(smollm2):
    torch.set_num_threads(1)
    m, tok = smollm2
    pm = lora(copy.deepcopy(m), seed=4)
    C, x = ids(12, 3, seed=5, vocab=m.config.vocab_size)
    p, err, alone = errors(pm, C, x)
    assert err <= 1e-5 and alone > 1e-2, (err, alone)


# ----------------------------------------------------------------------------
# patched's guards on heads and writes: subclassed and unknown heads, a
# classifier's padding, weights written through `.data`, a changed
# configuration and generation without a cache; each once gave a wrong
# number (or a misleading message) and is now exact or refused with its
# reason. Tiny random float64 models only.
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is "
                                   "not installed")

from icl_book.core import rel_err  # noqa: E402
from conftest import model_output as output, random_ids  # noqa: E402
from icl_book.hf import context_patches, patched, tiny_model  # noqa: E402


def full_out(m, C, x, **kw):
    return output(m, torch.cat([C, x], 1), **kw)[:, C.shape[1]:]


def head(arch, cls, *bases):
    "A head of class `cls` (or a user's subclass of it) on a tiny config."
    torch.manual_seed(0)
    c = getattr(transformers, cls)
    if bases: c = type("MyHead", (c,), {})
    return c(tiny_model(arch).config).double().eval()


@pytest.mark.parametrize("arch,cls", [
    ("bert", "BertForSequenceClassification"),         # was an IndexError
    ("roberta", "RobertaForSequenceClassification"),   # silently 1.5
    ("distilbert", "DistilBertForSequenceClassification"),   # 2.0
    ("electra", "ElectraForSequenceClassification")])  # 5.0
def test_subclassed_pooling_heads_are_refused(arch, cls):
    m = head(arch, cls, "sub")
    C, x = random_ids(1, 6, 0, low=3), random_ids(1, 3, 1, low=3)
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match=f"MyHead's head \\(a {cls}\\) "
                       "reads position 0"):
        with patched(m, p):
            m(x)


class FirstToken(transformers.BertPreTrainedModel):
    "A user's encoder head that reads position 0 of the last hidden state."
    def __init__(self, cfg):
        super().__init__(cfg)
        self.bert = transformers.BertModel(cfg, add_pooling_layer=False)
        self.post_init()

    def forward(self, input_ids, **kw):
        return self.bert(input_ids, **kw).last_hidden_state[:, 0]


def test_an_unknown_encoder_head_is_refused():
    torch.manual_seed(0)
    m = FirstToken(tiny_model("bert").config).double().eval()
    C, x = random_ids(1, 6, 0, low=3), random_ids(1, 3, 1, low=3)
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match="not one known to read each "
                       "position on its own"):
        with patched(m, p):
            m(x)


def test_electra_discriminator_reads_each_position_and_is_exact():
    m = head("electra", "ElectraForPreTraining")       # was refused
    C, x = random_ids(2, 6, 0, low=3), random_ids(2, 3, 1, low=3)
    with torch.no_grad():
        ref = m(torch.cat([C, x], 1)).logits[:, 6:]
        with patched(m, context_patches(m, C, x)):
            got = m(x).logits
    assert rel_err(got, ref) <= 1e-12


def test_causal_classifier_refuses_a_query_of_padding_only():
    cfg = tiny_model("llama").config
    cfg.pad_token_id = 5
    torch.manual_seed(0)
    m = transformers.LlamaForSequenceClassification(cfg).double().eval()
    with torch.no_grad():
        m.model.embed_tokens.weight[5].normal_()       # a trained pad row
    C = random_ids(1, 7, 0, low=6)
    with torch.no_grad():                              # padding inside: exact
        x = torch.tensor([[5, 7]])
        ref = m(torch.cat([C, x], 1)).logits
        with patched(m, context_patches(m, C, x)):
            assert rel_err(m(x).logits, ref) <= 1e-12
        p = context_patches(m, C, torch.tensor([[5, 5]]))   # 1.6 before
        with pytest.raises(ValueError, match="last token that is not "
                           "padding \\(pad_token_id=5\\)"):
            with patched(m, p):
                pass


def test_weights_written_through_data_are_refused():
    m = tiny_model("llama")
    C, x = random_ids(1, 6, 0), random_ids(1, 2, 1)
    p = context_patches(m, C, x)
    w = m.model.layers[1].mlp.up_proj.weight
    w.data.mul_(1.01)                      # no version bump: 6.4e-3 before
    with pytest.raises(ValueError, match="1 weight\\(s\\) .* changed since "
                       "context_patches \\(layers.1.mlp.up_proj.weight\\)"):
        with patched(m, p):
            pass
    w.data.div_(1.01)                      # not bit for bit the old weight
    with pytest.raises(ValueError, match="changed since context_patches"):
        with patched(m, p):
            pass
    p = context_patches(m, C, x)           # recomputed: exact again
    full = full_out(m, C, x)
    with patched(m, p):
        assert rel_err(output(m, x), full) <= 1e-10


@pytest.mark.parametrize("inplace", [False, True])
def test_data_writes_inside_an_open_block_are_refused_on_leaving_it(inplace):
    """The check at each call reads counters and addresses only (a forward
    pass's worth of byte sums per call was the cost): a write through `.data`
    between two calls is not seen by the second call, as 11ac says, and is
    refused when the block is left."""
    m = tiny_model("llama")
    C, x = random_ids(1, 6, 0), random_ids(1, 1, 1)
    p, full = context_patches(m, C, x), full_out(m, C, x)
    w = m.model.layers[0].mlp.down_proj.weight
    with pytest.raises(ValueError, match="changed inside patched\\(...\\) "
                       "through .data \\(layers.0.mlp.down_proj.weight\\)"):
        with patched(m, p, inplace=inplace):
            assert rel_err(output(m, x), full) <= 1e-10
            w.data.mul_(1.01)              # no version bump
            assert rel_err(output(m, x), full) > 1e-4   # not seen per call
            w.data.div_(1.01)              # not bit for bit the old weight


def test_a_normal_in_place_write_inside_an_open_block_is_refused_at_the_call():
    "torch's counter sees it: the next call is refused, leaving is not."
    m = tiny_model("llama")
    C, x = random_ids(1, 6, 0), random_ids(1, 1, 1)
    p = context_patches(m, C, x)
    w = m.model.layers[0].mlp.down_proj.weight
    with patched(m, p):
        output(m, x)
        with torch.no_grad():
            w.mul_(1.01)
        with pytest.raises(ValueError, match="changed inside patched"):
            output(m, x)


def test_a_data_write_with_no_call_after_entering_is_not_refused_on_leaving():
    "No output was computed inside the block, so none can be wrong."
    m = tiny_model("llama")
    p = context_patches(m, random_ids(1, 6, 0), random_ids(1, 1, 1))
    with patched(m, p):
        m.model.layers[0].mlp.down_proj.weight.data.mul_(1.01)
    with pytest.raises(ValueError, match="changed since context_patches"):
        with patched(m, p):
            pass


def test_a_changed_configuration_is_refused():
    m = tiny_model("mistral", sliding_window=4)
    C, x = random_ids(1, 6, 0), random_ids(1, 6, 1)
    full = full_out(m, C, x)
    p = context_patches(m, C, x)
    m.config.sliding_window = 2                        # silently 0.45 before
    with pytest.raises(ValueError, match="configuration changed since "
                       "context_patches \\(sliding_window\\)"):
        with patched(m, p):
            pass
    m.config.sliding_window = 4
    impl = m.config._attn_implementation
    with patched(m, p):
        m.config._attn_implementation = "eager" if impl != "eager" else "sdpa"       # 9e-8 before
        with pytest.raises(ValueError, match="configuration changed inside "
                           "patched.*attn_implementation"):
            output(m, x)
        m.config._attn_implementation = impl
        assert rel_err(output(m, x), full) <= 1e-10


def test_generate_without_a_cache_inside_patched_says_what_to_use():
    m = tiny_model("llama", "float32")
    C, x = random_ids(1, 6, 0), random_ids(1, 2, 1)
    with patched(m, context_patches(m, C, x)):
        with pytest.raises(ValueError, match="generate_without_context"):
            m.generate(x, max_new_tokens=2, do_sample=False, use_cache=False)
    assert "generate" not in vars(m)                   # the method is back
    assert m.generate(x, max_new_tokens=1, do_sample=False).shape == (1, 3)


# ----------------------------------------------------------------------------
# Around patched: heads reading outside the query, keyword arguments the
# patch never saw, nesting, a second thread, training mode, weights edited
# after the patches, float32 norms, Ctrl-C at any instant, bad min_norm,
# offloaded weights, pickling: each exact, or refused naming the cause.
# Tiny random models only.
import io
import random
import re
import signal
import sys
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is "
                                   "not installed")

from icl_book.core import rel_err  # noqa: E402
from conftest import model_output as output, random_ids, snapshot  # noqa: E402
from icl_book.hf import (context_patches, generate_without_context,  # noqa: E402
                         patched, tiny_model)


def hooks_left(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for m in model.modules())


def same_bits(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def full_out(m, C, x, **kw):
    return output(m, torch.cat([C, x], 1), **kw)[:, C.shape[1]:]


# ------------------------------------------- heads reading outside the query
@pytest.mark.parametrize("arch,cls", [
    ("bert", "BertForSequenceClassification"),
    ("bert", "BertForNextSentencePrediction"),
    ("bert", "BertForPreTraining"),
    ("roberta", "RobertaForSequenceClassification"),
    ("distilbert", "DistilBertForSequenceClassification")])
def test_pooling_heads_are_refused_naming_position_0(arch, cls):
    cfg = tiny_model(arch).config
    torch.manual_seed(0)
    m = getattr(transformers, cls)(cfg).double().eval()
    C, x = random_ids(1, 6, 0, low=3), random_ids(1, 3, 1, low=3)
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match="reads position 0"):
        with patched(m, p):
            m(x)
    assert hooks_left(m) == 0


def test_causal_classifier_reads_the_last_token_and_is_exact():
    cfg = tiny_model("llama").config
    torch.manual_seed(0)
    m = transformers.LlamaForSequenceClassification(cfg).double().eval()
    C, x = random_ids(1, 7, 0), random_ids(1, 2, 1)
    with torch.no_grad():
        ref = m(torch.cat([C, x], 1)).logits
        with patched(m, context_patches(m, C, x)):
            got = m(x).logits
    assert rel_err(got, ref) <= 1e-10


# ---------------------------------------------------- keyword arguments
def test_keyword_arguments_the_patch_never_saw_are_refused():
    m = tiny_model("bert")
    C, x = random_ids(2, 6, 0), random_ids(2, 3, 1)
    p = context_patches(m, C, x)
    with patched(m, p):
        with pytest.raises(ValueError, match="token_type_ids was given"):
            m(x, token_type_ids=torch.ones_like(x))
        with pytest.raises(ValueError, match="output_attentions"):
            m(x, output_attentions=True)
        with pytest.raises(ValueError, match="inputs_embeds"):
            m(x, inputs_embeds=torch.zeros(2, 3, 32, dtype=torch.float64))


def test_context_patches_take_token_type_ids():
    m = tiny_model("bert")
    C, x = random_ids(2, 6, 0), random_ids(2, 3, 1)
    tt = torch.cat([torch.zeros(2, 6), torch.ones(2, 3)], 1).long()
    full = full_out(m, C, x, token_type_ids=tt)
    p = context_patches(m, C, x, token_type_ids=tt)
    with patched(m, p):
        assert rel_err(output(m, x), full) <= 1e-12   # filled in
        assert rel_err(output(m, x, token_type_ids=tt[:, 6:]), full) <= 1e-12
        with pytest.raises(ValueError, match="token_type_ids differs"):
            m(x, token_type_ids=torch.zeros_like(x))
    assert rel_err(full_out(m, C, x), full) > 1e-3     # the types matter


def test_generate_inside_patched_points_to_generate_without_context():
    m = tiny_model("llama", "float32")
    C, x = random_ids(1, 6, 0), random_ids(1, 2, 1)
    with patched(m, context_patches(m, C, x)):
        with pytest.raises(ValueError, match="generate_without_context"):
            m.generate(x, max_new_tokens=2, do_sample=False)
    assert hooks_left(m) == 0


# ------------------------------------------ nesting, threads, mode, weights
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_nested_patched_is_refused(arch):
    m = tiny_model(arch, layers=2, d=16)
    C, x = random_ids(1, 6, 0), random_ids(1, 2, 1)
    full = full_out(m, C, x)
    p = context_patches(m, C, x)
    before = snapshot(m)
    with patched(m, p):
        with pytest.raises(RuntimeError, match="already inside patched"):
            with patched(m, p):
                pass
        assert rel_err(output(m, x), full) <= 1e-10   # the outer one intact
    assert hooks_left(m) == 0 and same_bits(m, before)
    with patched(m, p):                                # usable again
        assert rel_err(output(m, x), full) <= 1e-10


def test_a_second_thread_cannot_use_a_patched_model():
    m = tiny_model("llama", "float32")
    C, x = random_ids(1, 6, 0), random_ids(1, 1, 1)
    p = context_patches(m, C, x)
    inside, leave, seen = threading.Event(), threading.Event(), []

    def worker():
        with patched(m, p, inplace=True):
            inside.set(); leave.wait(30)

    t = threading.Thread(target=worker); t.start()
    try:
        assert inside.wait(30)
        for f in (lambda: m(x), lambda: patched(m, p).__enter__()):
            with pytest.raises(RuntimeError, match="in another thread") as e:
                f()
            seen.append(str(e.value))
    finally:
        leave.set(); t.join()
    assert len(seen) == 2 and hooks_left(m) == 0
    with patched(m, p):                                # free again
        output(m, x)


def test_train_inside_the_block_is_refused_at_the_call():
    m = tiny_model("gpt2", "float32", layers=2, d=16)
    C, x = random_ids(1, 6, 0), random_ids(1, 2, 1)
    with patched(m, context_patches(m, C, x)):
        output(m, x)
        m.train()
        with pytest.raises(ValueError, match="training mode"):
            output(m, x)
        m.eval()
        output(m, x)


def test_weights_edited_after_context_patches_are_refused():
    m = tiny_model("llama")
    C, x = random_ids(1, 6, 0), random_ids(1, 2, 1)
    p = context_patches(m, C, x)
    w = m.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        w.mul_(1.01)
    with pytest.raises(ValueError, match="changed since context_patches"):
        with patched(m, p):
            pass
    p = context_patches(m, C, x)
    with patched(m, p):
        output(m, x)
        with torch.no_grad():
            m.model.layers[0].self_attn.q_proj.weight.add_(1e-3)
        with pytest.raises(ValueError, match="changed inside patched"):
            output(m, x)
    assert hooks_left(m) == 0


def test_inplace_block_keeps_its_patches_valid():
    m = tiny_model("llama")
    C, x = random_ids(1, 6, 0), random_ids(1, 1, 1)
    full = full_out(m, C, x)
    p = context_patches(m, C, x)
    for _ in range(2):                                 # written, restored
        with patched(m, p, inplace=True):
            assert rel_err(output(m, x), full) <= 1e-10


def test_dynamic_rope_state_change_is_refused():
    m = tiny_model("llama", max_position_embeddings=16, rope_parameters=dict(
        rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    C, x = random_ids(1, 14, 0), random_ids(1, 4, 1)                 # 18 > 16 positions
    full = full_out(m, C, x)
    p = context_patches(m, C, x)
    with patched(m, p):
        assert rel_err(output(m, x), full) <= 1e-10
    output(m, random_ids(1, 30, 2))                           # a longer call
    with patched(m, p):
        with pytest.raises(ValueError, match="rotary embedding"):
            output(m, x)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_inplace_into_float32_norms_is_refused_in_float64(arch):
    m = tiny_model(arch, "float64", layers=2, d=16)
    C, x = random_ids(1, 6, 0), random_ids(1, 1, 1)
    full = full_out(m, C, x)
    before = snapshot(m)
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match="computes in float32"):
        with patched(m, p, inplace=True):
            pass
    assert same_bits(m, before) and hooks_left(m) == 0
    with patched(m, p):                                # hooks: exact
        assert rel_err(output(m, x), full) <= 1e-12


# ------------------------------------------------------------------ Ctrl-C
def interrupted_block(m, p, inplace, k):
    """Run `with patched(...): pass` with a Ctrl-C at the k-th line or call
    event (any line of any frame); (events, hit). The SIGINT handler is
    called as Python calls it for a real signal: with the frame it lands in
    (`signal.raise_signal` here would hand it the tracer's own frame).
    Not at 'return' events: an exception raised by a trace function as a
    generator suspends at its `yield` ends that frame without its `finally`,
    which no Ctrl-C can do (a signal's handler runs between bytecodes, and a
    suspended generator is closed, running its `finally`, when its context
    manager is dropped)."""
    n = [0]

    def tracer(frame, event, arg):
        if event == "return":
            return tracer
        n[0] += 1
        if n[0] == k:
            handler = signal.getsignal(signal.SIGINT)
            if not callable(handler):
                raise KeyboardInterrupt
            handler(signal.SIGINT, frame)
        return tracer
    try:
        sys.settrace(tracer)
        try:
            with patched(m, p, inplace=inplace):
                pass
        finally:
            sys.settrace(None)
    except KeyboardInterrupt:
        return n[0], True
    return n[0], False


# an interrupt landing in a generator's finalizer is dropped by Python itself
# ("Exception ignored in"): it changes no state, so that warning is ignored
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("inplace", [False, True])
def test_ctrl_c_at_random_instants_leaves_nothing_behind(inplace):
    m = tiny_model("llama", "float32", layers=2, d=16)
    C, x = random_ids(1, 6, 0), random_ids(1, 1, 1)
    p = context_patches(m, C, x)
    before, rng = snapshot(m), random.Random(0)
    K, hit = interrupted_block(m, p, inplace, -1)       # events, no signal
    assert not hit and K > 100
    hits, left = 0, []
    for _ in range(300):
        k = rng.randint(1, K)
        hits += interrupted_block(m, p, inplace, k)[1]
        if hooks_left(m) or not same_bits(m, before):
            left.append(k)
            break
    assert not left, f"a Ctrl-C at event {left[0]} of {K} left state behind"
    assert hits >= 290                         # the interrupts did land
    with patched(m, p):                        # and the model is free
        output(m, x)


def test_ctrl_c_after_both_kinds_of_patched_block_is_a_keyboardinterrupt():
    """hf's held sections and core's in-place edits share one SIGINT handler:
    after patched(inplace=True) and patched() in turn a Ctrl-C outside any
    block is a plain KeyboardInterrupt (two handlers chained into each other
    raised RecursionError here)."""
    m = tiny_model("llama", "float64", layers=2, d=16)
    C, x = random_ids(1, 6, 0), random_ids(1, 1, 1)
    p = context_patches(m, C, x)
    for _ in range(2):
        for inplace in (True, False):
            with torch.no_grad(), patched(m, p, inplace=inplace):
                output(m, x)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("kw,words", [
    (dict(min_norm=-1), "min_norm must be a finite real number > 0"),
    (dict(min_norm=True), "min_norm must be a finite real number"),
    (dict(min_norm=float("nan")), "min_norm must be a finite real number"),
])
def test_context_patches_refuse_bad_min_norm(kw, words):
    m = tiny_model("llama", "float64", layers=1, d=16)
    with pytest.raises(ValueError, match=words):
        context_patches(m, random_ids(1, 4, 0), random_ids(1, 1, 1), **kw)


@pytest.mark.parametrize("arch,where", [
    ("llama", "layer 0: the context-free MLP input is (nearly) zero"),
    ("mixtral", "layer 0: the context-free MoE input is (nearly) zero"),
])
def test_closed_loop_refuses_inputs_below_min_norm(arch, where):
    "The closed loop's guard: a first-map input below min_norm is refused."
    m = tiny_model(arch, "float64", layers=1, d=16)
    with pytest.raises(ValueError, match=re.escape(where)):
        context_patches(m, random_ids(1, 4, 0), random_ids(1, 1, 1), min_norm=1e30)
    context_patches(m, random_ids(1, 4, 0), random_ids(1, 1, 1), min_norm=1e-30)   # passes


def test_generation_refuses_a_bool_token_count():
    m = tiny_model("llama", "float64", layers=1, d=16)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        generate_without_context(m, random_ids(1, 4, 0), random_ids(1, 1, 1),
                                 max_new_tokens=True)


# ------------------------------------------------------- crashes, messages
def test_moe_patches_under_inference_mode():
    m = tiny_model("mixtral", layers=2, d=16)
    C, x = random_ids(1, 6, 0), random_ids(1, 2, 1)
    full = full_out(m, C, x)
    with torch.inference_mode():
        p = context_patches(m, C, x)
    with patched(m, p):
        assert rel_err(output(m, x), full) <= 1e-10


def test_chunked_feed_forward_that_does_not_divide_the_query():
    m = tiny_model("bert", chunk_size_feed_forward=2)
    with pytest.raises(ValueError, match="chunks of 2 positions"):
        context_patches(m, random_ids(1, 6, 0), random_ids(1, 3, 1))


def test_rope_models_refuse_prompts_beyond_their_positions():
    m = tiny_model("llama")                            # 128 positions
    with pytest.raises(ValueError, match="exceed the LlamaForCausalLM's 128"):
        context_patches(m, random_ids(1, 127, 0), random_ids(1, 2, 1))


def test_non_finite_with_context_run_is_reported_as_such():
    m = tiny_model("llama")
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="transformers' own run"):
        context_patches(m, random_ids(1, 6, 0), random_ids(1, 2, 1))


def test_cpu_offload_is_patched_exactly():
    accelerate = pytest.importorskip("accelerate")
    m = tiny_model("llama", "float32")
    C, x = random_ids(2, 6, 0), random_ids(2, 2, 1)
    full = full_out(m, C, x)
    accelerate.cpu_offload(m, execution_device=torch.device("cpu"))
    assert m.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    p = context_patches(m, C, x)
    with patched(m, p):
        assert rel_err(output(m, x), full) <= 1e-5


def test_hfpatch_is_not_pickled_and_says_why():
    m = tiny_model("llama")
    p = context_patches(m, random_ids(1, 6, 0), random_ids(1, 2, 1))
    with pytest.raises(TypeError, match=r"P.save\(path\).*load_patches\(path, model\)"):
        torch.save(p, io.BytesIO())
