"""Every prefix's patches of SmolLM2: the one pass against the loop of
context_patches calls and against one plain forward pass.

Runs `icl_book.experiments.lm_dynamics.bench_hf_trajectory` (SmolLM2-135M-Instruct,
float32, a random prompt of n context tokens and a one-token query) for each n
and appends one JSON line per n to bench/hf_trajectory.jsonl (chapter 11e reads
the latest line per n), with the command, the commit and the load average.
Timed side by side in `--repeats` interleaved rounds (medians; each sample
repeats a run until it took 2 s, per call): the one pass
as the library runs it (open loop, closed-loop self-check on prefixes 1, n and
8 random ones: `check_max_err` is its largest layer error), the one pass with
the closed loop on every prefix (`check='all'`), one plain forward pass over
the prompt, and the loop, spread over the same rounds: timed on 8 prefix
lengths evenly spaced in 1..n (two context_patches calls each) and
extrapolated by a least-squares line t(i) = a + b i summed over i = 1..n.
`speedup` = loop / one pass, `forward_ratio` = one pass / forward
(`forward_ratio_closed` for the closed loop); `*_cpu` the same ratios from the
process's CPU time; `max_rel_diff` = the largest relative difference of a row
of steps against the loop. Run on one thread:

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/hf_trajectory.py
    OMP_NUM_THREADS=1 python bench/hf_trajectory.py --n 512 --no-save

About 5 minutes on an idle core (n = 1024 dominates); timings on a shared
machine vary with its load, the ratios less, since they are measured side by
side.
"""
import argparse
import json
import os
import platform
import sys
import subprocess
import time
from pathlib import Path

import torch

from icl_book.experiments.lm_dynamics import bench_hf_trajectory
from icl_book.weights import load_pretrained

OUT = Path(__file__).with_name("hf_trajectory.jsonl")


def _commit() -> str:
    "HEAD's short hash, with '+dirty' if tracked files differ from it."
    git = lambda *a: subprocess.run(["git", *a], capture_output=True,
                                    text=True, cwd=Path(__file__).parent
                                    ).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty
                                                       else "")
    except OSError:
        return ""


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[64, 256, 512, 1024])
    p.add_argument("--loop-prefixes", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5,
                   help="interleaved rounds of timed calls: the median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true",
                   help="print only; do not append to hf_trajectory.jsonl")
    a = p.parse_args(argv)
    commit = _commit()               # the code as loaded, before any run
    model, _ = load_pretrained("smollm2")
    rows = []
    for n in a.n:
        r = bench_hf_trajectory(n=n, loop_prefixes=a.loop_prefixes,
                                repeats=a.repeats, seed=a.seed, model=model)
        env = " ".join(f"{k}={os.environ[k]}" for k in
                       ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ)
        r.update(model="SmolLM2-135M-Instruct", commit=commit,
                 command=" ".join([env, "python", *sys.argv]).strip(),
                 date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                 machine=platform.machine(), cpus=torch.get_num_threads())
        print(json.dumps(r), flush=True)
        rows.append(r)
        if not a.no_save:
            with OUT.open("a") as f:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main()
