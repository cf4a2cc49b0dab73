"""icl_book.families on a PEFT `PeftModel`: the records resolve on the model
inside, a LoRA layer standing for the linear map it adapts; adapters the patch
cannot read (DoRA, other tuner types, prompt learning) are refused with the
remedy, merge_and_unload().

Below, every described transformers family exact on random tiny configs
(float64 and float32, several context and query lengths, padding, chunked
feed-forwards, half precision, mixtures of experts, offloading), and the
structural refusals of discovery."""
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")

from icl_book.families import adapter, linear_weight, tiny_model  # noqa: E402
from icl_book.hf import context_patches  # noqa: E402


def wrap(cfg, arch="llama"):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(tiny_model(arch, "float64"), cfg).eval()


def lora_cfg(**kw):
    return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                           target_modules=["up_proj", "gate_proj"], **kw)


def test_records_resolve_inside_a_peft_model():
    pm = wrap(lora_cfg())
    ad = adapter(pm)
    inner = pm.get_base_model()
    assert ad.base is inner.model and ad.name == type(inner).__name__
    lay = ad.layers[0]
    assert lay.first == (inner.model.layers[0].mlp.gate_proj,
                         inner.model.layers[0].mlp.up_proj)
    assert all(hasattr(m, "lora_A") for m in lay.first)
    W = inner.model.layers[0].mlp.gate_proj.base_layer.weight
    assert linear_weight(lay.first[0]) is W


def test_gpt2_conv1d_with_lora_is_read_in_its_layout():
    cfg = peft.LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights=False,
                          fan_in_fan_out=True)
    ad = adapter(wrap(cfg, "gpt2"))
    m = ad.layers[0].first[0]
    assert type(m.base_layer).__name__ == "Conv1D"
    assert linear_weight(m).shape == (m.base_layer.weight.shape[1],
                                       m.base_layer.weight.shape[0])


@pytest.mark.parametrize("cfg", [
    lambda: lora_cfg(use_dora=True),
    lambda: peft.IA3Config(target_modules=["up_proj", "down_proj"],
                           feedforward_modules=["up_proj"]),
    lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
], ids=["dora", "ia3", "prefix"])
def test_adapters_it_cannot_read_are_refused_naming_the_remedy(cfg):
    pm = wrap(cfg())
    C, x = torch.randint(2, 97, (1, 5)), torch.randint(2, 97, (1, 2))
    for f in (lambda: adapter(pm), lambda: context_patches(pm, C, x)):
        with pytest.raises(TypeError, match=r"merge_and_unload\(\)"):
            f()


# ----------------------------------------------------------------------------
# Every described transformers family, exact: random tiny configs, float64
# (<= 1e-12) and float32 (<= 1e-5), contexts of 1, 17 and 100 tokens,
# queries of 1 and 3, batch 2, both modes; padding, chunked feed-forwards,
# half precision, an accelerate disk offload, the self-check, and the
# silent wrong answers that are now errors. A CUDA test skips without a GPU.
import copy
import re
import tempfile

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from icl_book.core import rel_err  # noqa: E402
from icl_book.families import FAMILIES, TINY_ARCHS, adapter, tiny_model  # noqa: E402
from conftest import model_output as out, random_ids as ids, snapshot  # noqa: E402
from icl_book.hf import context_patches, patch_errors, patched  # noqa: E402
from icl_book.hf_checks import check_model  # noqa: E402
from icl_book.hf_apply import moe_routing  # noqa: E402

TOL = {"float64": 1e-12, "float32": 1e-5}


