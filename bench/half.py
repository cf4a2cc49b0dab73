"""Half precision, measured per family: the self-check's largest per-layer error
and the patched query's output error, for a tiny random model of every family
in bfloat16 and float16 (the patches are computed in float32).

Usage: python bench/half.py [--arch llama,bert] [--seeds 3] [--out bench/half.jsonl]
One JSON line per family and dtype: the largest error over the seeds, against
the self-check's tolerance for half precision (hf_patch: 0.05 for any dtype
other than float32 and float64). Needs the hf extra.
"""
import argparse
import json
import math

import torch

from icl_book.core import rel_err
from icl_book.families import TINY_ARCHS, tiny_model
from icl_book.hf import context_patches, patched


def measure(arch: str, dtype: str, seed: int) -> dict:
    "Self-check and output errors of one tiny model of `arch` in `dtype`."
    m = tiny_model(arch, dtype, seed=seed, layers=2, d=16)
    g = torch.Generator().manual_seed(seed)
    C, x = torch.randint(2, 90, (2, 17), generator=g), torch.randint(2, 90, (2, 3), generator=g)
    out = lambda r: (r.logits if hasattr(r, "logits") else r.last_hidden_state).float()
    with torch.no_grad():
        full = out(m(torch.cat([C, x], 1)))[:, -3:]
        try:
            P = context_patches(m, C, x)
        except (ValueError, TypeError) as e:
            return dict(refused=str(e)[:200])
        with patched(m, P):
            alone = out(m(x))
    return dict(self_check=max(e for e in P.errors if e is not None),
                output=rel_err(alone, full))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default=None, help="comma-separated families (default: all)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default=None, help="append the JSON lines here")
    a = p.parse_args()
    torch.set_num_threads(1)
    for arch in (a.arch.split(",") if a.arch else TINY_ARCHS):
        for dtype in ("bfloat16", "float16"):
            runs = [measure(arch, dtype, s) for s in range(a.seeds)]
            ok = [r for r in runs if "refused" not in r]
            row = dict(arch=arch, dtype=dtype, seeds=a.seeds, refused=len(runs) - len(ok),
                       eps=torch.finfo(getattr(torch, dtype)).eps,
                       self_check=max((r["self_check"] for r in ok), default=math.nan),
                       output=max((r["output"] for r in ok), default=math.nan),
                       why=next((r["refused"] for r in runs if "refused" in r), None))
            line = json.dumps(row)
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")
