"""icl_book.families on a PEFT `PeftModel`: the records resolve on the model
inside, a LoRA layer standing for the linear map it adapts; adapters the patch
cannot read (DoRA, other tuner types, prompt learning) are refused with the
remedy, merge_and_unload()."""
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")

from icl_book.families import adapter, linear_weight, tiny_model  # noqa: E402
from icl_book.hf import context_patches  # noqa: E402


def wrap(cfg, arch="llama"):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(tiny_model(arch, "float64"), cfg).eval()


def lora_cfg(**kw):
    return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                           target_modules=["up_proj", "gate_proj"], **kw)


def test_records_resolve_inside_a_peft_model():
    pm = wrap(lora_cfg())
    ad = adapter(pm)
    inner = pm.get_base_model()
    assert ad.base is inner.model and ad.name == type(inner).__name__
    lay = ad.layers[0]
    assert lay.first == (inner.model.layers[0].mlp.gate_proj,
                         inner.model.layers[0].mlp.up_proj)
    assert all(hasattr(m, "lora_A") for m in lay.first)
    W = inner.model.layers[0].mlp.gate_proj.base_layer.weight
    assert linear_weight(lay.first[0]) is W


def test_gpt2_conv1d_with_lora_is_read_in_its_layout():
    cfg = peft.LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights=False,
                          fan_in_fan_out=True)
    ad = adapter(wrap(cfg, "gpt2"))
    m = ad.layers[0].first[0]
    assert type(m.base_layer).__name__ == "Conv1D"
    assert linear_weight(m).shape == (m.base_layer.weight.shape[1],
                                       m.base_layer.weight.shape[0])


@pytest.mark.parametrize("cfg", [
    lambda: lora_cfg(use_dora=True),
    lambda: peft.IA3Config(target_modules=["up_proj", "down_proj"],
                           feedforward_modules=["up_proj"]),
    lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
], ids=["dora", "ia3", "prefix"])
def test_adapters_it_cannot_read_are_refused_naming_the_remedy(cfg):
    pm = wrap(cfg())
    C, x = torch.randint(2, 97, (1, 5)), torch.randint(2, 97, (1, 2))
    for f in (lambda: adapter(pm), lambda: context_patches(pm, C, x)):
        with pytest.raises(TypeError, match=r"merge_and_unload\(\)"):
            f()