def test_every_family_has_a_tiny_model():
    assert {f.name for f in FAMILIES} == set(TINY_ARCHS)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_family_exact(arch, dtype):
    m = tiny_model(arch, dtype, seed=1, layers=2, d=16)
    worst, alone, layers = 0., 0., 0.
    for n in (1, 17, 100):
        for q in (1, 3):
            C, x = ids(2, n, n), ids(2, q, n + q)
            full = out(m, torch.cat([C, x], 1))[:, -1]
            for mode in ("rank1", "bias"):
                p = context_patches(m, C, x, mode)
                assert p.shape == (2, q) and p.family == arch
                layers = max(layers, max(p.errors))       # every layer
                with patched(m, p):
                    worst = max(worst, rel_err(out(m, x)[:, -1], full))
            pos = {} if p.positions is None else dict(position_ids=p.positions)
            alone = max(alone, rel_err(out(m, x, **pos)[:, -1], full))
    assert layers <= TOL[dtype], layers
    # Logits: transformers computes some final norms in float32 inside a
    # float64 model (OLMo 2's RMSNorm casts to float32 and back); when every
    # layer is exact to 1e-12, a float32 rounding flip there can still move
    # the logits by ~1e-8, which is measured against, not hidden.
    assert worst <= TOL[dtype] or (dtype == "float64" and worst <= 1e-7
                                   and layers <= 1e-12), (worst, layers)
    assert alone > 1e-3                 # the context does matter


@pytest.mark.parametrize("arch", ["gpt_neox", "gptj", "falcon", "phi",
                                  "cohere"])
def test_parallel_families_patch_only_the_last_matrix(arch):
    m = tiny_model(arch, "float64", layers=2, d=16)
    p = context_patches(m, ids(1, 7, 0), ids(1, 2, 1))
    # the MLP input is unchanged: the first-map factors are round-off only
    assert max(r.u.abs().max() for lay in p.layers for r in lay.dW) < 1e-15
    assert all(lay.dW_out.u.abs().max() > 1e-4 for lay in p.layers)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "roberta", "opt",
                                  "gpt_neox", "phi", "olmo2", "mixtral",
                                  "qwen2_moe"])
def test_padded_contexts_and_queries_are_exact(arch):
    "(Gemma 2's eager attention gives NaN rows for left padding, in the "
    "plain masked run itself, so it has no reference to match here.)"
    m = tiny_model(arch, "float64", seed=9, layers=2, d=16)
    C, x = ids(2, 12, 3, low=2), ids(2, 3, 4, low=2)
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[0, :5] = 0                    # left-padded context
    mask[1, 8:12] = 0                  # right-padded context
    mask[1, 14] = 0                    # right-padded query
    ref = out(m, torch.cat([C, x], 1), attention_mask=mask)[:, 12:]
    real = mask[:, 12:].bool()
    p = context_patches(m, C, x, attention_mask=mask)
    with patched(m, p):
        got = out(m, x)                 # the query mask is filled in
        assert rel_err(got[real], ref[real]) <= 1e-12
        with pytest.raises(ValueError, match="attention_mask differs"):
            out(m, x, attention_mask=torch.ones_like(x))
    p0 = context_patches(m, C, x)      # without the mask: padding is context
    with patched(m, p0):
        assert rel_err(out(m, x)[real], ref[real]) > 1e-3


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_chunked_feed_forward(arch):
    m = tiny_model(arch, "float64", seed=10, layers=2, d=16,
                   chunk_size_feed_forward=2)
    C, x = ids(2, 6, 0), ids(2, 4, 1)      # lengths: multiples of the chunk
    full = out(m, torch.cat([C, x], 1))[:, 6:]
    p = context_patches(m, C, x)
    with patched(m, p):
        assert rel_err(out(m, x), full) <= 1e-12


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma2", "bert"])
def test_half_precision(arch, dtype):
    m = tiny_model(arch, dtype, seed=1, layers=2, d=16)
    C, x = ids(2, 17, 0), ids(2, 3, 1)
    full = out(m, torch.cat([C, x], 1))[:, -1]
    p = context_patches(m, C, x)
    assert p.layers[0].dW[0].u.dtype == torch.float32
    with patched(m, p):
        got = out(m, x)[:, -1]
    assert got.dtype == getattr(torch, dtype)
    assert rel_err(got, full) < 10 * torch.finfo(getattr(torch, dtype)).eps


@pytest.mark.parametrize("arch,mode", [("olmo2", "rank1"),
                                       ("gpt_neox", "bias"), ("phi", "rank1"),
                                       ("opt", "bias"), ("distilbert", "rank1")])
