"""What keeping a patch costs: the weight fingerprint, `HFPatch.save` and
`load_patches`, against one forward pass of the query and against computing
the patches again, on SmolLM2-135M-Instruct (float32), side by side.

The operations run interleaved (one of each per round, in a rotating order),
`--rounds` times; each row reports the median seconds of every operation and
the ratios of the medians. The fingerprint hashes every byte of the base
model's weights and buffers once (BLAKE2b); a forward pass of a short query
also reads every weight once, so their ratio says what the hash costs per
byte against the model's own use of the weights. `load_patches` = fingerprint
+ reading the file + the weight state `context_patches` records as well.

    OMP_NUM_THREADS=1 python bench/patch_io.py --out bench/patch_io.jsonl

The query is the chat template's assistant prefix; the contexts are
`--contexts` random token ids (the patches do not depend on their meaning).
"""
import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def run(n_ctx: int, rounds: int, seed: int = 0) -> dict:
    import torch
    from icl_book.core import weight_fingerprint
    from icl_book.hf import context_patches, load_patches, patched
    from icl_book.weights import load_pretrained
    torch.set_num_threads(int(os.environ.get('OMP_NUM_THREADS', '1')))
    model, tok = load_pretrained('smollm2')
    g = torch.Generator().manual_seed(seed)
    q = tok("<|im_start|>assistant\n", return_tensors='pt').input_ids
    C = torch.randint(0, model.config.vocab_size, (1, n_ctx), generator=g)
    P = context_patches(model, C, q)
    with torch.no_grad(), patched(model, P):
        ref = model(q).logits
    f = Path(tempfile.mkdtemp()) / 'p.safetensors'
    P.save(f)

    def forward():
        with torch.no_grad():
            model(q)

    ops = dict(forward=forward,
               fingerprint=lambda: weight_fingerprint(model.model),
               save=lambda: P.save(f),
               load=lambda: load_patches(f, model),
               context_patches=lambda: context_patches(model, C, q))
    times = {k: [] for k in ops}
    names = list(ops)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            ops[k]()
            times[k].append(time.perf_counter() - t)
    P2 = load_patches(f, model)
    with torch.no_grad(), patched(model, P2):
        exact = bool(torch.equal(model(q).logits, ref))
    med = {k: statistics.median(v) for k, v in times.items()}
    n_bytes = sum(t.numel() * t.element_size() for t in
                  [*model.model.parameters(), *model.model.buffers()])
    return dict(
        model='SmolLM2-135M-Instruct', dtype='float32', context=n_ctx,
        query=q.shape[1], rounds=rounds, file_bytes=f.stat().st_size,
        weight_bytes=n_bytes, seconds={k: round(v, 5) for k, v in med.items()},
        fingerprint_per_forward=round(med['fingerprint'] / med['forward'], 3),
        save_per_forward=round(med['save'] / med['forward'], 3),
        load_per_forward=round(med['load'] / med['forward'], 3),
        load_per_recompute=round(med['load'] / med['context_patches'], 3),
        loaded_logits_bit_for_bit=exact,
        threads=torch.get_num_threads(), torch=torch.__version__,
        python=platform.python_version(), machine=platform.machine())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--contexts', type=int, nargs='+', default=[33, 512])
    ap.add_argument('--rounds', type=int, default=7)
    ap.add_argument('--out', type=Path)
    a = ap.parse_args()
    rows = [run(n, a.rounds) for n in a.contexts]
    for r in rows: print(json.dumps(r))
    if a.out:
        a.out.write_text(''.join(json.dumps(r) + '\n' for r in rows))


if __name__ == '__main__':
    main()
