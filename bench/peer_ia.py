"""Per-block patch check, ours vs the public JAX code of Innocenti & Achour.

The peer is github.com/francesco-innocenti/generalising-icl (HEAD cc82e7b,
MIT licence), which is not vendored here: point --peer at a checkout (its
model.py and analytical.py are imported from there) and --jax-python at a
Python with jax and equinox (a throwaway venv outside the repository):

    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install "jax[cpu]" equinox
    git clone https://github.com/francesco-innocenti/generalising-icl /tmp/generalising-icl
    OMP_NUM_THREADS=1 python bench/peer_ia.py --out bench/peer_ia.jsonl

Both sides get identical weights and inputs: a causal Pre-LN transformer of
the peer's default shape (width D = 3, 3 heads, MLP 4D with two hidden layers
and tanh-GELU, LayerNorm before attention and MLP), 3 blocks, batch 32, and
the same prompt tokens (B, N+1, D). The check is the peer's per-block one
(`compute_implicit_icl_updates` + `compute_vectorised_theory_preds`): for
every block and every position i, the patch that makes the block, run on the
last token alone, give the block's output at position i; then that patched
run, for all positions. Ours does the same with `block_patch_factors` (rank-1
factors, never the dense (B, N+1, H, D) updates). Both sides run the query's
attention once per prompt (the peer's vmap over updates leaves the unpatched
attention of the same token unbatched) and the patched MLP once per position.
Each side is timed warm
(after one call, which also compiles the peer's jit), median of --repeats
calls, one thread each, and reports its largest relative error against the
unpatched block output. One JSON line per (N, dtype, side).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

D, HEADS, BLOCKS, BATCH, MULT = 3, 3, 3, 32, 4


def make_weights(seed: int = 0) -> dict:
    "Random weights of the peer's model, as float64 arrays (torch init)."
    import torch
    from icl_book.blocks import PreLNBlock, MLP
    torch.manual_seed(seed)
    out = {}
    for l in range(BLOCKS):
        blk = PreLNBlock(D, HEADS, MULT * D).double()
        blk.mlp = MLP(D, MULT * D, D, depth=3).double()
        for k, v in blk.state_dict().items():
            out[f'{l}.{k}'] = (v + 0.1 * torch.randn_like(v)).numpy()
    return out


def our_model(w: dict, dtype):
    "Our blocks with the weights w."
    import torch
    from icl_book.blocks import MLP, PreLNBlock
    blocks = []
    for l in range(BLOCKS):
        blk = PreLNBlock(D, HEADS, MULT * D)
        blk.mlp = MLP(D, MULT * D, D, depth=3, act='gelu_tanh')
        blk.load_state_dict({k.split('.', 1)[1]: torch.from_numpy(v)
                             for k, v in w.items() if k.startswith(f'{l}.')})
        blocks.append(blk.to(dtype))
    return blocks


def ours_check(blocks, Cx):
    "Largest relative error of the per-block check over blocks and positions."
    import torch
    from icl_book.core import rel_err
    from icl_book.deep import block_patch_factors
    Z, worst = Cx, 0.
    with torch.inference_mode():           # what a user timing it would use
        for blk in blocks:
            B, T, d = Z.shape
            h = blk.residual(Z); out = h + blk.mlp(blk.ln2(h))  # (B, T, d)
            z = Z[:, -1:]                             # last token alone (B, 1, d)
            p = block_patch_factors(blk, h[:, :, None], z[:, None])  # (B, T, 1, .)
            # the patched block on z at every position: its attention part is
            # not patched, so it is computed once per prompt (as the peer's
            # vmap does), then PreLNBlock.forward's MLP half with each patch
            h0 = blk.residual(z)[:, None]                          # (B, 1, 1, d)
            grow = lambda t: t.expand(B, T, 1, d)
            pred = (h0 + blk.mlp(grow(blk.ln2(h0)), **p.kwargs())).view(B, T, d)
            worst = max(worst, rel_err(pred, out))
            Z = out
    return worst


def time_ours(w, Cx64, dtype_name, repeats):
    import torch
    torch.set_num_threads(1)
    dt = getattr(torch, dtype_name)
    blocks, Cx = our_model(w, dt), torch.from_numpy(Cx64).to(dt)
    err = ours_check(blocks, Cx)                      # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); ours_check(blocks, Cx)
        times.append(time.perf_counter() - t)
    return statistics.median(times), err


PEER = r'''
import json, statistics, sys, time
import numpy as np
wfile, dtype, repeats, peer = sys.argv[1:5]
import jax
jax.config.update('jax_enable_x64', dtype == 'float64')
import jax.numpy as jnp, jax.random as jr, equinox as eqx
sys.path.insert(0, peer)
from model import Transformer, forward, compute_vectorised_theory_preds
from analytical import compute_implicit_icl_updates
z = np.load(wfile); Cx = jnp.asarray(z['Cx'], dtype=dtype)
D, H, L = int(z['D']), int(z['H']), int(z['L'])
m = Transformer(n_embed=D, n_heads=int(z['heads']), n_blocks=L, key=jr.PRNGKey(0),
                use_skips=True, use_layer_norm=True, causal_attn=True,
                hidden_multiplier=H // D)
A = lambda k: jnp.asarray(z[k], dtype=dtype)
for l in range(L):
    b = lambda m: m.blocks[l]
    g = lambda k: A(f'{l}.{k}')
    m = eqx.tree_at(lambda m: (b(m).attn.query_proj.weight, b(m).attn.key_proj.weight,
                               b(m).attn.value_proj.weight, b(m).attn.output_proj.weight,
                               b(m).ln_1.weight, b(m).ln_1.bias, b(m).ln_2.weight, b(m).ln_2.bias),
                    m, (g('layer.q.weight'), g('layer.k.weight'), g('layer.v.weight'),
                        g('layer.o.weight'), g('ln1.weight'), g('ln1.bias'),
                        g('ln2.weight'), g('ln2.bias')))
    for i in range(3):
        m = eqx.tree_at(lambda m: (b(m).mlp.layers[i].weight, b(m).mlp.layers[i].bias),
                        m, (g(f'mlp.layers.{i}.weight'), g(f'mlp.layers.{i}.bias')))
def check(m, Cx):
    _, acts = forward(m, Cx, return_activations=True)
    ins, worst = [Cx] + acts, 0.
    for l in range(L):
        x = ins[l][:, -1:]
        dWs, dbs = compute_implicit_icl_updates(model=m, C_x=ins[l], x=x, block_idx=l,
                                                use_skips=True, use_layer_norm=True)
        pred = compute_vectorised_theory_preds(base_model=m, x=x, ΔWs=dWs, Δbs=dbs,
                                               block_idx=l)
        ref = acts[l]
        e = jnp.linalg.norm(pred - ref, axis=-1) / jnp.linalg.norm(ref, axis=-1)
        worst = max(worst, float(e.max()))
    return worst
err = check(m, Cx)                                   # compiles the jitted parts
times = []
for _ in range(int(repeats)):
    t = time.perf_counter(); check(m, Cx); times.append(time.perf_counter() - t)
print(json.dumps(dict(seconds=statistics.median(times), max_rel_err=err,
                      jax=jax.__version__, equinox=eqx.__version__)))
'''


def time_peer(w, Cx64, dtype_name, repeats, jax_python, peer):
    env = dict(os.environ, OMP_NUM_THREADS='1', XLA_FLAGS=(
        '--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'))
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / 'w.npz'
        np.savez(f, Cx=Cx64, D=D, H=MULT * D, L=BLOCKS, heads=HEADS, **w)
        script = Path(tmp) / 'peer.py'; script.write_text(PEER)
        r = subprocess.run([jax_python, str(script), str(f), dtype_name,
                            str(repeats), str(peer)], capture_output=True,
                           text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"the peer code failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--n', type=int, nargs='+', default=[10, 100, 1000])
    p.add_argument('--dtypes', nargs='+', default=['float32', 'float64'])
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--peer', type=Path, default=Path('/tmp/generalising-icl'))
    p.add_argument('--jax-python', default='/tmp/jaxvenv/bin/python')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', type=Path, help='also write the JSON lines here')
    a = p.parse_args(argv)
    import torch
    w, rows = make_weights(a.seed), []
    for n in a.n:
        g = np.random.default_rng(a.seed + n)
        Cx = g.standard_normal((BATCH, n + 1, D)); Cx[:, -1, -1] = 0.  # query y = 0
        for dt in a.dtypes:
            t_ours, e_ours = time_ours(w, Cx, dt, a.repeats)
            peer = time_peer(w, Cx, dt, a.repeats, a.jax_python, a.peer)
            base = dict(N=n, dtype=dt, blocks=BLOCKS, batch=BATCH, width=D,
                        heads=HEADS, mlp=MULT * D, repeats=a.repeats, threads=1)
            rows.append(dict(base, side='ours', seconds=t_ours,
                             max_rel_err=e_ours, torch=torch.__version__))
            rows.append(dict(base, side='innocenti-achour', **peer))
            rows[-2]['speedup_vs_peer'] = peer['seconds'] / t_ours
            for r in rows[-2:]:
                r.update(python=platform.python_version(),
                         machine=platform.machine())
                print(json.dumps(r), flush=True)
    if a.out:
        a.out.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return rows


if __name__ == '__main__':
    main(sys.argv[1:])