def test_inplace_restores_bits_also_on_exceptions(arch, mode):
    m = tiny_model(arch, "float64", seed=3, layers=2, d=16)
    C, x = ids(1, 9, 0), ids(1, 1, 1)
    target = out(m, torch.cat([C, x], 1))[:, -1]
    before = snapshot(m)
    p = context_patches(m, C, x, mode)
    with patched(m, p, inplace=True):
        assert any(not torch.equal(v, before[k])
                   for k, v in m.state_dict().items())
        got = out(m, x)[:, -1]
    assert rel_err(got, target) <= 1e-10
    with pytest.raises(RuntimeError, match="boom"):
        with patched(m, p, inplace=True):
            raise RuntimeError("boom")
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_base_models_work_like_head_models():
    for arch in ("llama", "bert", "gpt_neox", "opt"):
        m = tiny_model(arch, "float64", layers=2, d=16, head=False)
        C, x = ids(2, 5, 0), ids(2, 2, 1)
        full = out(m, torch.cat([C, x], 1))[:, 5:]
        p = context_patches(m, C, x)
        with patched(m, p):
            assert rel_err(out(m, x), full) <= 1e-12


# ---------------------------------------------- silent wrong answers, closed
def test_submodule_in_training_mode_is_refused():
    m = tiny_model("gpt2", "float32", layers=2, d=16)
    m.transformer.h[1].mlp.dropout.train()
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.dropout"):
        context_patches(m, ids(1, 4, 0), ids(1, 1, 1))


def test_patch_knows_its_query_positions_and_model():
    m = tiny_model("llama", "float64", seed=6, layers=2, d=16)
    C, x = ids(2, 9, 0), ids(2, 3, 1)
    full = out(m, torch.cat([C, x], 1))[:, -1]
    p = context_patches(m, C, x)
    with patched(m, p):
        assert rel_err(out(m, x)[:, -1], full) <= 1e-12   # positions filled
        with pytest.raises(ValueError, match="query the patches were"):
            out(m, x.flip(1))                             # same shape
        with pytest.raises(ValueError, match="position_ids differs"):
            out(m, x, position_ids=torch.arange(3).expand(2, 3))
        with pytest.raises(ValueError, match="on input_ids, other arguments by keyword"):
            m(inputs_embeds=m.get_input_embeddings()(x))
    twin = tiny_model("llama", "float64", seed=7, layers=2, d=16)
    with pytest.raises(ValueError, match="another model object"):
        with patched(twin, p):
            pass


def test_self_check_refuses_a_block_that_differs_from_its_record():
    m = tiny_model("llama", "float64", seed=11, layers=2, d=16)
    for layer in m.model.layers:        # a "release" that halves the MLP
        layer.mlp.register_forward_hook(lambda mod, a, y: 0.5 * y)
    with pytest.raises(ValueError, match="self-check failed"):
        context_patches(m, ids(1, 6, 0), ids(1, 2, 1))
    p = context_patches(m, ids(1, 6, 0), ids(1, 2, 1), check=False)
    assert max(p.errors) > 1e-3


def test_undescribed_layouts_are_refused():
    with pytest.raises(TypeError, match="do_layer_norm_before"):
        adapter(tiny_model("opt", do_layer_norm_before=False))
    with pytest.raises(TypeError, match="decoder_sparse_step"):
        adapter(tiny_model("qwen2_moe", decoder_sparse_step=2))



@pytest.mark.parametrize("field", [dict(decoder_sparse_step=2),
                                   dict(mlp_only_layers=[0, 2])])
def test_moe_with_dense_layers_mixed_in_is_exact(field):
    "Refused before (its blocks differ); now one record per block."
    mixed = tiny_model("qwen2_moe", **field)            # dense + MoE
    ad = check_model(mixed)
    assert ad.family.pattern == "pre-norm + moe"
    assert [lay.moe is not None for lay in ad.layers] == [False, True, False]
    e = patch_errors(mixed, ids(1, 5, 0), ids(1, 2, 1))
    assert max(e["per_layer"]) <= 1e-12 and e["output"] <= 1e-12


