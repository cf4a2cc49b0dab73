"""Every prefix's patches of a causal LM in one pass (icl_book.lm_dynamics),
against the loop of context_patches calls it replaces.

Random tiny models of three structural patterns always run: Llama (pre-norm,
sequential, RoPE), GPT-2 (learned absolute positions, Conv1D) and GPT-NeoX
with a parallel residual; float64 agreement to 1e-10 (relative, per layer
patch and per column of steps). SmolLM2 (float32, 1e-5) skips when its wheel
is absent. Below, every causal family the one pass describes (mixtures,
sliding windows, ALiBi, parallel and post-norm blocks) and model types found
by discovery (recurrent mixers, encoders, models without a cache): exact
against the loop, or refused with the reason.
"""
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from hypothesis import given, settings, strategies as st  # noqa: E402

from conftest import random_ids, snapshot  # noqa: E402
from icl_book.blocks import RankOne  # noqa: E402
from icl_book.core import rel_err  # noqa: E402
from icl_book.hf import context_patches, patched, tiny_model, token_updates  # noqa: E402
from icl_book.weights import missing  # noqa: E402
from icl_book.lm_dynamics import prefix_patches  # noqa: E402
from icl_book.experiments.lm_dynamics import (  # noqa: E402
    PROMPT_KINDS, bench_hf_trajectory, convergence_prompt)

PATTERNS = ("llama", "gpt2", "gpt_neox")
from _marks import needs_smollm2  # noqa: E402


def layer_err(P, i, Q, l):
    "Relative Frobenius error of row i of P's layer-l patch against Q's."
    def parts(lp):
        return [*lp.dW] + ([lp.dW_out] if lp.dW_out is not None else [])
    num = den = 0.
    for a, b in zip(parts(P.layers[l]), parts(Q.layers[l])):
        ra, rb = RankOne(a.u[i], a.v[i]), RankOne(b.u[0], b.v[0])
        num += (ra.diff_norm(rb) ** 2).sum()
        den += (rb.norm() ** 2).sum()
    if den < 1e-24:       # no update at all (e.g. c_1 = x, same values):
        return num.sqrt().item()              # compare absolutely
    return (num / den).sqrt().item()


@pytest.mark.parametrize("arch", PATTERNS)
@pytest.mark.parametrize("q", [1, 3])
def test_prefix_patches_equal_the_loop_float64(arch, q):
    m = tiny_model(arch, "float64", seed=4)
    C, x = random_ids(1, 9, 1, low=2), random_ids(1, q, 2, low=2)
    before = snapshot(m)
    P = prefix_patches(m, C, x, chunk=4)                 # chunks 4, 4, 1
    assert P.shape == (9, q)
    for i in range(1, 10):
        Q = context_patches(m, C[:, :i], x)
        for l in range(len(P)):
            assert layer_err(P, i - 1, Q, l) < 1e-10, (arch, i, l)
    after = m.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


@pytest.mark.parametrize("arch", PATTERNS)
def test_token_updates_equal_the_loop_float64(arch):
    m = tiny_model(arch, "float64", seed=5, layers=2)
    C, x = random_ids(1, 13, 3, low=2), random_ids(1, 2, 4, low=2)
    U0 = token_updates(m, C, x, part="first", method='loop')
    for chunk in (None, 1, 5):
        U1 = token_updates(m, C, x, chunk=chunk, part="first")
        assert U1.shape == U0.shape == (13, 2) and U1.dtype == torch.float64
        for l in range(2):
            if U0[:, l].norm() > 1e-12:
                assert rel_err(U1[:, l], U0[:, l]) < 1e-10, (arch, chunk, l)
            else:                   # parallel block: no first-matrix update
                assert arch == "gpt_neox" and U1[:, l].max() < 1e-12
    assert torch.equal(token_updates(m, C, x, method="loop", part="first"),
                       U0)
    if arch != "gpt_neox":          # the default measure: first matrices
        assert torch.equal(token_updates(m, C, x, method="loop"), U0)
        assert torch.equal(token_updates(m, C, x),
                           token_updates(m, C, x, part="first"))
    else:                           # the loop gives the default measure too
        assert rel_err(token_updates(m, C, x, method="loop"),
                       token_updates(m, C, x)) < 1e-10


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 12), q=st.integers(1, 3), chunk=st.integers(1, 13),
       seed=st.integers(0, 10 ** 6))
