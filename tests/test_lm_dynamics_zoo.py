"""The one pass of icl_book.lm_dynamics on model types found by discovery
(tests/test_zoo.py runs the whole zoo): hybrids with a recurrent mixer,
encoders, models without a cache, a model whose attention fails under a 4-D
mask, a MoE reading the stream through its router, a parallel MoE and a model
mixing pre-norm and post-norm blocks. Each is exact against the loop of
context_patches (float64, <= 1e-10, non-trivial) or refused with its reason,
never a crash inside transformers."""
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")

from icl_book.core import rel_err  # noqa: E402
from icl_book.discovery import find_adapter  # noqa: E402
from icl_book.experiments.discovery import ZOO_TINY, zoo_model  # noqa: E402
from icl_book.lm_dynamics import default_part, token_updates  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")


def ids():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randint(2, 97, (1, s), generator=g) for s in (5, 2))


# sizes the zoo's tiny configuration leaves at their defaults: Falcon-H1's
# Mamba mixer (1024 channels, a state of 256, 128 heads) and Qwen3-Next's 512
# experts (10 per token) and linear-attention heads of 128 cost a minute on
# one core
SMALLER = dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
               mamba_d_state=16, mamba_chunk_size=16, num_experts=8,
               linear_key_head_dim=8, linear_value_head_dim=8,
               num_experts_per_tok=2, shared_expert_intermediate_size=16)


@pytest.mark.parametrize("mt", ["jamba", "qwen3_next", "falcon_h1",
                                "olmo_hybrid", "recurrent_gemma"])
def test_a_recurrent_mixer_is_refused_and_the_loop_runs(mt, monkeypatch):
    for k, v in SMALLER.items():
        monkeypatch.setitem(ZOO_TINY, k, v)
    m = zoo_model(mt)
    C, x = ids()
    with pytest.raises(TypeError, match="recurrent state.*method='loop'"):
        token_updates(m, C, x)
    U = token_updates(m, C, x, method="loop")
    assert U.shape == (5, len(find_adapter(m).layers))
    assert torch.isfinite(U).all() and (U.amax(0) > 1e-6).all(), U


@pytest.mark.parametrize("mt,kind", [("esm", "masked"),
                                     ("modernbert", "masked"),
                                     ("megatron-bert", "causal"),
                                     ("roberta-prelayernorm", "causal")])
def test_an_encoder_is_refused_as_one(mt, kind):
    "Pre-norm encoders: refused for attending both ways, before any run."
    m = zoo_model(mt, kind)
    C, x = ids()
    with pytest.raises(TypeError, match="attends in both directions"):
        token_updates(m, C, x)


def test_a_causal_model_without_a_cache_is_refused_for_that():
    m = zoo_model("openai-gpt")                 # GPT-1: causal, post-LN
    C, x = ids()
    with pytest.raises(TypeError, match="no cache"):
        token_updates(m, C, x)


def test_a_model_whose_attention_fails_under_a_mask_is_refused():
    """MiniCPM3's attention expands its keys to every head and then SDPA
    repeats them by num_key_value_groups once a mask is given: transformers'
    own masked run fails (here a padded one); the one pass is refused."""
    m = zoo_model("minicpm3")
    C, x = ids()
    with pytest.raises(RuntimeError):
        m(C, attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="4-D attention mask.*method='loop'"):
        token_updates(m, C, x)
    assert torch.isfinite(token_updates(m, C, x, method="loop")).all()


@pytest.mark.parametrize("mt", ["flex_olmo", "cohere2_moe", "phimoe"])
def test_moe_variants_equal_the_loop_and_are_not_trivial(mt):
    """FlexOlmo's MoE reads the stream through its router (no norm before
    it); Cohere 2 MoE is parallel, its context in the experts' last maps;
    PhiMoE sums its tokens by expert, so an earlier token's output moves by
    round-off when a later one changes (it is causal all the same)."""
    m = zoo_model(mt)
    C, x = ids()
    U0 = token_updates(m, C, x, method="loop")
    U1 = token_updates(m, C, x)
    assert rel_err(U1, U0) < 1e-10 and (U0.amax(0) > 1e-6).all(), (U0, U1)


def test_blocks_of_two_patterns_measure_each_its_own_map():
    "OLMo hybrid: a pre-norm block, then one with a norm after its MLP."
    m = zoo_model("olmo_hybrid")
    ad = find_adapter(m)
    assert default_part(ad) == ("first", "post")
    C, x = ids()
    with pytest.raises(ValueError, match=r"block 0 .*part=None"):
        token_updates(m, C, x, method="loop", part="post")
    assert (token_updates(m, C, x, method="loop").amax(0) > 1e-6).all()


def test_float32_rounding_inside_a_float64_model_is_refused():
    """Laguna rounds its attention gates and router logits to float32 even in
    float64: a packed run and a plain one round them differently (by about
    1e-8 here), which the float64 comparison at the checked prefixes sees."""
    m = zoo_model("laguna")
    C, x = ids()
    with pytest.raises(ValueError, match="float32 even in float64"):
        token_updates(m, C, x)
    assert torch.isfinite(token_updates(m, C, x, method="loop")).all()