def test_undescribed_phimoe_is_discovered_and_exact():
    "PhiMoE was refused as not described; its record is now discovered."
    import transformers
    cfg = transformers.PhimoeConfig(hidden_size=16, num_hidden_layers=2,
                                    intermediate_size=32,
                                    num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=97,
                                    num_local_experts=4)
    torch.manual_seed(0)
    m = transformers.PhimoeForCausalLM(cfg).double().eval()
    m.set_experts_implementation("eager")
    C, x = ids(1, 6, 0), ids(1, 2, 1)
    full = out(m, torch.cat([C, x], 1))[:, 6:]
    p = context_patches(m, C, x)
    assert p.family == "phimoe"
    with patched(m, p):
        assert rel_err(out(m, x), full) <= 1e-10


def test_mixtral_is_accepted():
    "Mixtral was refused before the mixtures of experts were described."
    import transformers
    cfg = transformers.MixtralConfig(hidden_size=16, num_hidden_layers=1,
                                     intermediate_size=32,
                                     num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=97,
                                     num_local_experts=4)
    torch.manual_seed(0)
    m = transformers.MixtralForCausalLM(cfg).eval()
    assert adapter(m).family.name == "mixtral"
    C, x = ids(1, 5, 0), ids(1, 2, 1)
    full = out(m, torch.cat([C, x], 1))[:, -1]
    with patched(m, context_patches(m, C, x)):
        assert rel_err(out(m, x)[:, -1], full) <= 1e-5


# ------------------------------------------------------ mixtures of experts
MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
MOE_TOL = {"float64": 1e-10, "float32": 1e-5}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch", MOE)
def test_moe_routes_like_the_context(arch, dtype):
    "Every layer and query position exact; the patched router selects the "
    "with-context experts, with a margin far above the logits' error."
    m = tiny_model(arch, dtype, seed=4, layers=2, d=16)
    for n, q in ((1, 1), (17, 3)):
        C, x = ids(2, n, 20 + n), ids(2, q, 30 + q)
        full = out(m, torch.cat([C, x], 1))[:, -1]
        for mode in ("rank1", "bias"):
            p = context_patches(m, C, x, mode)
            assert max(p.errors) <= MOE_TOL[dtype], p.errors
            with patched(m, p):
                assert rel_err(out(m, x)[:, -1], full) <= MOE_TOL[dtype]
            for r in moe_routing(m, C, x, p):
                assert r["same"], r
                assert r["margin"] > 1e3 * r["logit_abs"], r   # no tie
                assert r["logit_err"] <= 10 * MOE_TOL[dtype], r


@pytest.mark.parametrize("arch", MOE)
def test_moe_every_expert_and_the_router_are_patched(arch):
    m = tiny_model(arch, "float64", seed=5, layers=2, d=16)
    p = context_patches(m, ids(1, 9, 0), ids(1, 2, 1))
    E = m.config.num_local_experts if arch == "mixtral" else \
        m.config.num_experts
    for lay, ad_lay in zip(p.layers, adapter(m).layers):
        router, experts = lay.dW[0], lay.dW[1]
        assert router.u.shape[-1] == E
        u = experts.u.reshape(1, 2, *ad_lay.first[1].shape[:-1])
        assert (u.abs().amax((0, 1, 3)) > 1e-6).all()   # every expert
        assert lay.dW_out.v.shape[-1] == sum(
            P.shape[:-2].numel() * P.shape[-1] for P in ad_lay.last)


def test_moe_without_the_router_patch_is_wrong():
    "The test can fail: patching the experts alone misses the context."
    import dataclasses
    from icl_book.blocks import RankOne
    m = tiny_model("mixtral", "float64", seed=1, layers=2, d=16)
    C, x = ids(2, 17, 2), ids(2, 3, 3)
    full = out(m, torch.cat([C, x], 1))[:, -1]
    p = context_patches(m, C, x)
    layers = tuple(lay._replace(dW=(RankOne(0 * lay.dW[0].u, lay.dW[0].v),
                                    *lay.dW[1:])) for lay in p.layers)
    bad = dataclasses.replace(p, layers=layers)   # the router's factor: 0
    with patched(m, bad):
        assert rel_err(out(m, x)[:, -1], full) > 1e-3


