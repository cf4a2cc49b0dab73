"""icl_book.hf_patch: mixtures whose router computes in float32 even in a
float64 model (GLM-4-MoE, DeepSeek-V3, EXAONE-MoE, ...) are exact: the router
keeps its weight and reads the patched input a + ΔA in a batch of the
with-context run's shape, so its float32 logits are that run's bit for bit."""
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
