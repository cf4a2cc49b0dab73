"""icl_book.hf_checks, on tiny random models. Patches a user can keep (issue
37): an HFPatch read by parameter name, summarised by its repr, saved
(safetensors + JSON) and loaded bit for bit by load_patches, which refuses
another model; copies and the one spelling of each property. And inside
`patched`, a bare encoder's pooled vector reads position 0 of the [context,
query] run, a context token: it is refused when read — attribute, key, tuple
slot, or any use — with the position named, never None or a wrong vector;
last_hidden_state stays exact."""
import copy
import pickle
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is "
                                   "not installed")

from conftest import model_output as output, random_ids as ids  # noqa: E402
from icl_book.core import rel_err  # noqa: E402
from icl_book.hf import context_patches, load_patches, patched, tiny_model  # noqa: E402
from icl_book.families import adapter  # noqa: E402
from icl_book.hf_checks import part_names  # noqa: E402


def patched_out(m, P, x):
    with patched(m, P):
        return output(m, x)


def factors(P):
    "Every stored tensor of P, in a fixed order (None where a part is absent)."
    out = []
    for p in P.layers:
        out += [t for r in p.dW for t in r]
        out += [p.db_out, p.ds_post, *(p.dW_out or (None, None))]
    return out + [P.query_ids, P.positions, P.query_mask, P.query_types]


def same_bits(a, b):
    return (a is None and b is None) or (
        a is not None and b is not None and a.dtype == b.dtype
        and a.shape == b.shape and torch.equal(a, b))


CASES = [("llama", "rank1"), ("llama", "bias"), ("gpt2", "rank1"),
         ("gemma2", "rank1"), ("gemma2", "bias"), ("qwen2_moe", "rank1"),
         ("bert", "bias")]


@pytest.mark.parametrize("arch,mode", CASES)
def test_saved_patch_loads_bit_for_bit(tmp_path, arch, mode):
    m = tiny_model(arch, "float64", seed=0)
    C, x = ids(2, 6, 0), ids(2, 3, 1)
    P = context_patches(m, C, x, mode)
    ref = patched_out(m, P, x)
    P.save(tmp_path / "p.safetensors")
    P2 = load_patches(tmp_path / "p.safetensors", m)
    assert all(same_bits(a, b) for a, b in zip(factors(P), factors(P2)))
    assert (P2.start, P2.mode, P2.arch, P2.family, P2.errors, P2.keys()) == (
        P.start, P.mode, P.arch, P.family, P.errors, P.keys())
    assert torch.equal(patched_out(m, P2, x), ref)
    twin = tiny_model(arch, "float64", seed=0)     # another object, same weights
    assert torch.equal(patched_out(twin, load_patches(
        tmp_path / "p.safetensors", twin), x), ref)
    with pytest.raises(ValueError, match="another model object"):
        patched(twin, P2).__enter__()                # bound where it was loaded


def test_saved_patch_float32_and_padded(tmp_path):
    m = tiny_model("llama", "float32", seed=0)
    C, x = ids(2, 5, 0), ids(2, 3, 1)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0                                  # left padding
    P = context_patches(m, C, x, attention_mask=mask)
    P.save(tmp_path / "p.safetensors")
    P2 = load_patches(tmp_path / "p.safetensors", m)
    assert P2.layers[0].dW[0].u.dtype == torch.float32
    assert all(same_bits(a, b) for a, b in zip(factors(P), factors(P2)))
    assert torch.equal(patched_out(m, P2, x), patched_out(m, P, x))


