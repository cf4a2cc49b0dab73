"""icl_book.hf_patch: mixtures whose router computes in float32 even in a
float64 model (GLM-4-MoE, DeepSeek-V3, EXAONE-MoE, ...) are exact: the router
keeps its weight and reads the patched input a + ΔA in a batch of the
with-context run's shape, so its float32 logits are that run's bit for bit.

Below, context_patches across configurations (padding, sliding windows, rope
scalings, tied embeddings, context lengths, batches, precisions, heads,
offloading): each exact to its dtype's round-off or refused with a reason."""
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")

from icl_book.core import rel_err  # noqa: E402
from icl_book.experiments.discovery import ZOO_TINY, zoo_model  # noqa: E402
from icl_book.families import float32_routers  # noqa: E402
from icl_book.hf import context_patches, patched  # noqa: E402
from icl_book.hf_checks import check_model  # noqa: E402


def deepseek_v3():
    "A tiny float64 DeepSeek-V3 (the zoo's sizes, MLA head sizes of its own)."
    import transformers as tf
    kw = {k: v for k, v in ZOO_TINY.items() if k != "head_dim"}
    kw.update(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
              qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1,
              first_k_dense_replace=1, moe_intermediate_size=16,
              num_key_value_heads=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.AutoConfig.for_model("deepseek_v3", **kw)
        torch.manual_seed(0)
        m = tf.AutoModelForCausalLM.from_config(cfg).double().eval()
    m.set_experts_implementation("eager")
    return m


def build(mt):
    return deepseek_v3() if mt == "deepseek_v3" else zoo_model(mt)


def logits_errors(m, B=1, n=5, q=2, seed=0):
    "(patched vs with-context, query alone vs with-context), relative."
    g = torch.Generator().manual_seed(seed)
    C, x = (torch.randint(2, 97, (B, s), generator=g) for s in (n, q))
    with torch.no_grad():
        ref = m(torch.cat([C, x], 1), use_cache=False).logits[:, n:]
        p = context_patches(m, C, x)
        with patched(m, p):
            out = m(x, use_cache=False).logits
        alone = m(x, use_cache=False).logits
    return p, rel_err(out, ref), rel_err(alone, ref)


@pytest.mark.parametrize("mt", ["glm4_moe", "deepseek_v3", "exaone_moe"])
def test_float32_router_mixtures_are_exact_in_float64(mt):
    torch.set_num_threads(1)
    m = build(mt)
    ad = check_model(m)
    assert any(float32_routers(lay, torch.float64) for lay in ad.layers)
    p, err, alone = logits_errors(m)
    assert max(p.errors) <= 1e-12, p.errors
    assert err <= 1e-10, err
    assert alone > 1e-3                       # the context matters
    assert any(lp.dA is not None for lp in p.layers)


def test_float32_router_two_sequences_exact():
    "B = 2: each position's row of the with-context batch is its own."
    torch.set_num_threads(1)
    p, err, _ = logits_errors(build("glm4_moe"), B=2, n=4, q=3, seed=1)
    assert max(p.errors) <= 1e-12 and err <= 1e-10, (p.errors, err)


def test_float32_router_written_in_place_is_refused():
    m = build("glm4_moe")
    g = torch.Generator().manual_seed(0)
    C, x = (torch.randint(2, 97, (1, s), generator=g) for s in (5, 1))
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match="inplace=False"):
        with patched(m, p, inplace=True):
            pass


# ----------------------------------------------------------------------------
# context_patches and patched across configurations: padding (left and
# right, eager and sdpa), sliding windows, rope scalings, tied embeddings,
# contexts of 1 and 500, a batch of 3, float32 / bfloat16 / float16, heads
# of every kind, train(), weight edits and nesting inside `patched`, and
# offloaded weights. Each case is exact (float64: 1e-10 relative on the
# output; other dtypes: their round-off) or refused with a message that
# says why. Tiny random models only (seconds).
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is "
                                   "not installed")

