"""The adapter against in-context learning and the task vector on task files
the fit never saw: one JSON line per task (bench/adapter_heldout.jsonl).

    python bench/adapter_heldout.py data/heldout/*.json bench/tasks/*.json \
        [--variants 'adapter budget' 'adapter rrr32'] [--seeds 0 1 2]

Per task, under evaluate's protocol with the command's split sizes for the
task (`task_sizes`): the in-context reference, the task vector (every layer a
candidate, chosen on validation) and each adapter variant fitted, as
`compress --evaluate` fits it, on the calibration and validation queries
together (ridge 0.1; no knob of the adapter is chosen on validation), all on
the same test queries: first-token and whole-answer accuracy, and the CPU
seconds of each fit. `adapter` is the default variant (`compress --out`'s).
One line per task and seed (--seeds); --threads (default 2).
"""
import argparse, json, sys, time

import torch

from icl_book import compress as C
from icl_book.baselines import reference_run, run_task_vector, split_metrics
from icl_book.lm_thought import teacher_forced
from icl_book.baselines import icl_states
from icl_book.task_suite import join_splits
from icl_book.weights import load_pretrained

named = lambda m: dict(first_token_acc=m['accuracy_first'],
                       answer_acc=m['accuracy'], kl_first=m['kl_first'])


def run(model, tok, task: str, variants, seed: int) -> dict:
    n = len(C.load_task(task))
    cfg = C.CompressConfig(**C.task_sizes(n, {}, False), seed=seed)
    td = C.encode_task(tok, task, cfg)
    ref = reference_run(model, td, ('layers', 'out'))
    L = len(model.model.layers)
    tv = run_task_vector(model, td, ref['states'], ref['ref'], ref['ref1'],
                         range(L))[3]
    B = C.budget_numbers(model, 'kv/10', td.prompt.shape[1])
    out = dict(task=C.task_name(task), pairs=n, n_test=cfg.n_test, seed=seed,
               icl=named(ref['metrics']['icl']), task_vector=named(tv),
               adapter_variant=f'{C.ADAPTER} rrr{C.ADAPTER_RANK}',
               variants={})
    fit = join_splits(td.cal, td.val, td.start)
    S = icl_states(model, td.prompt, fit, parts=('layers',))
    out['fit_queries'] = len(fit.items)
    for name in variants:
        p0 = time.process_time()
        tp = C.fit_variant(model, td.prompt, fit, name, S, cfg.lam, budget=B)
        cpu = time.process_time() - p0
        lp = teacher_forced(model, td.prompt[:, :1], td.test.ids, tp, keep=1)
        out['variants'][name] = dict(named(split_metrics(ref['ref'], lp,
                                                         td.test)),
                                     fit_cpu_s=round(cpu, 1))
    out['adapter'] = out['variants'].get(out['adapter_variant'])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument('tasks', nargs='+')
    p.add_argument('--variants', nargs='+', default=[
        'adapter budget', f'{C.ADAPTER} rrr{C.ADAPTER_RANK}'])
    p.add_argument('--seeds', type=int, nargs='+', default=[0])
    p.add_argument('--threads', type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_pretrained('smollm2')
    for seed in a.seeds:
        for t in a.tasks:
            print(json.dumps(dict(run(model, tok, t, a.variants, seed),
                                  command=' '.join(['python'] + sys.argv))),
                  flush=True)


if __name__ == '__main__':
    main()
