"""SmolLM2's implicit dynamics over long prompts: convergence and monitoring.

`convergence`: token steps ||ΔW(c_1..i) - ΔW(c_1..i-1)||_F of every layer
(icl_book.lm_dynamics.token_updates, one pass) for prompts of n = 1024 tokens
of four kinds (prose from README.md, few-shot country: capital lines, a
repeated passage, random tokens), three prompts per kind; per layer the tail
slope (second half, as chapter 08), a wider fit (from i = n/16), the first
step over the median of the rest, and the median-over-prompts steps averaged
in geometric bins of i.

`monitor`: few-shot prompts (`Input: Output` lines of a function-vector task)
with example j right and wrong (icl_book.experiments.lm_monitor): per detector (the
model's own surprisal of the answer; the patch step at the answer over the
other examples' or its neighbours'; the direction of the example's update)
and layer (and all layers), the ROC AUC wrong vs right with a bootstrap
interval, position known and unknown, plus surprisal combined with the step
and with the direction. The configurations (MONITOR): country-capital with
k = 8 (200 prompts) and 4 (60) examples, present-past and antonym with k = 8
(60 and 40 prompts). Configurations can run in separate processes
(--config TASK:K:PROMPTS --out FILE) and their rows be joined.

Rows go to bench/lm_dynamics.jsonl (a section's old rows are replaced);
chapter 11e draws them. Run on one thread:

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python bench/lm_dynamics.py
    OMP_NUM_THREADS=1 python bench/lm_dynamics.py convergence --n 512

About 5 minutes on one core for convergence, 25 for monitor.
"""
import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from icl_book.lm_dynamics import token_updates
from icl_book.experiments.lm_dynamics import (PROMPT_KINDS, convergence_prompt,
                                              layer_summary, log_bins,
                                              readme_prose)
from icl_book.experiments.lm_monitor import (bootstrap_auc, combined,
                                             detector_table, monitor_scores,
                                             roc_auc)
from icl_book.weights import load_pretrained

HERE = Path(__file__).parent
OUT = HERE / "lm_dynamics.jsonl"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True,
                              cwd=HERE).stdout.strip()
    except OSError:
        return ""


def convergence(model, tok, n: int, seeds: int) -> list:
    prose = readme_prose((HERE.parent / "README.md").read_text())
    rows = []
    for kind in PROMPT_KINDS:
        t0 = time.perf_counter()
        Us = []
        for s in range(seeds):
            ids = convergence_prompt(tok, kind, n, s, prose)
            Us.append(token_updates(model, ids[:, :n], ids[:, n:]))
        U = torch.stack(Us)                                  # (S, n, L)
        centres, means = log_bins(U.median(0).values)         # (bins, L)
        for r in layer_summary(U):
            rows.append(dict(
                what="convergence", kind=kind, n=n, prompts=seeds, **r,
                bins_i=[round(c, 2) for c in centres],
                bins_u=[float(f"{v:.4g}") for v in means[:, r["layer"]]],
                seconds=round(time.perf_counter() - t0, 1)))
        print(kind, f"{time.perf_counter() - t0:.0f}s", flush=True)
    return rows


MONITOR = (("country-capital", 8, 200), ("country-capital", 4, 60),
           ("present-past", 8, 60), ("antonym", 8, 40))


def monitor(model, tok, configs=MONITOR, save=None) -> list:
    rows = []
    for task, k, prompts in configs:
        t0 = time.perf_counter()
        res = [monitor_scores(model, tok, k, seed=s, task=task)
               for s in range(prompts)]
        new = [dict(what="monitor", **r) for r in detector_table(res)]
        for det in ("step/others", "direction"):
            both = combined(res, det)
            lo, hi = bootstrap_auc(*both)
            new.append(dict(what="monitor",
                            detector=f"surprisal+{det.split('/')[0]}",
                            layer="all", auc=roc_auc(*both), auc_lo=lo,
                            auc_hi=hi, prompts=prompts, k=k, task=task))
        for r in new:
            r["seconds"] = round(time.perf_counter() - t0, 1)
        rows += new
        if save is not None: save(new)
        print("monitor", task, k, f"{time.perf_counter() - t0:.0f}s",
              flush=True)
    return rows


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", nargs="*",
                   help="sections: convergence, monitor (default: both)")
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per monitor configuration (default: its own)")
    p.add_argument("--config", action="append", default=[],
                   help="monitor configurations TASK:K:PROMPTS (repeatable; "
                        "default: MONITOR); only their rows are replaced")
    p.add_argument("--out", default=None,
                   help="JSON-lines file (default: bench/lm_dynamics.jsonl)")
    a = p.parse_args(argv)
    a.what = a.what or ["convergence", "monitor"]
    bad = set(a.what) - {"convergence", "monitor"}
    if bad: p.error(f"unknown sections {sorted(bad)}")
    model, tok = load_pretrained("smollm2")
    meta = dict(commit=_commit(), date=time.strftime("%Y-%m-%d"),
                threads=torch.get_num_threads())
    cfg = ([(t, int(k), int(n)) for t, k, n in
            (c.split(":") for c in a.config)] if a.config else MONITOR)
    if a.prompts is not None: cfg = [(t, k, a.prompts) for t, k, _ in cfg]
    out = Path(a.out) if a.out else OUT

    def same(r, s):                  # rows one run replaces
        if r["what"] != s["what"]: return False
        return r["what"] == "convergence" or "task" not in r or (
            r["task"], r["k"]) == (s["task"], s["k"])

    def save(rows):                  # after each section or configuration
        old = ([json.loads(x) for x in out.read_text().splitlines()
                if x.strip()] if out.exists() else [])
        keep = [r for r in old if not any(same(r, s) for s in rows)]
        out.write_text("".join(json.dumps(r) + "\n" for r in keep)
                       + "".join(json.dumps({**r, **meta}) + "\n"
                                 for r in rows))

    new = []
    if "convergence" in a.what:
        rows = convergence(model, tok, a.n, a.seeds); save(rows); new += rows
    if "monitor" in a.what:
        new += monitor(model, tok, cfg, save)
    return new


if __name__ == "__main__":
    main()