from icl_book.core import rel_err  # noqa: E402
from conftest import model_output as output, random_ids as ids  # noqa: E402
from icl_book.hf import context_patches, patched, tiny_model  # noqa: E402

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def patched_vs_full(m, C, x, mask=None, **kw):
    "Relative error of the patched query-alone run at the real positions."
    full = output(m, torch.cat([C, x], 1), **({} if mask is None else
                                               dict(attention_mask=mask)),
                  **kw)[:, C.shape[1]:]
    p = context_patches(m, C, x, attention_mask=mask)
    with patched(m, p):
        got = output(m, x, **kw)
    keep = (torch.ones_like(x, dtype=torch.bool) if mask is None
            else mask[:, C.shape[1]:].bool())
    return rel_err(got[keep], full[keep])


def check(m, C, x, refused=None, tol=1e-10, **kw):
    "Exact to `tol`, or refused with a message matching `refused`."
    if refused is None:
        assert patched_vs_full(m, C, x, **kw) <= tol
    else:
        with pytest.raises((ValueError, TypeError), match=refused):
            patched_vs_full(m, C, x, **kw)


# ----------------------------------------------------------------- padding
_NAN_CTX = re.escape("a row whose keys are all masked (left padding) "
                     "softmaxes to NaN")
_NAN_QUERY = re.escape("a padded query slot whose keys are all masked")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("where,refused_eager", [
    ("context-left", _NAN_CTX),        # transformers' own run is NaN there
    ("context-right", None),
    ("query-right", None),
    ("query-left", _NAN_QUERY),        # the query alone: a fully masked row
])
def test_padding(attn, where, refused_eager):
    m = tiny_model("llama", layers=2, d=16, pad_token_id=0)
    m.set_attn_implementation(attn)
    with torch.no_grad():
        m.model.embed_tokens.weight[0] = 0     # a zero padding embedding
    C, x = ids(2, 8, 0, low=1), ids(2, 3, 1, low=1)
    mask = torch.ones(2, 11, dtype=torch.long)
    slot = dict(zip(["context-left", "context-right", "query-right",
                     "query-left"], [slice(0, 3), slice(5, 8), slice(10, 11),
                                     slice(8, 9)]))[where]
    mask[0, slot] = 0
    C[0, slot.start:min(slot.stop, 8)] = 0
    x[0, max(slot.start - 8, 0):max(slot.stop - 8, 0)] = 0
    check(m, C, x, refused_eager if attn == "eager" else None, mask=mask)


# ------------------------------------------------- windows, rope, embeddings
@pytest.mark.parametrize("arch,cfg", [
    ("mistral", dict(sliding_window=4)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4,
                   max_window_layers=1)),
    ("gemma2", dict(sliding_window=4)),
    ("gemma3_text", dict(sliding_window=4)),
])
def test_sliding_windows_shorter_than_the_context(arch, cfg):
    m = tiny_model(arch, layers=2, d=16, **cfg)
    check(m, ids(1, 10, 0), ids(1, 3, 1))


@pytest.mark.parametrize("rope", [
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="dynamic", factor=2.0),
    dict(rope_type="yarn", factor=2.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
         high_freq_factor=4.0, original_max_position_embeddings=16),
    dict(rope_type="longrope", short_factor=[1.0, 1.0],
         long_factor=[2.0, 2.0], original_max_position_embeddings=16),
])
def test_rope_scalings(rope):
    m = tiny_model("llama", layers=2, d=16,
                   rope_parameters=dict(rope_theta=10000.0, **rope))
    check(m, ids(1, 20, 0), ids(1, 3, 1))


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied):
    m = tiny_model("llama", layers=2, d=16, tie_word_embeddings=tied)
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
    check(m, ids(1, 6, 0), ids(1, 2, 1))


@pytest.mark.parametrize("n,q,B", [(1, 1, 1), (1, 4, 3), (500, 2, 1),
                                   (7, 3, 3)])
def test_context_lengths_and_batches(n, q, B):
    m = tiny_model("llama", layers=2, d=16, max_position_embeddings=512)
    check(m, ids(B, n, 0), ids(B, q, 1))


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "mixtral",
                                  "gemma2", "phi"])
def test_precisions(arch, dtype):
    m = tiny_model(arch, dtype, layers=2, d=16)
    check(m, ids(1, 8, 0), ids(1, 3, 1), tol=TOL[dtype])


