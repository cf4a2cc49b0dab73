"""Whole patch trajectories: the naive loop of n forward passes vs one pass.

Runs `icl_book.experiments.trajectories.bench_trajectory` (10-layer causal
Pre-LN stack, width 64, float32 timing, float64 agreement) for each n and prints
one JSON line per n. With --out FILE the lines are also written to FILE (the book's chapter 04
reads bench/trajectory.jsonl for its closing note).

    python bench/trajectory.py                     # n = 64, 256, 1024
    python bench/trajectory.py --n 128 --layers 4
    python bench/trajectory.py --out bench/trajectory.jsonl

The n = 1024 loop dominates the cost: a few minutes on 2 CPU cores.
"""
import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from icl_book.experiments.trajectories import bench_trajectory


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[64, 256, 1024],
                   help="context lengths (default: 64 256 1024)")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed calls per side: the median after a warm-up call")
    p.add_argument("--check", type=int, default=32,
                   help="prefix lengths checked against the float64 loop")
    p.add_argument("--out", type=Path, help="also write the JSON lines here")
    a = p.parse_args(argv)
    rows = []
    for n in a.n:
        r = bench_trajectory(n=n, layers=a.layers, d_model=a.d_model,
                             seed=a.seed, repeats=a.repeats, check=a.check)
        r.update(torch=torch.__version__, python=platform.python_version(),
                 machine=platform.machine())
        print(json.dumps(r), flush=True)
        rows.append(r)
    if a.out:
        a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
