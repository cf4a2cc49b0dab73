"""The one pass of icl_book.lm_dynamics on every causal family it describes:
mixtures of experts, sliding windows shorter than the prompt, Falcon's ALiBi,
parallel blocks and norms after the MLP, each against the loop of
context_patches calls it replaces (float64, relative error <= 1e-10), with a
non-trivial measure (token steps well above round-off) for every family.

Eager attention in transformers runs its softmax in float32 even for float64
models, which caps any float64 comparison near 1e-7; the families whose only
attention is eager (Gemma 2) are run here with a float64 eager attention
registered under its own name, so that both sides compute in float64.

Falcon's ALiBi models had an eager path of their own, with the softmax in the
model's dtype, up to transformers 5.24; from 5.25 on they take the shared eager
attention (the ALiBi bias inside the attention mask) and round like Gemma 2.
The case "falcon-alibi-eager" therefore runs transformers' own eager attention
where it computes in float64 (< 5.25) and the float64 eager registered here
where it does not (>= 5.25); and a test of its own shows what transformers'
eager attention gives in each: exact below 5.25, refused by the one pass from
5.25 on (the library cannot make a model that rounds to float32 exact in a
packed run), with the loop of context_patches still available.
"""
from importlib.metadata import version

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from conftest import dense_steps, random_ids, snapshot  # noqa: E402
from icl_book.blocks import RankOne  # noqa: E402
from icl_book.core import rel_err  # noqa: E402
from icl_book.families import adapter, tiny_model  # noqa: E402
from icl_book.hf import context_patches, token_updates  # noqa: E402
from icl_book.lm_dynamics import default_part, prefix_patches  # noqa: E402

# transformers >= 5.25: Falcon's eager attention is the shared one (float32 softmax)
SHARED_EAGER = tuple(int(p) for p in version("transformers").split(".")[:2]) >= (5, 25)


def eager64(module, query, key, value, attention_mask, dropout=0.0,
            scaling=None, softcap=None, **kw):
    "Eager attention with its softmax in the inputs' dtype."
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    s = query @ k.transpose(2, 3) * (module.head_dim ** -0.5
                                     if scaling is None else scaling)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is not None:
        s = s + attention_mask
    w = s.softmax(-1)
    return (w @ v).transpose(1, 2).contiguous(), w


def _register():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    AttentionInterface.register("eager64", eager64)
    AttentionMaskInterface.register("eager64", eager_mask)


_register()
WIN = dict(sliding_window=4, use_sliding_window=True)
CASES = {                       # name: (arch, config), prompt 10 + 2 tokens
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mistral-window": ("mistral", WIN),
    "qwen2-window": ("qwen2", dict(WIN, max_window_layers=0)),
    "gemma2-window": ("gemma2", dict(sliding_window=4,
                                     attn_implementation="eager64")),
    "gemma3-window": ("gemma3_text", dict(sliding_window=4)),
    "falcon-alibi": ("falcon", dict(alibi=True)),
    "falcon-alibi-eager": ("falcon", dict(alibi=True, attn_implementation=(
        "eager64" if SHARED_EAGER else "eager"))),
    "gpt_neox": ("gpt_neox", {}), "gptj": ("gptj", {}),
    "falcon": ("falcon", {}), "phi": ("phi", {}), "cohere": ("cohere", {}),
    "olmo2": ("olmo2", {}),
}


def loop_steps(m, C, x, part):
    "(n, L) steps from one context_patches per prefix, dense matrices."
    return dense_steps(adapter(m), [context_patches(m, C[:, :i], x)
                                    for i in range(1, C.shape[1] + 1)], part)


def patch_err(P, i, Q, l):
    "Relative error of row i of P's layer-l patch (all parts) against Q's."
    a, b = P.layers[l], Q.layers[l]
    num = den = 0.
    pairs = list(zip(a.dW, b.dW)) + ([(a.dW_out, b.dW_out)]
                                     if b.dW_out is not None else [])
    for x, y in pairs:
        ra, rb = RankOne(x.u[i], x.v[i]), RankOne(y.u[0], y.v[0])
        num += (ra.diff_norm(rb) ** 2).sum()
        den += (rb.norm() ** 2).sum()
    if b.ds_post is not None:
        num += ((a.ds_post[i] - b.ds_post[0]) ** 2).sum()
        den += (b.ds_post[0] ** 2).sum()
    return (num / den).sqrt().item()


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    arch, cfg = CASES[request.param]
    m = tiny_model(arch, "float64", seed=1, **cfg)
    return request.param, m, random_ids(1, 10, 0, low=2), \
        random_ids(1, 2, 1, low=2)