@pytest.mark.parametrize("arch", MOE)
def test_moe_inplace_restores_bits_also_on_exceptions(arch):
    m = tiny_model(arch, "float64", seed=3, layers=2, d=16)
    C, x = ids(1, 9, 0), ids(1, 1, 1)
    target = out(m, torch.cat([C, x], 1))[:, -1]
    before = snapshot(m)
    p = context_patches(m, C, x, "rank1")
    with patched(m, p, inplace=True):
        changed = {k for k, v in m.state_dict().items()
                   if not torch.equal(v, before[k])}
        got = out(m, x)[:, -1]
    assert any("experts.gate_up_proj" in k for k in changed)
    assert any("experts.down_proj" in k for k in changed)
    assert any("gate.weight" in k for k in changed)
    assert rel_err(got, target) <= 1e-10
    with pytest.raises(RuntimeError, match="boom"):
        with patched(m, p, inplace=True):
            raise RuntimeError("boom")
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    with pytest.raises(ValueError, match="no bias"):
        with patched(m, context_patches(m, C, x, "bias"), inplace=True):
            pass
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_moe_generation_without_context_equals_generate():
    from icl_book.hf import generate_without_context
    m = tiny_model("qwen2_moe", "float32", seed=3, layers=2, d=16)
    C, x = ids(2, 11, 4, low=2), ids(2, 2, 5, low=2)
    ref = m.generate(torch.cat([C, x], 1), max_new_tokens=8, do_sample=False,
                     attention_mask=torch.ones(2, 13, dtype=torch.long))
    assert torch.equal(generate_without_context(m, C, x, 8), ref[:, 13:])


def test_moe_routing_needs_a_mixture_of_experts():
    m = tiny_model("llama", "float64", layers=2, d=16)
    C, x = ids(1, 4, 0), ids(1, 1, 1)
    with pytest.raises(TypeError, match="no mixture of experts"):
        moe_routing(m, C, x, context_patches(m, C, x))


# ------------------------------------------------------- devices, offload
def test_accelerate_disk_offload_is_exact():
    accelerate = pytest.importorskip("accelerate")
    src = tiny_model("llama", "float32", seed=12, layers=3, d=16)
    C, x = ids(2, 9, 0), ids(2, 3, 1)
    full = out(src, torch.cat([C, x], 1))[:, -1]
    dmap = {"model.embed_tokens": "cpu", "model.layers.0": "cpu",
            "model.layers.1": "disk", "model.layers.2": "cpu",
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        off = accelerate.dispatch_model(copy.deepcopy(src), device_map=dmap,
                                        offload_dir=tmp, main_device="cpu")
        assert off.model.layers[1].mlp.up_proj.weight.device.type == "meta"
        p = context_patches(off, C, x)
        with patched(off, p):
            assert rel_err(out(off, x)[:, -1], full) <= 1e-5
        p1 = context_patches(off, C[:1], x[:1, :1])
        with pytest.raises(ValueError, match="offloaded"):
            with patched(off, p1, inplace=True):
                pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_exact():
    m = tiny_model("llama", "float32", seed=13).cuda()
    C, x = ids(2, 17, 0).cuda(), ids(2, 3, 1).cuda()
    full = out(m, torch.cat([C, x], 1))[:, -1]
    p = context_patches(m, C, x)
    assert p.layers[0].dW[0].u.device.type == "cuda"
    with patched(m, p):
        assert rel_err(out(m, x)[:, -1], full) <= 1e-5


@pytest.mark.parametrize("mt,kind,why", [
    ("mamba", "causal", "MambaForCausalLM: block 0 \\(MambaBlock\\) has a "
     "mixer \\(mixer\\) followed by no MLP"),
    ("albert", "masked", "one layer \\(encoder.albert_layer_groups.0\\) runs "
     "at all 2 depths with the same weights"),
    ("xlm", "causal", "MultiHeadAttention\\) has a mixer"),
])
def test_discovery_refuses_with_the_structural_reason(mt, kind, why):
    from icl_book.experiments.discovery import zoo_model
    with pytest.raises(TypeError, match=why):
        context_patches(zoo_model(mt, kind), ids(1, 3, 0), ids(1, 1, 1))


def test_discovered_encoder_pooling_head_is_refused():
    "ModernBERT (pre-norm encoder, discovered) pools position 0 as BERT does."
    import transformers
    from icl_book.experiments.discovery import zoo_model
    cfg = zoo_model("modernbert", "masked").config
    torch.manual_seed(0)
    m = transformers.ModernBertForSequenceClassification(cfg).double().eval()
    C, x = ids(1, 6, 2), ids(1, 3, 3)
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match="reads position 0"):
        with patched(m, p):
            m(x)


