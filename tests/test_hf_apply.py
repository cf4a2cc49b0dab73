"""icl_book.hf_apply on a PEFT `PeftModel`: with active LoRA adapters (on the
MLP's first maps and on attention) the patches are computed against the
effective maps W + s B A and applied beside the adapters (hooks) or written
into the base weight and restored bit for bit; disable_adapter() inside
patched is refused; pooled outputs that read a context position are refused."""
import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")

from icl_book.core import rel_err  # noqa: E402
from icl_book.families import tiny_model  # noqa: E402
from icl_book.hf import context_patches, patched  # noqa: E402

TARGETS = ["up_proj", "gate_proj", "q_proj", "v_proj"]


def lora(m, targets=TARGETS, seed=1, **kw):
    "m wrapped with random LoRA adapters (B != 0), in eval."
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                          init_lora_weights=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(m, cfg).eval()


def ids(n, q, seed=0, vocab=97, B=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(2, vocab, (B, s), generator=g) for s in (n, q))


def errors(pm, C, x, inplace=False):
    "(patched vs the PeftModel's own with-context run, query alone vs it)."
    n = C.shape[1]
    with torch.no_grad():
        ref = pm(input_ids=torch.cat([C, x], 1), use_cache=False).logits[:, n:]
        p = context_patches(pm, C, x)
        with patched(pm, p, inplace=inplace):
            out = pm(input_ids=x, use_cache=False).logits
        alone = pm(input_ids=x, use_cache=False).logits
    return p, rel_err(out, ref), rel_err(alone, ref)


@pytest.mark.parametrize("targets", [TARGETS, ["up_proj", "gate_proj"],
                                     ["q_proj", "v_proj"]])
def test_lora_peft_model_is_exact_in_float64(targets):
    torch.set_num_threads(1)
    pm = lora(tiny_model("llama", "float64", seed=0), targets)
    C, x = ids(6, 3)
    with torch.no_grad(), pm.disable_adapter():    # the adapters matter
        base = pm(input_ids=torch.cat([C, x], 1), use_cache=False).logits
    with torch.no_grad():
        own = pm(input_ids=torch.cat([C, x], 1), use_cache=False).logits
    assert rel_err(own, base) > 1e-3
    p, err, alone = errors(pm, C, x)
    assert max(p.errors) <= 1e-12 and err <= 1e-10, (p.errors, err)
    assert alone > 1e-3


def test_lora_written_into_the_base_weight_is_exact_and_restored():
    torch.set_num_threads(1)
    pm = lora(tiny_model("llama", "float64", seed=2))
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    C, x = ids(5, 1, seed=3)
    p, err, _ = errors(pm, C, x, inplace=True)
    assert err <= 1e-10, err
    after = pm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_disable_adapter_inside_patched_is_refused():
    pm = lora(tiny_model("llama", "float64", seed=0))
    C, x = ids(6, 3)
    p = context_patches(pm, C, x)
    with pytest.raises(ValueError, match="PEFT adapters"):
        with patched(pm, p), pm.disable_adapter():
            pm(input_ids=x, use_cache=False)
    with patched(pm, p):                           # still usable after
        pm(input_ids=x, use_cache=False)


def test_lora_on_smollm2_float32(smollm2):
    torch.set_num_threads(1)
    m, tok = smollm2
    pm = lora(copy.deepcopy(m), seed=4)
    C, x = ids(12, 3, seed=5, vocab=m.config.vocab_size)
    p, err, alone = errors(pm, C, x)
    assert err <= 1e-5 and alone > 1e-2, (err, alone)
