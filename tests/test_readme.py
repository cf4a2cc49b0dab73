"""The README's example runs and prints what the README says it prints.

Text and plain numbers (shapes, ranks) must match exactly. A number in
scientific notation (`1e-07`: a round-off error, which varies by machine)
must be of the same order of magnitude as the one the example computes:
within a factor of `DECADE` either way, so the README's `1e-07` accepts
`2e-07` or `4e-08`, and refuses `1e-05` or `1e-09`.
"""
import linecache
import math
import os
import re
import subprocess
import sys
import warnings

import pytest

from conftest import ROOT

SCI = re.compile(r"[-+]?\d(?:\.\d+)?e[-+]\d+")
DECADE = 10.0   # how far a printed round-off may drift between machines


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _examples():
    "Each ```python block of the README with the ```text block that follows it."
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```.*?```text\n(.*?)```", text, re.S)


def same_order(got: float, want: float, factor: float = DECADE) -> bool:
    "`got` within a factor `factor` of `want` (both zero, or of one sign)."
    if got == want: return True
    if got == 0 or want == 0 or (got > 0) != (want > 0): return False
    return abs(math.log10(got / want)) <= math.log10(factor)


def line_mismatch(printed: str, claimed: str) -> str | None:
    "Why `printed` is not the README's `claimed` line, or None when it is."
    if SCI.split(printed) != SCI.split(claimed):
        return f"printed {printed!r}, the README says {claimed!r}"
    for got, want in zip(SCI.findall(printed), SCI.findall(claimed)):
        if not same_order(float(got), float(want)):
            return (f"printed {got} where the README says {want} (more than a "
                    f"factor {DECADE:g} apart) in {claimed!r}")
    return None


def output_mismatches(printed: str, claimed: str) -> list:
    "Every line where the printed output is not what the README claims."
    p, c = printed.splitlines(), claimed.splitlines()
    bad = [m for a, b in zip(p, c) if (m := line_mismatch(a, b))]
    if len(p) != len(c):
        bad.append(f"{len(p)} lines printed, the README shows {len(c)}: {p}")
    return bad


def test_readme_has_its_examples():
    assert len(_examples()) == 2 == len(_blocks("python")), \
        "every ```python block of the README is followed by the ```text it prints"


def test_readme_claims_numbers():
    "What the order-of-magnitude rule applies to: the README's round-off figures."
    claimed = [SCI.findall(text) for _, text in _examples()]
    assert all(claimed), f"an example's output claims no number: {claimed}"


@pytest.mark.parametrize("printed,claimed,ok", [
    ("1e-07", "1e-07", True), ("2e-07", "1e-07", True), ("9e-08", "1e-07", True),
    ("1e-05", "1e-07", False), ("1e-09", "1e-07", False), ("2e-06", "1e-07", False),
    ("0e+00", "1e-07", False), ("-1e-07", "1e-07", False),
    ("torch.Size([1, 32]) 1", "torch.Size([1, 32]) 1", True),
    ("torch.Size([1, 32]) 2", "torch.Size([1, 32]) 1", False),
    ("' Rome.\\n'", "' Paris.\\n'", False)])
def test_line_comparison(printed, claimed, ok):
    "The rule itself: text exact, round-off within one order of magnitude."
    assert (line_mismatch(printed, claimed) is None) == ok


def test_output_comparison_counts_lines():
    assert output_mismatches("1e-07\n", "1e-07\nx\n")
    assert not output_mismatches("3e-07\n' Rome.'", "1e-07\n' Rome.'")


@pytest.mark.parametrize("i", range(2))
def test_readme_example_output(i):
    code, expected = _examples()[i]
    if "load_pretrained" in code:
        from icl_book.weights import missing
        if missing("smollm2"):
            pytest.skip(missing("smollm2"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env).stdout
    bad = output_mismatches(out, expected)
    assert not bad, "README example %d:\n%s" % (i + 1, "\n".join(bad))


# The routes a model may be held in: the README's five-line example of each
# is generated from ROUTES, and each is run here with the check after it.
ROUTES = {
    "a `transformers` model": '''\
from icl_book.hf import context_patches, patched, tiny_model
model = tiny_model('llama', 'float64')     # or AutoModelForCausalLM...
P = context_patches(model, context_ids, query_ids)
with patched(model, P):
    logits = model(query_ids).logits       # the query alone, with context
''',
    "a PEFT model with LoRA adapters": '''\
from peft import LoraConfig, get_peft_model
lora = LoraConfig(target_modules=['gate_proj', 'up_proj'], init_lora_weights=False)
model = get_peft_model(tiny_model('llama', 'float64'), lora).eval()
P = context_patches(model, context_ids, query_ids)   # adapters included
with patched(model, P): logits = model(query_ids).logits
''',
    "an nnsight `LanguageModel`": '''\
from nnsight import LanguageModel
lm = LanguageModel(tiny_model('llama', 'float64'), tokenizer=tokenizer)
P = context_patches(lm, context_ids, query_ids)     # the model inside
with patched(lm, P), lm.trace(query_ids):
    logits = lm.output.logits.save()
''',
    "a TransformerLens `TransformerBridge` around a `transformers` model": '''\
from transformer_lens.model_bridge import TransformerBridge
bridge = TransformerBridge.boot_transformers('tiny', tokenizer=tokenizer,
    hf_model=tiny_model('llama', 'float64'), dtype=torch.float64)
P = context_patches(bridge, context_ids, query_ids)
with patched(bridge, P): logits = bridge(query_ids)   # hooks see it too
''',
    "a native TransformerLens `TransformerBridge` (`boot_native`)": '''\
from transformer_lens.config import TransformerBridgeConfig as Config
from transformer_lens.model_bridge import TransformerBridge
bridge = TransformerBridge.boot_native(Config(d_model=16, n_layers=2, n_ctx=32,
    d_head=4, n_heads=4, d_vocab=97, normalization_type='RMS'), dtype=torch.float64).eval()
P = context_patches(bridge, context_ids, query_ids)
with patched(bridge, P): logits, cache = bridge.run_with_cache(query_ids)
''',
}
_NEEDS = {"PEFT": "peft", "nnsight": "nnsight", "TransformerLens": "transformer_lens"}
ROUTES_BEGIN = "<!-- routes: generated by tests/test_readme.py -->"
ROUTES_END = "<!-- /routes -->"


def routes_block() -> str:
    "The README's block of routes, from ROUTES."
    return "\n\n".join(f"{name}:\n\n```py\n{code}```" for name, code in ROUTES.items())


def _route_setup() -> dict:
    "What the examples read: torch, ids, an offline word-level tokenizer."
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from icl_book.hf import context_patches, patched, tiny_model
    vocab = {str(i): i for i in range(97)} | {'[UNK]': 97}
    tok = PreTrainedTokenizerFast(unk_token='[UNK]', tokenizer_object=Tokenizer(
        models.WordLevel(vocab, unk_token='[UNK]')))
    tok.init_kwargs.update(name_or_path='tiny', add_bos_token=True)
    g = torch.Generator().manual_seed(0)
    return dict(torch=torch, tiny_model=tiny_model, tokenizer=tok,
                context_patches=context_patches, patched=patched,
                context_ids=torch.randint(0, 97, (2, 9), generator=g),
                query_ids=torch.randint(0, 97, (2, 3), generator=g))


@pytest.mark.parametrize("name", list(ROUTES))
def test_route_example_is_exact(name):
    """Each route's example runs (on the README's ids and tokenizer, with
    the first example's imports) and its logits are the with-context run's at the query, <= 1e-10."""
    for key, module in _NEEDS.items():
        if key in name: pytest.importorskip(module)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')    # LanguageModel's deprecation notice
        ns = _route_setup()
        code, fn = ROUTES[name], f"<README route: {name}>"
        linecache.cache[fn] = (len(code), None, code.splitlines(True), fn)
        exec(compile(code, fn, "exec"), ns)    # nnsight reads the source back
    torch, C, x = ns['torch'], ns['context_ids'], ns['query_ids']
    model = next(ns[k] for k in ('model', 'lm', 'bridge') if k in ns)
    with torch.no_grad():
        if 'lm' in ns:
            with model.trace(torch.cat([C, x], 1)):
                full = model.output.logits.save()
        else:
            r = model(torch.cat([C, x], 1))
            full = r.logits if hasattr(r, 'logits') else r
    from icl_book.core import rel_err
    assert rel_err(ns['logits'], full[:, C.shape[1]:]) <= 1e-10


def test_readme_lists_the_routes():
    text = (ROOT / "README.md").read_text()
    assert ROUTES_BEGIN in text and ROUTES_END in text, "the README has no routes block"
    block = text.split(ROUTES_BEGIN)[1].split(ROUTES_END)[0].strip()
    assert block == routes_block(), (
        "README's routes are outdated: paste routes_block() of "
        "tests/test_readme.py between its markers")
