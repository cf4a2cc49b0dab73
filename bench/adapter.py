"""`compress --out` as a user runs it, timed, and its adapter checked in PEFT.

    python bench/adapter.py --task present-past [--task FILE.json ...]

For each task: the wall seconds of `python -m icl_book compress --task T --out
DIR` (a fresh process; the SmolLM2 weights cached), the load average beside it
(the machine's other work slows it), the CPU seconds the command used (user +
system, its own work whatever the load: with --threads 1 a lower bound of its
wall time on one free core), then PeftModel.from_pretrained(base, DIR)
against `with c.applied(base)` of DIR/compressed.pt: the relative logit error
‖PEFT − native‖ / ‖native‖ on the start token + each held-out query, and
whether greedy continuations (6 tokens) are the same. One JSON line per task.
"""
import argparse, copy, json, os, resource, subprocess, sys, tempfile, time
from pathlib import Path

import torch


def check(task: str, d: Path) -> dict:
    from peft import PeftModel
    from icl_book.compress import Compressed
    from icl_book.task_suite import load_task
    from icl_book.weights import load_pretrained
    base, tok = load_pretrained('smollm2')
    c = Compressed.load(d / 'compressed.pt')
    pm = PeftModel.from_pretrained(copy.deepcopy(base), str(d))
    pairs = load_task(task)[-20:]             # queries: the file's last 20
    rel, same = [], 0
    for x, _ in pairs:
        q = c.query_ids(tok, x)
        with torch.no_grad():
            with c.applied(base):
                want = base(q).logits
                g_want = base.generate(q, max_new_tokens=6, do_sample=False)
            got = pm(q).logits
            g_got = pm.generate(q, max_new_tokens=6, do_sample=False)
        rel.append(((got - want).norm() / want.norm()).item())
        same += torch.equal(g_got, g_want)
    return dict(max_rel_logit_err=max(rel), greedy_equal=f"{same}/{len(pairs)}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--task', action='append', required=True)
    p.add_argument('--threads', type=int, default=None)
    a = p.parse_args()
    for task in a.task:
        d = Path(tempfile.mkdtemp()) / 'adapter'
        load0 = os.getloadavg()[0]
        ru = lambda: (lambda u: u.ru_utime + u.ru_stime)(
            resource.getrusage(resource.RUSAGE_CHILDREN))
        t0, c0 = time.perf_counter(), ru()
        r = subprocess.run([sys.executable, '-m', 'icl_book', 'compress',
                            '--task', task, '--out', str(d), '--quiet'] + (
                                [] if a.threads is None else
                                ['--threads', str(a.threads)]),
                           capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, ru() - c0
        if r.returncode: raise SystemExit(r.stderr)
        res = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(dict(task=task, wall_s=round(wall, 1),
                              cpu_s=round(cpu, 1),
                              cli_wall_s=res['wall_s'], load_s=res['load_s'],
                              loadavg=[round(load0, 1),
                                       round(os.getloadavg()[0], 1)],
                              rank=(res['adapter_rank'] if isinstance(
                                  res['adapter_rank'], int)
                                  else res['adapter_rank'][0]),
                              numel=res['adapter_numel'], **check(task, d))),
              flush=True)


if __name__ == '__main__':
    main()