def test_load_patches_refuses_another_model(tmp_path):
    f = tmp_path / "p.safetensors"
    m = tiny_model("llama", "float64", seed=0)
    context_patches(m, ids(1, 6, 0), ids(1, 2, 1)).save(f)
    with pytest.raises(ValueError, match="weights differ"):
        load_patches(f, tiny_model("llama", "float64", seed=1))
    one_bit = tiny_model("llama", "float64", seed=0)
    w = one_bit.model.layers[2].self_attn.o_proj.weight
    with torch.no_grad():
        w.view(-1).view(torch.int64)[7] ^= 1
    with pytest.raises(ValueError, match="weights differ"):
        load_patches(f, one_bit)
    with pytest.raises(ValueError, match="computed in float64, the model is float32"):
        load_patches(f, tiny_model("llama", "float32", seed=0))
    with pytest.raises(ValueError, match="rms_norm_eps: 1e-06 there, 0.001 here"):
        load_patches(f, tiny_model("llama", "float64", seed=0, rms_norm_eps=1e-3))
    with pytest.raises(ValueError, match="patches of a LlamaForCausalLM with 3 "
                       "layers; this is a LlamaModel"):
        load_patches(f, tiny_model("llama", "float64", seed=0, head=False))
    with pytest.raises(ValueError, match="this is a GPT2LMHeadModel"):
        load_patches(f, tiny_model("gpt2", "float64", seed=0))
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="is not a icl_book.hf_patch/1 file"):
        load_patches(tmp_path / "plain.safetensors", m)


def test_save_refuses_stale_or_unbound(tmp_path):
    m = tiny_model("llama", "float64", seed=0)
    P = context_patches(m, ids(1, 6, 0), ids(1, 2, 1))
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight.data[0, 0] += 1.  # behind the counter
    with pytest.raises(ValueError, match="changed since context_patches"):
        P.save(tmp_path / "p.safetensors")
    P3 = context_patches(tiny_model("llama"), ids(1, 6, 0), ids(1, 2, 1))
    import gc
    gc.collect()                                     # its model is gone
    with pytest.raises(ValueError, match="not bound to a live model"):
        P3.save(tmp_path / "q.safetensors")


@pytest.mark.parametrize("arch,mode", [("llama", "rank1"), ("gpt2", "bias"),
                                       ("gpt2", "rank1"), ("olmo2", "rank1")])
def test_names_are_the_parameters_written(arch, mode):
    "P[name] is what inplace=True adds to that very parameter (an independent path)."
    m = tiny_model(arch, "float64", seed=0)
    P = context_patches(m, ids(1, 6, 0), ids(1, 1, 1), mode)
    before = {n: p.clone() for n, p in m.named_parameters()}
    with patched(m, P, inplace=True):
        after = {n: p.clone() for n, p in m.named_parameters()}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    named = set()
    for k in P.keys():
        v, param = P[k], k if k.endswith(".bias") else k + ".weight"
        named.add(param)
        got = after[param] - before[param]
        if isinstance(v, torch.Tensor) and not k.endswith(".bias"):   # post scale
            fam = adapter(m).family
            want = (fam.post_offset + before[param]) * v.reshape(-1)
        elif isinstance(v, torch.Tensor):
            want = v.reshape(-1)
        else:
            want = v.u.reshape(-1)[:, None] * v.v.reshape(-1)[None, :]
            if type(m.get_submodule(k)).__name__ == "Conv1D":
                want = want.T                         # stored as W^T
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), k
    assert named == changed


def test_named_access_and_keys():
    m = tiny_model("llama", "float64", seed=0)
    P = context_patches(m, ids(2, 6, 0), ids(2, 3, 1), "bias")
    names = part_names(adapter(m), m)
    assert P.keys() == [k for nm in names for k in (*nm["first"], nm["bias"])]
    assert list(P) == P.keys() and len(P) == 3       # len: the layers
    assert P["model.layers.1.mlp.up_proj"] is P.layers[1].dW[1]
    assert P["model.layers.1.mlp.up_proj.weight"] is P.layers[1].dW[1]
    assert P["model.layers.2.mlp.down_proj.bias"] is P.layers[2].db_out
    assert "model.layers.0.mlp.gate_proj" in P and "lm_head" not in P
    assert dict(m.named_modules())["model.layers.1.mlp.up_proj"].weight.shape == (
        P["model.layers.1.mlp.up_proj"].u.shape[-1],
        P["model.layers.1.mlp.up_proj"].v.shape[-1])
    with pytest.raises(KeyError, match="did you mean 'model.layers.1.mlp.up_proj'"):
        P["layers.1.mlp.up_proj"]
    with pytest.raises(KeyError, match="lists its 9 names"):
        P["model.layers.1.mlp.down_proj"]                 # bias mode: no dW_out


