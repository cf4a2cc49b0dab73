"""icl_book.hf_checks: inside `patched`, a bare encoder's pooled vector reads
position 0 of the [context, query] run, a context token: it is refused when
read — attribute, key, tuple slot, or any use — with the position named, never
None or a wrong vector; last_hidden_state stays exact."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from icl_book.core import rel_err  # noqa: E402
from icl_book.families import tiny_model  # noqa: E402
from icl_book.hf import context_patches, patched  # noqa: E402


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