def test_prefix_patches_property_llama(n, q, chunk, seed):
    m = tiny_model("llama", "float64", seed=7, layers=2, d=16)
    C, x = random_ids(1, n, seed, low=2), random_ids(1, q, seed + 1, low=2)
    P = prefix_patches(m, C, x, chunk=chunk)
    for i in {1, n, (n + 1) // 2}:
        Q = context_patches(m, C[:, :i], x)
        assert max(layer_err(P, i - 1, Q, l) for l in range(2)) < 1e-10


def test_patched_rows_give_each_prefix_with_context():
    m = tiny_model("gpt2", "float64", seed=8)
    C, x = random_ids(1, 7, 9, low=2), random_ids(1, 2, 10, low=2)
    P = prefix_patches(m, C, x)
    with torch.no_grad():
        ref = torch.cat([m(torch.cat([C[:, :i], x], 1)).logits[:, -2:]
                         for i in range(1, 8)])
        with patched(m, P):
            out = m(x.expand(7, 2)).logits
    assert rel_err(out, ref) < 1e-10


def test_bad_inputs_are_refused():
    m = tiny_model("llama", "float64")
    C, x = random_ids(1, 6, 0, low=2), random_ids(1, 2, 1, low=2)
    cases = [
        (lambda: prefix_patches(m, C.expand(2, 6), x.expand(2, 2)),
         "one sequence"),
        (lambda: prefix_patches(m, C[:, :0], x), "empty"),
        (lambda: prefix_patches(m, C, x[:, :0]), "empty"),
        (lambda: prefix_patches(m, C + 97, x), "vocabulary"),
        (lambda: prefix_patches(m, C.float(), x), "integer token ids"),
        (lambda: prefix_patches(m, C, x, chunk=0), "chunk"),
        (lambda: prefix_patches(m, C, x, mode="dense"), "mode"),
        (lambda: prefix_patches(tiny_model("bert"), C, x), "both directions"),
        (lambda: prefix_patches(tiny_model("gpt_neo"),
                                random_ids(1, 12, 0, low=2), x),
         "local layers"),
        (lambda: prefix_patches(tiny_model("bloom"), C, x), "position_ids"),
        (lambda: prefix_patches(m, C, x, check=True), "check must be"),
        (lambda: prefix_patches(m, C, x, check=-1), "check must be"),
        (lambda: token_updates(m, C, x, part="post"), "part='first'"),
        (lambda: token_updates(m, C.expand(3, 6), x), "one sequence"),
        (lambda: token_updates(m, C, x, method="fast"), "method"),
        (lambda: bench_hf_trajectory(n=0, model=m), "positive integer"),
        (lambda: bench_hf_trajectory(n=4, loop_prefixes=1, model=m), ">= 2"),
    ]
    for f, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            f()
    m.train()
    with pytest.raises(ValueError, match="eval"):
        prefix_patches(m, C, x)


def test_weights_unchanged_after_an_error():
    m = tiny_model("llama", "float64", seed=3)
    before = snapshot(m)
    C, x = random_ids(1, 6, 0, low=2), random_ids(1, 1, 1, low=2)
    with pytest.raises(ValueError):
        prefix_patches(m, C, x, chunk=-1)
    P = prefix_patches(m, C, x)
    assert len(P) == 3
    after = m.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks)
               for mod in m.modules()) == 0


@needs_smollm2
def test_smollm2_one_pass_equals_loop_float32(smollm2):
    model, tok = smollm2
    ids = random_ids(1, 11, 11, vocab=model.config.vocab_size)
    before = {k: v.clone() for k, v in list(model.state_dict().items())[:6]}
    U1 = token_updates(model, ids[:, :10], ids[:, 10:], chunk=4)   # 4 + 4 + 2
    U0 = token_updates(model, ids[:, :10], ids[:, 10:], method='loop')
    L = model.config.num_hidden_layers
    assert U0.shape == (10, L)
    assert max(rel_err(U1[:, l], U0[:, l]) for l in range(L)) < 1e-5
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


@needs_smollm2
def test_smollm2_prompts(smollm2):
    model, tok = smollm2
    for kind in ("few-shot", "repeated", "random"):
        assert convergence_prompt(tok, kind, 40, 1).shape == (1, 41)
    with pytest.raises(ValueError, match="prose"):
        convergence_prompt(tok, "prose", 40)
    with pytest.raises(ValueError, match="fewer"):
        convergence_prompt(tok, "prose", 400, prose="Too short.")
    assert PROMPT_KINDS[0] == "prose"


@needs_smollm2
def test_bench_hf_trajectory_small(smollm2):
    model, _ = smollm2
    r = bench_hf_trajectory(n=16, loop_prefixes=3, model=model)
    assert r["max_rel_diff"] < 1e-5 and r["check_max_err"] < 1e-3
    assert r["open_vs_closed"] < 1e-5 and r["check_prefixes"] == 10
    assert {"speedup", "forward_ratio", "forward_ratio_closed", "speedup_cpu",
            "forward_ratio_cpu", "load_before", "load_after"} <= set(r)
    assert r["loop_timed_calls"] == 5          # prefixes 1, 8, 16: 1 + 2 + 2


