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
Each side is built in the precision it is timed in (the same float64
weights, rounded once) and timed warm (after one call, which also compiles
the peer's jit) on one pinned CPU core, one thread, in --rounds interleaved
rounds of --repeats calls (peer, ours, peer, ours, ...), so that a change of
the machine's load hits both; the median of all calls is reported, and the
median split of a call into forward pass (t_forward; ours: of which
t_attention), update computation (t_updates) and patched run (t_patched).
For the peer, t_attention is the context's attention computed alone, which
its update call computes a second time. Each side reports its largest
relative error against the unpatched block output; ours also how far its
block outputs are from the peer's (outputs_vs_peer), the peer also its error
without the `+ 1e-8` in its update's denominator (max_rel_err_no_eps, from a
copy of its function with the constant removed). One JSON line per
(N, dtype, side).
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
    "Our blocks, built in `dtype`, with the float64 weights w rounded once."
    import torch
    from icl_book.blocks import MLP, PreLNBlock
    blocks = []
    for l in range(BLOCKS):
        blk = PreLNBlock(D, HEADS, MULT * D).to(dtype)
        blk.mlp = MLP(D, MULT * D, D, depth=3, act='gelu_tanh').to(dtype)
        blk.load_state_dict({k.split('.', 1)[1]: torch.from_numpy(v).to(dtype)
                             for k, v in w.items() if k.startswith(f'{l}.')})
        blocks.append(blk)
    return blocks


def ours_check(blocks, Cx, clock=None):
    "Largest relative error of the per-block check; the block outputs."
    import torch
    from icl_book.core import rel_err
    from icl_book.deep import block_patch_factors
    tick = time.perf_counter
    Z, worst, outs = Cx, 0., []
    with torch.inference_mode():           # what a user timing it would use
        for blk in blocks:
            B, T, d = Z.shape
            t0 = tick(); h = blk.residual(Z)                    # attention
            t1 = tick(); out = h + blk.mlp(blk.ln2(h))           # (B, T, d)
            z = Z[:, -1:]                             # last token alone (B, 1, d)
            t2 = tick()
            p = block_patch_factors(blk, h[:, :, None], z[:, None])  # (B, T, 1, .)
            # the patched block on z at every position: its attention part is
            # not patched, so it is computed once per prompt (as the peer's
            # vmap does), then PreLNBlock.forward's MLP half with each patch
            t3 = tick(); h0 = blk.residual(z)[:, None]             # (B, 1, 1, d)
            grow = lambda t: t.expand(B, T, 1, d)
            pred = (h0 + blk.mlp(grow(blk.ln2(h0)), **p.kwargs())).view(B, T, d)
            t4 = tick()
            if clock is not None:
                for k, dt in (('t_attention', t1 - t0), ('t_forward', t2 - t0),
                              ('t_updates', t3 - t2), ('t_patched', t4 - t3)):
                    clock[k] = clock.get(k, 0.) + dt
            worst = max(worst, rel_err(pred, out))
            outs.append(out.double().numpy()); Z = out
    return worst, outs


PEER = r'''
import json, statistics, sys, time, types
import numpy as np
wfile, dtype, repeats, peer, outfile = sys.argv[1:6]
import jax
jax.config.update('jax_enable_x64', dtype == 'float64')
import jax.numpy as jnp, jax.random as jr, equinox as eqx
sys.path.insert(0, peer)
from model import Transformer, forward, compute_vectorised_theory_preds
from analytical import compute_implicit_icl_updates
# the same function without the +1e-8 in its denominator, to see what it costs
src = open(f'{peer}/analytical.py').read()
assert src.count('(denominator + 1e-8)') == 1, 'the peer code changed'
noeps = types.ModuleType('analytical_noeps')
exec(src.replace('(denominator + 1e-8)', '(denominator)'), noeps.__dict__)
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
attn = eqx.filter_jit(lambda m, l, X: m.blocks[l].attention_layer(X))
ready = jax.block_until_ready
def check(m, Cx, clock=None, updates=compute_implicit_icl_updates):
    tick = time.perf_counter
    t0 = tick(); _, acts = ready(forward(m, Cx, return_activations=True))
    ins, worst, t = [Cx] + acts, 0., dict(t_forward=tick() - t0, t_updates=0.,
                                         t_patched=0., t_attention=0.)
    for l in range(L):
        x = ins[l][:, -1:]
        t0 = tick()
        dWs, dbs = ready(updates(model=m, C_x=ins[l], x=x, block_idx=l,
                                 use_skips=True, use_layer_norm=True))
        t1 = tick()
        pred = ready(compute_vectorised_theory_preds(base_model=m, x=x, ΔWs=dWs,
                                                     Δbs=dbs, block_idx=l))
        t2 = tick(); t['t_updates'] += t1 - t0; t['t_patched'] += t2 - t1
        ref = acts[l]
        e = jnp.linalg.norm(pred - ref, axis=-1) / jnp.linalg.norm(ref, axis=-1)
        worst = max(worst, float(e.max()))
    if clock is not None:             # the context's attention alone, untimed
        for l in range(L):            # in `times`: what its update call repeats
            t0 = tick(); ready(attn(m, l, ins[l])); t['t_attention'] += tick() - t0
        clock.append(t)
    return worst, acts
err, acts = check(m, Cx, [])                         # compiles the jitted parts
err_noeps = check(m, Cx, updates=noeps.compute_implicit_icl_updates)[0]
np.savez(outfile, *[np.asarray(a, dtype=np.float64) for a in acts])
print('ready', flush=True)
for line in sys.stdin:                # one round of timed calls per line
    times, clock = [], []
    for _ in range(int(repeats)):
        t = time.perf_counter(); check(m, Cx)
        times.append(time.perf_counter() - t)
    check(m, Cx, clock)                 # the time's split, once, untimed above
    print(json.dumps(dict(times=times, clock=clock)), flush=True)
print(json.dumps(dict(max_rel_err=err, max_rel_err_no_eps=err_noeps,
                      jax=jax.__version__, equinox=eqx.__version__)), flush=True)
'''