# ------------------------------------------------------------------- heads
@pytest.mark.parametrize("arch,head,refused", [
    ("llama", "LlamaForCausalLM", None),
    ("llama", "LlamaForSequenceClassification", None),   # the last token
    ("llama", "LlamaForTokenClassification", None),
    ("llama", "LlamaForQuestionAnswering", None),
    ("llama", "LlamaModel", None),
    ("bert", "BertForMaskedLM", None),
    ("bert", "BertForTokenClassification", None),
    ("bert", "BertForQuestionAnswering", None),
    ("bert", "BertForSequenceClassification", "reads position 0"),
    ("bert", "BertForNextSentencePrediction", "reads position 0"),
    ("bert", "BertForPreTraining", "reads position 0"),
    ("bert", "BertForMultipleChoice", "reads position 0"),
])
def test_heads(arch, head, refused):
    cfg = tiny_model(arch, layers=2, d=16).config
    torch.manual_seed(0)
    m = getattr(transformers, head)(cfg).double().eval()
    C, x = ids(1, 6, 0, low=2), ids(1, 3, 1, low=2)
    if head == "BertForMultipleChoice":
        C, x = C[:, None], x[:, None]          # (B, choices, T): refused
        with pytest.raises(ValueError, match="ids"):
            context_patches(m, C, x)
        return
    out = lambda r: next(v for v in r.values() if isinstance(v, torch.Tensor)
                         and v.dim() >= 2 and v.is_floating_point())
    with torch.no_grad():
        full = out(m(torch.cat([C, x], 1)))
        full = full[:, 6:] if full.shape[1] == 9 else full   # per token
    p = context_patches(m, C, x)
    if refused:
        with pytest.raises(ValueError, match=refused), patched(m, p):
            m(x)
        return
    with torch.no_grad(), patched(m, p):
        assert rel_err(out(m(x)), full) <= 1e-10


# ------------------------------------------------- changes inside patched
def _inside(m, p, x, what):
    if what == "train": m.train()
    elif what == "edit":
        with torch.no_grad(): m.model.layers[0].mlp.up_proj.weight[0, 0] += 1
    elif what == "data": m.model.layers[0].mlp.up_proj.weight.data[0, 0] += 1
    elif what == "config": m.config.sliding_window = 2
    elif what == "nest":
        with patched(m, p): pass
    m(x)


@pytest.mark.parametrize("what,refused", [
    ("train", "training mode"),
    ("edit", "changed inside patched"),
    ("data", "changed inside patched"),
    ("config", "configuration changed inside patched"),
    ("nest", "already inside patched"),
])
@pytest.mark.parametrize("inplace", [False, True])
def test_changes_inside_patched_are_refused(what, refused, inplace):
    m = tiny_model("llama", layers=2, d=16)
    C, x = ids(1, 6, 0), ids(1, 1, 1)
    p = context_patches(m, C, x)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises((ValueError, RuntimeError), match=refused):
        with torch.no_grad(), patched(m, p, inplace=inplace):
            _inside(m, p, x, what)
    if what in ("train", "nest", "config"):      # nothing written stays
        assert all(torch.equal(v, before[k])
                   for k, v in m.state_dict().items())


# ----------------------------------------------------------------- offload
@pytest.mark.parametrize("how", ["cpu_offload", "disk", "dispatch"])
def test_offloaded_weights(how, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    m = tiny_model("llama", "float32", layers=2, d=16)
    C, x = ids(2, 6, 0), ids(2, 2, 1)
    full = output(m, torch.cat([C, x], 1))[:, 6:]
    if how == "cpu_offload":
        accelerate.cpu_offload(m, execution_device=torch.device("cpu"))
    else:
        dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu",
                "model.layers.1": "disk" if how == "disk" else "cpu",
                "model.norm": "cpu", "model.rotary_emb": "cpu",
                "lm_head": "cpu"}
        accelerate.dispatch_model(m, dmap, offload_dir=str(tmp_path),
                                  main_device="cpu")
    p = context_patches(m, C, x)
    with patched(m, p):
        assert rel_err(output(m, x), full) <= 1e-5
    if how != "dispatch":                      # meta weights: no writing
        with pytest.raises(ValueError, match="offloaded"):
            with patched(m, context_patches(m, C[:1], x[:1, :1]),
                         inplace=True):
                pass