@needs_smollm2
def test_cli_bench_hf_trajectory_prints_one_json_line(smollm2, capsys, monkeypatch):
    """`icl-book bench hf-trajectory` in this process (SmolLM2 loaded once):
    the command passes its flags to bench_hf_trajectory and prints its result
    as the last line; the benchmark times the loop on 2 prefixes here (its
    numbers are checked by test_bench_hf_trajectory_small)."""
    import json
    import icl_book.experiments.lm_dynamics as xlm
    from icl_book.__main__ import main as cli_main
    from icl_book.weights import load_pretrained
    assert load_pretrained("smollm2")[0] is smollm2[0]      # no second load
    real, seen = xlm.bench_hf_trajectory, []
    def bench(**kw):
        seen.append(kw)
        return real(**kw, loop_prefixes=2)
    monkeypatch.setattr(xlm, "bench_hf_trajectory", bench)
    got = cli_main(["bench", "hf-trajectory", "--n", "8", "--repeats", "1"])
    assert seen == [dict(n=8, seed=0, repeats=1)], seen
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res == json.loads(json.dumps(got))              # its result, printed
    assert res["n"] == 8 and res["max_rel_diff"] < 1e-5
    assert res["model"] == "SmolLM2-135M-Instruct"
    assert {"speedup", "forward_ratio"} <= set(res)


def test_token_steps_follow_a_weight_written_in_place():
    "The kept factor of WᵀW is rebuilt when a first map's weight changes."
    m = tiny_model("llama", "float64", seed=3)
    C, x = random_ids(1, 8, 0, low=2), random_ids(1, 1, 1, low=2)
    before = token_updates(m, C, x)                 # keeps the factors
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    after = token_updates(m, C, x)
    assert rel_err(after, token_updates(m, C, x, method='loop')) < 1e-10
    assert rel_err(after[:, 0], before[:, 0]) > 1e-3  # the step moved


def _drop(key):
    "A pre-hook on the base model dropping keyword `key` of packed calls."
    def hook(mod, args, kw):
        if kw.get("input_ids") is not None and kw.get(
                "position_ids") is not None and kw.get("attention_mask") \
                is not None:
            return args, {k: v for k, v in kw.items() if k != key}
        return None
    return hook


@pytest.mark.parametrize("key", ["attention_mask", "position_ids"])
def test_a_model_ignoring_the_mask_or_positions_is_refused(key):
    """The first chunk's probe copy (c_2..c_{q+1} after c_1, against the
    plain run of the context) catches it; a first chunk of at most q
    prefixes has no probe and is checked by a plain run of [c_1, x]."""
    m = tiny_model("llama", "float64", seed=4)
    C, x = random_ids(1, 9, 5, low=2), random_ids(1, 2, 6, low=2)
    U = token_updates(m, C, x)
    handle = m.model.register_forward_pre_hook(_drop(key), with_kwargs=True)
    try:
        for kw in (dict(check=0), dict(check="all"), dict(chunk=3),
                   dict(chunk=2), dict(chunk=2, check="all")):
            with pytest.raises(ValueError, match="plain run of the first"):
                token_updates(m, C, x, **kw)
        with pytest.raises(ValueError, match="plain run of the first"):
            prefix_patches(m, C, x)
        # one copy per chunk sees the whole cache, at the cache's length:
        # neither the mask nor the positions matter, and none is refused
        assert rel_err(token_updates(m, C, x, chunk=1), U) < 1e-10
    finally:
        handle.remove()
    assert torch.equal(token_updates(m, C, x), U)


def test_the_sampled_check_compares_the_open_loop_with_the_closed_loop():
    """A change of a block's input in the query-alone runs, which the open
    loop overwrites with the with-context input but the closed loop absorbs
    into its patches, is refused by the sampled check (the inputs differ);
    the closed loop on every prefix, which never feeds, accepts it."""
    m = tiny_model("llama", "float64", seed=4)
    C, x = random_ids(1, 9, 5, low=2), random_ids(1, 1, 6, low=2)

    def nudge(mod, a, kw):             # only in batched runs of the copies
        h = a[0] if a else kw["hidden_states"]
        if h.shape[0] == 1:
            return None
        if a:
            return (h + 1e-3, *a[1:]), kw
        return a, {**kw, "hidden_states": h + 1e-3}

    handle = m.model.layers[1].register_forward_pre_hook(nudge,
                                                          with_kwargs=True)
    try:
        for check in (0, 8):
            with pytest.raises(ValueError, match="self-check failed"):
                token_updates(m, C, x, check=check)          # fast path
            with pytest.raises(ValueError, match="self-check failed"):
                prefix_patches(m, C, x, check=check)
        U, errs = token_updates(m, C, x, check="all", return_errors=True)
        assert max(errs) < 1e-10
    finally:
        handle.remove()