def test_shared_block_names_carry_the_layer(tmp_path):
    "A block used twice (refused by the self-check, kept with check=False) names each use."
    m = tiny_model("llama", "float64", seed=0)
    m.model.layers[2] = m.model.layers[1]
    P = context_patches(m, ids(1, 6, 0), ids(1, 2, 1), check=False)
    n_parts = sum(len(p.dW) + (p.db_out is not None) + (p.dW_out is not None)
                  + (p.ds_post is not None) for p in P.layers)
    assert len(set(P.keys())) == len(P.keys()) == n_parts
    assert P["model.layers.1.mlp.up_proj[2]"] is P.layers[2].dW[1]
    P.save(tmp_path / "p.safetensors")
    P2 = load_patches(tmp_path / "p.safetensors", m)
    assert all(same_bits(a, b) for a, b in zip(factors(P), factors(P2)))


def test_repr_summarises():
    import statistics
    m = tiny_model("llama", "float64", seed=0)
    P = context_patches(m, ids(2, 6, 0), ids(2, 3, 1))
    r = repr(P)
    assert "tensor(" not in r and max(map(len, r.splitlines())) <= 78   # a page column
    assert "LlamaForCausalLM" in r and "3 layers" in r and "(B, q) = (2, 3)" in r
    assert "positions 6..8" in r and "'rank1'" in r and "float64" in r
    per_pos = sum(len({t.data_ptr() for r1 in p.dW for t in r1}) and (
        sum(r1.u.shape[-1] for r1 in p.dW) + p.dW[0].v.shape[-1]
        + p.dW_out.u.shape[-1] + p.dW_out.v.shape[-1]) for p in P.layers)
    assert f"{per_pos:,} per query position, {per_pos * 6:,} in all" in r
    w = [float(torch.linalg.matrix_norm(torch.cat(
        [r1.dense() for r1 in p.dW], -2)).max()) for p in P.layers]
    assert f"max {max(w):.3g}, median {statistics.median(w):.3g}" in r


def test_one_spelling_per_property():
    m = tiny_model("llama", "float64", seed=0)
    P = context_patches(m, ids(2, 6, 0), ids(2, 3, 1))
    with pytest.warns(DeprecationWarning, match="use HFPatch.positions"):
        assert P.position_ids is P.positions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert P.positions.shape == P.shape == (2, 3)
    from icl_book.compress import Compressed
    from icl_book.deep import BlockPatch, DeepPatch
    from icl_book.hf import HFPatch
    from icl_book.hf_checks import LayerPatch
    from icl_book.thought import ThoughtPatch
    for cls in (HFPatch, LayerPatch, DeepPatch, BlockPatch, ThoughtPatch, Compressed):
        assert callable(getattr(cls, "numel")), cls     # a method, as on a tensor
    for cls in (HFPatch, DeepPatch):
        assert isinstance(cls.shape, property), cls


def test_pickle_refused_deepcopy_kept():
    m = tiny_model("llama", "float64", seed=0)
    x = ids(1, 2, 1)
    P = context_patches(m, ids(1, 6, 0), x)
    with pytest.raises(TypeError, match=r"P.save\(path\).*load_patches\(path, model\)"):
        pickle.dumps(P)
    Q = copy.deepcopy(P)
    assert Q.layers[0].dW[0].u is not P.layers[0].dW[0].u
    assert torch.equal(patched_out(m, Q, x), patched_out(m, P, x))
    Q.layers[0].dW[0].u.zero_()                          # the copy is its own
    assert not torch.equal(patched_out(m, Q, x), patched_out(m, P, x))
    with pytest.raises(ValueError, match="another model object"):
        patched(tiny_model("llama", "float64", seed=0), Q).__enter__()


def test_prefix_patches_are_named_like_context_patches(tmp_path):
    from icl_book.lm_dynamics import prefix_patches
    m = tiny_model("llama", "float64", seed=0)
    C, x = ids(1, 5, 0), ids(1, 2, 1)
    P = prefix_patches(m, C, x)
    assert P.keys() == context_patches(m, C, x).keys()
    assert P["model.layers.0.mlp.up_proj"] is P.layers[0].dW[1]
    with pytest.raises(ValueError, match="made without its state"):
        P.save(tmp_path / "p.safetensors")            # no weight state to check