def _median_clock(clocks: list) -> dict:
    return {k: statistics.median(c[k] for c in clocks) for k in clocks[0]}


def run_pair(w, Cx64, dtype_name, repeats, rounds, jax_python, peer, core):
    "Both sides on one core, their timed rounds interleaved; two result rows."
    import torch
    torch.set_num_threads(1)
    pin = lambda: os.sched_setaffinity(0, {core})
    pin()
    env = dict(os.environ, OMP_NUM_THREADS='1', XLA_FLAGS=(
        '--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1'))
    dt = getattr(torch, dtype_name)
    blocks, Cx = our_model(w, dt), torch.from_numpy(Cx64).to(dt)
    err, outs = ours_check(blocks, Cx)                        # warm-up
    ours_t, ours_c, peer_t, peer_c = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        f, acts = Path(tmp) / 'w.npz', Path(tmp) / 'acts.npz'
        np.savez(f, Cx=Cx64, D=D, H=MULT * D, L=BLOCKS, heads=HEADS, **w)
        script = Path(tmp) / 'peer.py'; script.write_text(PEER)
        proc = subprocess.Popen(
            [jax_python, str(script), str(f), dtype_name, str(repeats),
             str(peer), str(acts)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, preexec_fn=pin)
        if proc.stdout.readline().strip() != 'ready':
            raise RuntimeError(f"the peer code failed:\n{proc.stderr.read()[-3000:]}")
        for _ in range(rounds):
            proc.stdin.write('\n'); proc.stdin.flush()
            r = json.loads(proc.stdout.readline())
            peer_t += r['times']; peer_c += r['clock']
            for _ in range(repeats):
                c = {}; t = time.perf_counter(); ours_check(blocks, Cx, c)
                ours_t.append(time.perf_counter() - t); ours_c.append(c)
        proc.stdin.close()
        info = json.loads(proc.stdout.readline()); proc.wait()
        theirs = np.load(acts); theirs = [theirs[k] for k in theirs.files]
    agree = max(float((np.linalg.norm(a - b, axis=-1)
                       / np.linalg.norm(b, axis=-1)).max())
                for a, b in zip(outs, theirs))
    ours = dict(seconds=statistics.median(ours_t), max_rel_err=err,
                outputs_vs_peer=agree, torch=torch.__version__,
                **_median_clock(ours_c))
    theirs = dict(seconds=statistics.median(peer_t), **info,
                  **_median_clock(peer_c))
    return ours, theirs


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--n', type=int, nargs='+', default=[10, 30, 100, 300, 1000])
    p.add_argument('--dtypes', nargs='+', default=['float32', 'float64'])
    p.add_argument('--repeats', type=int, default=3, help='timed calls a round')
    p.add_argument('--rounds', type=int, default=3, help='interleaved rounds')
    p.add_argument('--core', type=int, default=0, help='the one CPU core used')
    p.add_argument('--peer', type=Path, default=Path('/tmp/generalising-icl'))
    p.add_argument('--jax-python', default='/tmp/jaxvenv/bin/python')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', type=Path, help='also write the JSON lines here')
    a = p.parse_args(argv)
    w, rows = make_weights(a.seed), []
    for n in a.n:
        g = np.random.default_rng(a.seed + n)
        Cx = g.standard_normal((BATCH, n + 1, D)); Cx[:, -1, -1] = 0.  # query y = 0
        for dt in a.dtypes:
            ours, peer = run_pair(w, Cx, dt, a.repeats, a.rounds,
                                  a.jax_python, a.peer, a.core)
            base = dict(N=n, dtype=dt, blocks=BLOCKS, batch=BATCH, width=D,
                        heads=HEADS, mlp=MULT * D, repeats=a.repeats * a.rounds,
                        threads=1, core=a.core, interleaved=a.rounds)
            rows.append(dict(base, side='ours', **ours,
                             speedup_vs_peer=peer['seconds'] / ours['seconds']))
            rows.append(dict(base, side='innocenti-achour', **peer))
            for r in rows[-2:]:
                r.update(python=platform.python_version(),
                         machine=platform.machine())
                print(json.dumps(r), flush=True)
    if a.out:
        a.out.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return rows


if __name__ == '__main__':
    main(sys.argv[1:])