# ----------------------------------------------------------------------------
# The one pass of icl_book.lm_dynamics on every causal family it describes:
# mixtures of experts, sliding windows shorter than the prompt, Falcon's ALiBi,
# parallel blocks and norms after the MLP, each against the loop of
# context_patches calls it replaces (float64, relative error <= 1e-10), with a
# non-trivial measure (token steps well above round-off) for every family.
#
# Eager attention in transformers runs its softmax in float32 even for float64
# models, which caps any float64 comparison near 1e-7; the families whose only
# attention is eager (Gemma 2) are run here with a float64 eager attention
# registered under its own name, so that both sides compute in float64.
#
# Falcon's ALiBi models had an eager path of their own, with the softmax in the
# model's dtype, up to transformers 5.24; from 5.25 on they take the shared eager
# attention (the ALiBi bias inside the attention mask) and round like Gemma 2.
# The case "falcon-alibi-eager" therefore runs transformers' own eager attention
# where it computes in float64 (< 5.25) and the float64 eager registered here
# where it does not (>= 5.25); and a test of its own shows what transformers'
# eager attention gives in each: exact below 5.25, refused by the one pass from
# 5.25 on (the library cannot make a model that rounds to float32 exact in a
# packed run), with the loop of context_patches still available.
from importlib.metadata import version

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from conftest import (dense_steps, patch_err, random_ids,  # noqa: E402
                      register_eager64, snapshot)
from icl_book.blocks import RankOne  # noqa: E402
from icl_book.core import rel_err  # noqa: E402
from icl_book.families import adapter, tiny_model  # noqa: E402
from icl_book.hf import context_patches, token_updates  # noqa: E402
from icl_book.lm_dynamics import default_part, prefix_patches  # noqa: E402

# transformers >= 5.25: Falcon's eager attention is the shared one (float32 softmax)
SHARED_EAGER = tuple(int(p) for p in version("transformers").split(".")[:2]) >= (5, 25)


register_eager64()
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


# ----------------------------------------------------------------------------
# The one pass of icl_book.lm_dynamics on model types found by discovery
# (tests/test_zoo.py runs the
# whole zoo): hybrids with a recurrent mixer,
# encoders, models without a cache, a model whose attention fails under a 4-D
# mask, a MoE reading the stream through its router, a parallel MoE and a model
# mixing pre-norm and post-norm blocks. Each is exact against the loop of
# context_patches (float64, <= 1e-10, non-trivial) or refused with its reason,
# never a crash inside transformers.
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")

from icl_book.core import rel_err  # noqa: E402
from icl_book.discovery import find_adapter  # noqa: E402
from icl_book.experiments.discovery import ZOO_TINY, zoo_model  # noqa: E402
from icl_book.lm_dynamics import default_part, token_updates  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")


def zoo_ids():
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
    C, x = zoo_ids()
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
    C, x = zoo_ids()
    with pytest.raises(TypeError, match="attends in both directions"):
        token_updates(m, C, x)


def test_a_causal_model_without_a_cache_is_refused_for_that():
    m = zoo_model("openai-gpt")                 # GPT-1: causal, post-LN
    C, x = zoo_ids()
    with pytest.raises(TypeError, match="no cache"):
        token_updates(m, C, x)


def test_a_model_whose_attention_fails_under_a_mask_is_refused():
    """MiniCPM3's attention expands its keys to every head and then SDPA
    repeats them by num_key_value_groups once a mask is given: transformers'
    own masked run fails (here a padded one); the one pass is refused."""
    m = zoo_model("minicpm3")
    C, x = zoo_ids()
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
    C, x = zoo_ids()
    U0 = token_updates(m, C, x, method="loop")
    U1 = token_updates(m, C, x)
    assert rel_err(U1, U0) < 1e-10 and (U0.amax(0) > 1e-6).all(), (U0, U1)


def test_blocks_of_two_patterns_measure_each_its_own_map():
    "OLMo hybrid: a pre-norm block, then one with a norm after its MLP."
    m = zoo_model("olmo_hybrid")
    ad = find_adapter(m)
    assert default_part(ad) == ("first", "post")
    C, x = zoo_ids()
    with pytest.raises(ValueError, match=r"block 0 .*part=None"):
        token_updates(m, C, x, method="loop", part="post")
    assert (token_updates(m, C, x, method="loop").amax(0) > 1e-6).all()


def test_float32_rounding_inside_a_float64_model_is_refused():
    """Laguna rounds its attention gates and router logits to float32 even in
    float64: a packed run and a plain one round them differently (by about
    1e-8 here), which the float64 comparison at the checked prefixes sees."""
    m = zoo_model("laguna")
    C, x = zoo_ids()
    with pytest.raises(ValueError, match="float32 even in float64"):
        token_updates(m, C, x)
    assert torch.isfinite(token_updates(m, C, x, method="loop")).all()
