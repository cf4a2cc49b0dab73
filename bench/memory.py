"""Peak memory and time of the patch functions against the context length n.

Attention is computed in chunks of queries (`icl_book.blocks.Attention.attend`),
so no (B, heads, n, n) score matrix is ever formed. Each case runs in a fresh
subprocess and reports the growth of its peak resident memory over the memory
it held just before the call, the wall time, and a float64 agreement check:

- chunk_patch, block_trajectory: one contextual block (d = 8, H = 32, 2 heads);
  the trajectory is checked against `chunk_patch` of the prefixes 1, n/2, n;
- context_patches, stack_trajectory: a causal Pre-LN stack (2 blocks, d = 8,
  2 heads, H = 32); the trajectory is checked against the one-forward-pass-
  per-prefix loop at the prefixes 1, n/2, n.

`dense_scores_gb` is what one (B, heads, n+1, n+1) float64 score matrix would
take, the allocation the former code made at once.

    OMP_NUM_THREADS=1 python bench/memory.py --out bench/memory.jsonl
    python bench/memory.py --n 1000 --cases chunk_patch --kinds softmax

Each case runs `--repeats` times (default 3), each in a fresh subprocess;
its row keeps the worst run and lists every run's peak growth: the same case
varies by tens of percent from run to run, because the allocator keeps or
returns the freed chunks of the chunked attention differently each time.

The default sweep (n = 1000 .. 20000, four functions, two attention kinds)
takes about ten minutes per repeat on one CPU thread.
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CASES = ('chunk_patch', 'block_trajectory', 'context_patches',
         'stack_trajectory')


def _rss_kb() -> int:
    "Resident memory now, in KiB (Linux)."
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') // 1024


def _reset_peak() -> None:
    """Reset the process's peak resident memory (VmHWM, what getrusage's
    ru_maxrss reports) to its current value (Linux >= 4.0; else a no-op, and
    the peak may include the imports')."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
    except OSError:
        pass


def run_case(case: str, kind: str, n: int, d: int = 8, seed: int = 0) -> dict:
    "One case in this process: peak memory growth, time, float64 agreement."
    import torch
    from icl_book.blocks import PreLNStack, StackConfig, make_block
    from icl_book.deep import context_patches
    from icl_book.trajectories import (block_trajectory, patch_rel_diff,
                                       stack_trajectory, stack_trajectory_naive,
                                       trajectory_rel_diff)
    from icl_book.patch import chunk_patch
    torch.set_num_threads(int(os.environ.get('OMP_NUM_THREADS', '1')))
    g = torch.Generator().manual_seed(seed + 1)
    C = torch.randn(1, n, d, generator=g, dtype=torch.float64)
    x = torch.randn(1, d, generator=g, dtype=torch.float64)
    heads = 2
    if case in ('chunk_patch', 'block_trajectory'):
        model = make_block(kind, d=d, d_hidden=32, heads=heads, seed=seed)
    else:
        model = PreLNStack(StackConfig(depth=2, d_model=d, heads=heads,
                                       d_mlp=32, kind=kind, seed=seed,
                                       dtype='float64'))
    fn = {'chunk_patch': lambda: chunk_patch(model, C, x),
          'block_trajectory': lambda: block_trajectory(model, C, x),
          'context_patches': lambda: context_patches(model, C, x[:, None]),
          'stack_trajectory': lambda: stack_trajectory(model, C, x)}[case]
    _reset_peak()              # the peak below is the computation's, not the imports'
    before = _rss_kb()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss     # KiB
    check, at = None, sorted({1, n // 2, n})
    with torch.no_grad():
        if case == 'block_trajectory':
            check = max(patch_rel_diff(
                type(out)(out.u[:, i - 1], out.v[:, i - 1]),
                chunk_patch(model, C[:, :i], x)).max().item() for i in at)
        elif case == 'stack_trajectory':
            check = trajectory_rel_diff(
                out, stack_trajectory_naive(model, C, x, prefixes=at), at)
    return dict(case=case, kind=kind, n=n, d=d, heads=heads, batch=1,
                dtype='float64', seconds=round(seconds, 3),
                peak_growth_mb=round(max(0, peak - before) / 1024, 1),
                peak_rss_mb=round(peak / 1024, 1),
                dense_scores_gb=round(heads * (n + 1) ** 2 * 8 / 1e9, 2),
                check_prefixes=at if check is not None else None,
                max_rel_diff=check,
                threads=torch.get_num_threads(), torch=torch.__version__,
                python=platform.python_version(), machine=platform.machine())


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--n', type=int, nargs='+',
                   default=[1000, 2500, 5000, 10000, 20000])
    p.add_argument('--cases', nargs='+', default=list(CASES), choices=CASES)
    p.add_argument('--kinds', nargs='+', default=['softmax', 'linear'],
                   choices=['softmax', 'linear'])
    p.add_argument('--limit-gb', type=float, default=2.0,
                   help='fail if a case grows its peak memory beyond this')
    p.add_argument('--repeats', type=int, default=3,
                   help='fresh runs per case; the row keeps the worst peak '
                        '(the allocator makes it vary from run to run)')
    p.add_argument('--out', type=Path, help='also write the JSON lines here')
    p.add_argument('--one', nargs=3, metavar=('CASE', 'KIND', 'N'),
                   help=argparse.SUPPRESS)           # the subprocess entry
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(run_case(a.one[0], a.one[1], int(a.one[2]))))
        return []
    rows = []
    for n in a.n:
        for case in a.cases:
            for kind in a.kinds:
                runs = [json.loads(subprocess.run(
                    [sys.executable, __file__, '--one', case, kind, str(n)],
                    capture_output=True, text=True, check=True
                ).stdout.strip().splitlines()[-1]) for _ in range(a.repeats)]
                row = max(runs, key=lambda r: r['peak_growth_mb'])  # worst
                row.update(runs=a.repeats, peak_growth_mb_runs=[
                    r['peak_growth_mb'] for r in runs])
                print(json.dumps(row), flush=True)
                rows.append(row)
                assert row['peak_growth_mb'] <= 1024 * a.limit_gb, row
                assert row['max_rel_diff'] is None or row['max_rel_diff'] < 1e-9, row
    if a.out:
        a.out.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return rows


if __name__ == '__main__':
    main(sys.argv[1:])
