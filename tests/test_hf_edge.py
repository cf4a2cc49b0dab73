"""Edge cases of issue 22 that slipped past the first guards of
icl_book.hf.patched: subclassed and unknown heads, a classifier's padding,
weights written through `.data`, a changed configuration and generation
without a cache. Each gave a silent wrong number (or a misleading message)
before its guard; tiny random float64 models only."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is "
                                   "not installed")

from icl_book.core import rel_err  # noqa: E402
from conftest import model_output as output, random_ids as ids  # noqa: E402
from icl_book.hf import context_patches, patched, tiny_model  # noqa: E402


def full_out(m, C, x, **kw):
    return output(m, torch.cat([C, x], 1), **kw)[:, C.shape[1]:]


def head(arch, cls, *bases):
    "A head of class `cls` (or a user's subclass of it) on a tiny config."
    torch.manual_seed(0)
    c = getattr(transformers, cls)
    if bases: c = type("MyHead", (c,), {})
    return c(tiny_model(arch).config).double().eval()


@pytest.mark.parametrize("arch,cls", [
    ("bert", "BertForSequenceClassification"),         # was an IndexError
    ("roberta", "RobertaForSequenceClassification"),   # silently 1.5
    ("distilbert", "DistilBertForSequenceClassification"),   # 2.0
    ("electra", "ElectraForSequenceClassification")])  # 5.0
def test_subclassed_pooling_heads_are_refused(arch, cls):
    m = head(arch, cls, "sub")
    C, x = ids(1, 6, 0, low=3), ids(1, 3, 1, low=3)
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match=f"MyHead's head \\(a {cls}\\) "
                       "reads position 0"):
        with patched(m, p):
            m(x)


class FirstToken(transformers.BertPreTrainedModel):
    "A user's encoder head that reads position 0 of the last hidden state."
    def __init__(self, cfg):
        super().__init__(cfg)
        self.bert = transformers.BertModel(cfg, add_pooling_layer=False)
        self.post_init()

    def forward(self, input_ids, **kw):
        return self.bert(input_ids, **kw).last_hidden_state[:, 0]


def test_an_unknown_encoder_head_is_refused():
    torch.manual_seed(0)
    m = FirstToken(tiny_model("bert").config).double().eval()
    C, x = ids(1, 6, 0, low=3), ids(1, 3, 1, low=3)
    p = context_patches(m, C, x)
    with pytest.raises(ValueError, match="not one known to read each "
                       "position on its own"):
        with patched(m, p):
            m(x)


def test_electra_discriminator_reads_each_position_and_is_exact():
    m = head("electra", "ElectraForPreTraining")       # was refused
    C, x = ids(2, 6, 0, low=3), ids(2, 3, 1, low=3)
    with torch.no_grad():
        ref = m(torch.cat([C, x], 1)).logits[:, 6:]
        with patched(m, context_patches(m, C, x)):
            got = m(x).logits
    assert rel_err(got, ref) <= 1e-12


def test_causal_classifier_refuses_a_query_of_padding_only():
    cfg = tiny_model("llama").config
    cfg.pad_token_id = 5
    torch.manual_seed(0)
    m = transformers.LlamaForSequenceClassification(cfg).double().eval()
    with torch.no_grad():
        m.model.embed_tokens.weight[5].normal_()       # a trained pad row
    C = ids(1, 7, 0, low=6)
    with torch.no_grad():                              # padding inside: exact
        x = torch.tensor([[5, 7]])
        ref = m(torch.cat([C, x], 1)).logits
        with patched(m, context_patches(m, C, x)):
            assert rel_err(m(x).logits, ref) <= 1e-12
        p = context_patches(m, C, torch.tensor([[5, 5]]))   # 1.6 before
        with pytest.raises(ValueError, match="last token that is not "
                           "padding \\(pad_token_id=5\\)"):
            with patched(m, p):
                pass


def test_weights_written_through_data_are_refused():
    m = tiny_model("llama")
    C, x = ids(1, 6, 0), ids(1, 2, 1)
    p = context_patches(m, C, x)
    w = m.model.layers[1].mlp.up_proj.weight
    w.data.mul_(1.01)                      # no version bump: 6.4e-3 before
    with pytest.raises(ValueError, match="1 weight\\(s\\) .* changed since "
                       "context_patches \\(layers.1.mlp.up_proj.weight\\)"):
        with patched(m, p):
            pass
    w.data.div_(1.01)                      # not bit for bit the old weight
    with pytest.raises(ValueError, match="changed since context_patches"):
        with patched(m, p):
            pass
    p = context_patches(m, C, x)           # recomputed: exact again
    full = full_out(m, C, x)
    with patched(m, p):
        assert rel_err(output(m, x), full) <= 1e-10


@pytest.mark.parametrize("inplace", [False, True])
def test_data_writes_inside_an_open_block_are_refused_on_leaving_it(inplace):
    """The check at each call reads counters and addresses only (a forward
    pass's worth of byte sums per call was the cost): a write through `.data`
    between two calls is not seen by the second call, as 11ac says, and is
    refused when the block is left."""
    m = tiny_model("llama")
    C, x = ids(1, 6, 0), ids(1, 1, 1)
    p, full = context_patches(m, C, x), full_out(m, C, x)
    w = m.model.layers[0].mlp.down_proj.weight
    with pytest.raises(ValueError, match="changed inside patched\\(...\\) "
                       "through .data \\(layers.0.mlp.down_proj.weight\\)"):
        with patched(m, p, inplace=inplace):
            assert rel_err(output(m, x), full) <= 1e-10
            w.data.mul_(1.01)              # no version bump
            assert rel_err(output(m, x), full) > 1e-4   # not seen per call
            w.data.div_(1.01)              # not bit for bit the old weight


def test_a_normal_in_place_write_inside_an_open_block_is_refused_at_the_call():
    "torch's counter sees it: the next call is refused, leaving is not."
    m = tiny_model("llama")
    C, x = ids(1, 6, 0), ids(1, 1, 1)
    p = context_patches(m, C, x)
    w = m.model.layers[0].mlp.down_proj.weight
    with patched(m, p):
        output(m, x)
        with torch.no_grad():
            w.mul_(1.01)
        with pytest.raises(ValueError, match="changed inside patched"):
            output(m, x)


def test_a_data_write_with_no_call_after_entering_is_not_refused_on_leaving():
    "No output was computed inside the block, so none can be wrong."
    m = tiny_model("llama")
    p = context_patches(m, ids(1, 6, 0), ids(1, 1, 1))
    with patched(m, p):
        m.model.layers[0].mlp.down_proj.weight.data.mul_(1.01)
    with pytest.raises(ValueError, match="changed since context_patches"):
        with patched(m, p):
            pass


def test_a_changed_configuration_is_refused():
    m = tiny_model("mistral", sliding_window=4)
    C, x = ids(1, 6, 0), ids(1, 6, 1)
    full = full_out(m, C, x)
    p = context_patches(m, C, x)
    m.config.sliding_window = 2                        # silently 0.45 before
    with pytest.raises(ValueError, match="configuration changed since "
                       "context_patches \\(sliding_window\\)"):
        with patched(m, p):
            pass
    m.config.sliding_window = 4
    impl = m.config._attn_implementation
    with patched(m, p):
        m.config._attn_implementation = "eager" if impl != "eager" else "sdpa"       # 9e-8 before
        with pytest.raises(ValueError, match="configuration changed inside "
                           "patched.*attn_implementation"):
            output(m, x)
        m.config._attn_implementation = impl
        assert rel_err(output(m, x), full) <= 1e-10


def test_generate_without_a_cache_inside_patched_says_what_to_use():
    m = tiny_model("llama", "float32")
    C, x = ids(1, 6, 0), ids(1, 2, 1)
    with patched(m, context_patches(m, C, x)):
        with pytest.raises(ValueError, match="generate_without_context"):
            m.generate(x, max_new_tokens=2, do_sample=False, use_cache=False)
    assert "generate" not in vars(m)                   # the method is back
    assert m.generate(x, max_new_tokens=1, do_sample=False).shape == (1, 3)