def test_a_patch_saved_by_another_process_loads(tmp_path):
    "The use of a file: saved in one process, loaded in another, bit for bit."
    import subprocess
    import sys
    from pathlib import Path
    f = tmp_path / "p.safetensors"
    code = ("import torch\n"
            "from icl_book.hf import tiny_model, context_patches\n"
            "g = torch.Generator().manual_seed(0)\n"
            "C, x = torch.randint(0, 97, (2, 6), generator=g), "
            "torch.randint(0, 97, (2, 3), generator=g)\n"
            "m = tiny_model('gpt2', 'float64', seed=4)\n"
            f"context_patches(m, C, x).save({str(f)!r})\n")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root,
                   env={**__import__("os").environ, "PYTHONPATH": str(root)})
    g = torch.Generator().manual_seed(0)
    C, x = torch.randint(0, 97, (2, 6), generator=g), torch.randint(0, 97, (2, 3), generator=g)
    m = tiny_model("gpt2", "float64", seed=4)
    P = context_patches(m, C, x)
    P2 = load_patches(f, m)
    assert all(same_bits(a, b) for a, b in zip(factors(P), factors(P2)))
    assert torch.equal(patched_out(m, P2, x), patched_out(m, P, x))
    with pytest.raises(ValueError, match="weights differ"):
        load_patches(f, tiny_model("gpt2", "float64", seed=5))


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)                               # BertModel + pooler
    m = transformers.BertModel(tiny_model("bert").config).double().eval()
    assert m.pooler is not None
    g = torch.Generator().manual_seed(0)
    C, x = (torch.randint(3, 97, (2, s), generator=g) for s in (6, 3))
    return m, C, x


def test_pooler_output_is_refused_when_read_and_the_rest_stays_exact(bert):
    m, C, x = bert
    with torch.no_grad():
        full = m(torch.cat([C, x], 1)).last_hidden_state[:, 6:]
        p = context_patches(m, C, x)
        with patched(m, p):
            r = m(x)
            t = m(x, return_dict=False)
        outside = m(x)
    assert rel_err(r.last_hidden_state, full) <= 1e-12
    assert rel_err(t[0], full) <= 1e-12
    reads = [lambda: r.pooler_output, lambda: r["pooler_output"].shape,
             lambda: r[1] + 1, lambda: r.to_tuple()[1] * 2,
             lambda: torch.tanh(t[1]), lambda: t[1].shape, lambda: bool(t[1])]
    y = t[1]                             # every operator Python looks up on the class
    reads += [lambda: y[0], lambda: iter(y), lambda: len(y), lambda: float(y),
              lambda: int(y), lambda: y.__array__(), lambda: y + 1, lambda: 1 + y,
              lambda: y - 1, lambda: 1 - y, lambda: y * 2, lambda: 2 * y,
              lambda: y @ full, lambda: full[0] @ y, lambda: y / 2, lambda: 2 / y,
              lambda: -y, lambda: abs(y), lambda: y ** 2]
    for read in reads:
        with pytest.raises(ValueError, match="pooler_output.*position 0"):
            read()
    assert outside.pooler_output.shape == (2, m.config.hidden_size)


def test_the_kv_cache_of_a_patched_call_is_refused_when_used():
    "It holds the query's keys and values only: continuing from it is refused."
    m = tiny_model("llama", "float64", seed=0)
    g = torch.Generator().manual_seed(1)
    C, x = (torch.randint(2, 97, (1, s), generator=g) for s in (6, 2))
    with torch.no_grad():
        full = m(torch.cat([C, x], 1)).logits[:, 6:]
        p = context_patches(m, C, x)
        with patched(m, p):
            r = m(x)                                   # use_cache: the default
            t = m(x, return_dict=False)
        assert rel_err(r.logits, full) <= 1e-10
        for use in (lambda: r.past_key_values.get_seq_length(),
                    lambda: m(x[:, :1], past_key_values=r.past_key_values),
                    lambda: t[1].get_seq_length()):
            with pytest.raises(ValueError, match="6 context positions"):
                use()
        assert m(x).past_key_values.get_seq_length() == 2   # outside: its own
