"""The in-context vector anchor of bench/anchors.py (Liu et al. 2023, ICV),
checked against its definitions in float64 on a tiny random Llama with a
character-level stand-in tokenizer: the first principal direction, the
query-alone state read from the joint run, and the steering hook's shift
and renormalisation."""
import importlib.util
from pathlib import Path

import pytest
import torch

from icl_book import compress as C
from icl_book import task_suite as T
from icl_book.families import tiny_model

_spec = importlib.util.spec_from_file_location(
    "anchors", Path(__file__).resolve().parents[1] / "bench" / "anchors.py")
A = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(A)


class CharTok:
    "One token per character (ids 2..96); 0 is the start token."
    bos_token_id, eos_token_id = 0, 1

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [2 + ord(c) % 95 for c in text]})


WORDS = "cat dog emu fox gnu hen yak owl bat eel ant bee".split()
PAIRS = [(w, w[::-1]) for w in WORDS]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", layers=3)


@pytest.fixture(scope="module")
def icv(tiny):
    ids, ql, al = A.pair_batch(CharTok(), PAIRS, T.TEMPLATE, 0)
    dH = A.icv_differences(tiny, ids, ql, al)
    return (ids, ql, al, dH) + A.icv_direction(dH)


def test_differences_are_target_minus_original_at_every_layer(tiny, icv):
    ids, ql, al, dH, v, s = icv
    L, d = 3, 32
    assert dH.shape == (len(PAIRS), L * d)
    with torch.no_grad():
        hs = tiny(ids[2:3, :al[2] + 1], output_hidden_states=True
                  ).hidden_states          # the last one is after the norm
    for l in range(L - 1):                 # layers whose output is bare
        want = (hs[l + 1][0, al[2]] - hs[l + 1][0, ql[2]]).double()
        assert (dH[2, l * d:(l + 1) * d] - want).abs().max() < 1e-12


@pytest.mark.parametrize("centred", [True, False])
def test_icv_is_the_first_principal_direction_along_the_mean(icv, centred):
    dH = icv[3]
    v, s = A.icv_direction(dH, centred)
    Dc = dH - dH.mean(0) if centred else dH
    C_ = Dc.T @ Dc                          # the covariance, unnormalised
    lam1 = torch.linalg.eigvalsh(C_)[-1]
    assert abs(float(v @ C_ @ v) - float(lam1)) < 1e-9 * float(lam1)
    assert abs(float(v.norm()) - 1) < 1e-12
    assert s == pytest.approx(float(v @ dH.mean(0))) and s >= 0


def test_check_icv_passes_and_steering_changes_what_it_should(tiny, icv):
    ids, ql, al, dH, v, s = icv
    chk = A.check_icv(tiny, ids, ql, al, dH, v, 2 * s, 1e-10)
    assert max(chk.values()) < 1e-10
    u, t = A.icv_direction(dH, False)
    assert max(A.check_icv(tiny, ids, ql, al, dH, u, t, 1e-10, False
                           ).values()) < 1e-10
    with pytest.raises(AssertionError, match="first principal direction"):
        A.check_icv(tiny, ids, ql, al, dH, u, t, 1e-10, True)
    x = ids[:4]
    seen = {}
    hk = tiny.model.layers[1].register_forward_pre_hook(
        lambda m, a: seen.__setitem__("h", a[0].clone()))
    try:
        lp0 = A.icv_logprobs(tiny, 0, x[:, 1:], v, 0.)
        lp = A.icv_logprobs(tiny, 0, x[:, 1:], v, 2 * s)
    finally:
        hk.remove()
    with torch.no_grad():
        plain = tiny(x, attention_mask=torch.ones_like(x)).logits[:, 1:]
        h0 = tiny.model.layers[0](tiny.model.embed_tokens(x),
                                  position_embeddings=tiny.model.rotary_emb(
            tiny.model.embed_tokens(x), torch.arange(x.shape[1])[None]))
    h0 = h0[0] if isinstance(h0, tuple) else h0
    assert (lp0 - plain.log_softmax(-1)).abs().max() < 1e-12   # lam 0: none
    g = h0 + 2 * s * v[:32]
    g = g * h0.norm(dim=-1, keepdim=True) / g.norm(dim=-1, keepdim=True)
    assert (seen["h"] - g).abs().max() < 1e-10    # what layer 1 reads
    assert (lp - lp0).abs().max() > 1e-3


def test_lam_is_chosen_on_validation_from_the_grid(tiny, icv):
    *_, v, s = icv
    cfg = C.CompressConfig(shots=2, n_cal=4, n_val=3, n_test=3, seed=0)
    td = T.encode_task(CharTok(), [dict(input=x, output=y) for x, y in PAIRS],
                       cfg)
    ids, rows, _ = A.first_tokens(td.val)
    from icl_book.lm_thought import icl_logprobs
    ref1 = icl_logprobs(tiny, td.prompt, ids)[rows, td.val.last]
    lam, val = A.pick_lam(tiny, td, ref1, v, s)
    assert any(abs(lam - k * s) < 1e-12 for k in A.GRID)
    assert set(val) == {str(k) for k in A.GRID}
    assert val[str(lam / s)] == max(val.values())


def test_prompt_differences_are_with_prompt_minus_alone(tiny):
    cfg = C.CompressConfig(shots=2, n_cal=4, n_val=3, n_test=3, seed=0)
    td = T.encode_task(CharTok(), [dict(input=x, output=y) for x, y in PAIRS],
                       cfg)
    ids, ql, _ = A.pair_batch(CharTok(), td.cal.items, T.TEMPLATE, 0)
    dH = A.prompt_differences(tiny, td, ids, ql)
    i, n = 1, td.prompt.shape[1]
    x = torch.cat([td.prompt, ids[i:i + 1, 1:ql[i] + 1]], 1)   # one run
    with_p = A.layer_outputs(tiny, x, torch.tensor([[x.shape[1] - 1]]))[0, 0]
    alone = A.layer_outputs(tiny, ids[i:i + 1, :ql[i] + 1],
                            ql[i:i + 1, None])[0, 0]
    assert n > 1 and (dH[i] - (with_p - alone).flatten()).abs().max() < 1e-10


@pytest.mark.parametrize("centred, prompt", [(True, False), (False, True)])
def test_run_icv_reports_test_metrics_and_its_checks(tiny, centred, prompt):
    cfg = C.CompressConfig(shots=2, n_cal=4, n_val=3, n_test=3, seed=0)
    td = T.encode_task(CharTok(), [dict(input=x, output=y) for x, y in PAIRS],
                       cfg)
    ref = A.reference_run(tiny, td, ("out",))
    pairs = list(td.demos) + td.cal.items
    if prompt:
        with pytest.raises(ValueError, match="calibration queries"):
            A.run_icv(tiny, CharTok(), td, cfg, pairs, ref, centred, prompt)
        pairs = td.cal.items
    r = A.run_icv(tiny, CharTok(), td, cfg, pairs, ref, centred, prompt)
    assert 0 <= r["first_token_acc"] <= 1 and 0 <= r["answer_acc"] <= 1
    assert r["icv_pairs"] == len(pairs) and r["target"] == ("prompt" if prompt
                                                   else "answer")
    assert max(r["checks"].values()) < 1e-4