def test_prefix_patches_equal_the_loop(case):
    name, m, C, x = case
    before = snapshot(m)
    P = prefix_patches(m, C, x, chunk=4)             # chunks 4, 4, 2
    for i in range(1, 11):
        Q = context_patches(m, C[:, :i], x)
        for l in range(len(P)):
            assert patch_err(P, i - 1, Q, l) < 1e-10, (name, i, l)
    assert max(P.errors) < 1e-10                     # the sampled check
    after = m.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_token_steps_equal_the_loop_and_are_not_trivial(case):
    name, m, C, x = case
    part = default_part(adapter(m))
    U0 = loop_steps(m, C, x, part)
    for chunk in (None, 3):
        U1, errs = token_updates(m, C, x, chunk=chunk, return_errors=True)
        assert U1.shape == U0.shape == (10, 3)
        assert rel_err(U1, U0) < 1e-10, (name, chunk)
        assert max(errs) < 1e-10
    assert (U0.amin(0) > 1e-6).all(), (name, U0.amin(0))   # every layer


def test_every_check_gives_the_same_steps(case):
    name, m, C, x = case
    U = token_updates(m, C, x)
    for check in ("all", 0, 3):
        assert rel_err(token_updates(m, C, x, check=check, seed=2), U) \
            < 1e-12, (name, check)


def test_falcon_alibi_under_transformers_eager_attention():
    """transformers' own eager attention on an ALiBi Falcon: exact while it
    computes the softmax in the model's dtype (< 5.25); from 5.25 on its
    softmax is float32, the packed run rounds differently from a plain one,
    and the one pass refuses, naming the loop; the loop's patches stay exact."""
    m = tiny_model("falcon", "float64", seed=1, alibi=True,
                   attn_implementation="eager")
    C, x = random_ids(1, 10, 0, low=2), random_ids(1, 2, 1, low=2)
    if not SHARED_EAGER:
        assert rel_err(token_updates(m, C, x),
                       loop_steps(m, C, x, default_part(adapter(m)))) < 1e-10
        return
    with pytest.raises(ValueError, match=r"rounds some values to float32.*"
                       r"method='loop'"):
        token_updates(m, C, x)
    assert max(context_patches(m, C, x).errors) < 1e-9    # its self-check


def test_parallel_and_post_norm_measure_what_carries_the_context():
    C, x = random_ids(1, 8, 2, low=2), random_ids(1, 1, 3, low=2)
    m = tiny_model("gpt_neox", "float64", seed=2)
    assert default_part(adapter(m)) == "last"
    first = token_updates(m, C, x, part="first")
    assert first.max() < 1e-12             # the MLP reads the block's input
    assert token_updates(m, C, x).min() > 1e-6
    g = tiny_model("olmo2", "float64", seed=2)
    assert default_part(adapter(g)) == "post"
    assert token_updates(g, C, x, part="first").min() > 1e-6
    with pytest.raises(ValueError, match="part='post'"):
        token_updates(g, C, x, part="last")
    with pytest.raises(ValueError, match="part must be"):
        token_updates(m, C, x, part="middle")


def test_the_sampled_check_refuses_a_stream_the_open_loop_misses():
    "Something between blocks that the open loop does not see is refused."
    m = tiny_model("llama", "float64", seed=4)
    C, x = random_ids(1, 9, 5, low=2), random_ids(1, 1, 6, low=2)
    U = token_updates(m, C, x)

    def nudge(mod, a, o):             # only in batched runs of the copies
        h = o[0] if isinstance(o, tuple) else o
        if h.shape[0] == 1:
            return None
        h = h + 1e-3
        return (h, *o[1:]) if isinstance(o, tuple) else h

    handle = m.model.layers[0].register_forward_hook(nudge)
    try:
        for check in (0, 8, "all"):
            with pytest.raises(ValueError, match="self-check failed"):
                token_updates(m, C, x, check=check)
    finally:
        handle.remove()
    assert torch.equal(token_updates(m, C, x), U)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "opt", "gpt_neo",
                                  "starcoder2", "stablelm", "gpt2"])
def test_one_token_query_skips_the_score_maps_and_equals_the_loop(arch):
    """A one-token query alone attends to itself with weight 1: the query
    and key maps give zeros in the open loop of the copies alone (a batch of
    n rows of one token) where they are separate maps, and the steps still
    equal the loop's. (Parallel blocks' first maps read the block's input:
    no attention before them.)"""
    m = tiny_model(arch, "float64", seed=3)
    C, x = random_ids(1, 6, 2, low=2), random_ids(1, 1, 3, low=2)
    seen = []                                  # (batch, q_proj output max)
    for name, mod in m.named_modules():
        if name.endswith((".q_proj", ".k_proj")):
            mod.register_forward_hook(lambda md, a, o: seen.append(
                (o.shape[0], o.abs().max().item())))
    U0 = loop_steps(m, C, x, "first")        # (GPT-Neo's window: 8 tokens)
    seen.clear()
    U1, errs = token_updates(m, C, x, part="first", check=0,
                              return_errors=True)    # checks 2 prefixes
    assert rel_err(U1, U0) < 1e-10 and U0.min() > 1e-6, arch
    assert max(errs) < 1e-10
    skipped = [b for b, mx in seen if mx == 0.]   # the copies alone only
    assert bool(skipped) == (arch != "gpt2"), arch    # GPT-2: fused c_attn
    assert sum(skipped) == 2 * 6 * len(adapter(m).layers) * (arch != "gpt2")