@pytest.mark.parametrize("mt", ["gpt_oss", "llama4_text"])
def test_experts_stored_in_by_out_are_exact(mt):
    """gpt-oss (experts with biases) and Llama 4 (shared and routed experts,
    the routed ones reading the score-scaled input) store their experts as
    (E, in, out): refused by the self-check before (0.17, 0.027)."""
    from icl_book.experiments.discovery import zoo_model
    m = zoo_model(mt)
    ad = check_model(m)
    assert ad.family.transposed and ad.family.pattern == "moe"
    C, x = ids(1, 5, 0, low=2), ids(1, 1, 1, low=2)
    full = out(m, torch.cat([C, x], 1))[:, 5:]
    p = context_patches(m, C, x)
    assert max(p.errors) <= 1e-12
    before = snapshot(m)
    for inplace in (False, True):
        with patched(m, p, inplace=inplace):
            assert rel_err(out(m, x), full) <= 1e-10
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_readme_table_lists_every_described_family_under_its_pattern(root):
    "The README's table of described families is checked against FAMILIES."
    heads = {"pre-norm": "pre-norm", "post-LN": "post-LN",
             "parallel": "parallel", "norm after the MLP": "post-norm",
             "mixture of experts": "moe"}
    text = (root / "README.md").read_text()
    table = text.split("| structural pattern | families |")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        head, fams = line.strip("| ").split(" | ")[:2]
        key = next(v for k, v in heads.items() if head.startswith(k))
        rows.setdefault(key, set()).update(re.findall(r"`([\w-]+)`", fams))
    for f in FAMILIES:
        assert (f.model_type or f.name) in rows.get(f.pattern, ()), (
            f.name, f.pattern, rows)


@pytest.mark.parametrize("mt,join", [("cohere2_moe", "branch"),
                                     ("flex_olmo", "post")])
def test_moe_in_parallel_or_before_a_norm_is_exact(mt, join):
    """Cohere 2 MoE adds its experts beside the attention (x + A + M), FLEX
    OLMo normalises their output before the add: refused before ('an MLP
    whose output reaches the block's output in none of the ways')."""
    from icl_book.experiments.discovery import zoo_model
    m = zoo_model(mt)
    assert getattr(check_model(m).family, join)
    C, x = ids(1, 5, 0, low=2), ids(1, 1, 1, low=2)
    full = out(m, torch.cat([C, x], 1))[:, 5:]
    for mode in ("rank1", "bias"):
        e = patch_errors(m, C, x, mode)
        assert max(e["per_layer"]) <= 1e-12 and e["output"] <= 1e-10
    p = context_patches(m, C, x)
    with patched(m, p, inplace=True):
        assert rel_err(out(m, x), full) <= 1e-10


@pytest.mark.parametrize("mt,kind", [("minicpm3", "causal"),
                                     ("esmc", "masked")])
def test_a_residual_scale_the_block_computes_is_read_off(mt, kind):
    """MiniCPM3 scales its MLP output by scale_depth / sqrt(layers), ESM C
    divides it by a scaling factor: constants of no config field (refused
    before: 'an MLP added in none of the ways')."""
    from icl_book.experiments.discovery import zoo_model
    m = zoo_model(mt, kind)
    ad = check_model(m)
    assert isinstance(ad.family.scale, float) and ad.scale != 1
    e = patch_errors(m, ids(1, 5, 0, low=2), ids(1, 2, 1, low=2))
    assert max(e["per_layer"]) <= 1e-12 and e["output"] <= 1e-10
