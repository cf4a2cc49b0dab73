"""Patches a user can keep (issue 37): an HFPatch read by parameter name,
summarised by its repr, saved (safetensors + JSON) and loaded bit for bit by
load_patches, which refuses another model; copies and the one spelling of
each property. Tiny random models only."""
import copy
import pickle
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is "
                                   "not installed")

from conftest import model_output as output, random_ids as ids  # noqa: E402
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
    assert "tensor(" not in r and len(r.splitlines()) == 4
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
