"""The package's top level (`import icl_book as icl`, nbs/29_front.ipynb):
lazy names, one verb for every kind of model, docstrings whose examples run."""
import doctest
import inspect
import json
import subprocess
import sys

import pytest
import torch

import icl_book as icl
from conftest import ROOT
from fastcore.docments import docments
from icl_book.blocks import PreLNBlock, PreLNStack, StackConfig, make_block
from icl_book.core import rel_err
from icl_book.deep import LMConfig, TinyLM
from icl_book.weights import missing

VERBS = ["context_patches", "patched", "load_patches", "patch_errors",
         "generate_without_context", "token_updates", "supported"]


def run(code: str) -> str:
    "stdout of `code` in a fresh interpreter using this checkout."
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                      "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_import_is_lazy_and_toy_models_never_import_transformers():
    out = json.loads(run(
        "import sys, json\nimport icl_book as icl\n"
        "heavy = lambda: [m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]\n"
        "a = heavy(); names = dir(icl)\n"
        "import torch\nfrom icl_book.blocks import PreLNStack, StackConfig\n"
        "s = PreLNStack(StackConfig(depth=2, d_model=8, heads=2, d_mlp=16, dtype='float64'))\n"
        "C, x = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 2, 8, dtype=torch.float64)\n"
        "with icl.patched(s, icl.context_patches(s, C, x)): s(x)\n"
        "print(json.dumps(dict(bare=a, names=names, toy=heavy())))"))
    assert out["bare"] == [], out          # import icl_book: nothing heavy
    assert out["toy"] == ["torch"], out    # a toy model: torch only
    assert set(icl.__all__) <= set(out["names"])


def test_at_most_15_top_level_names_each_resolving():
    assert len(icl.__all__) <= 15
    for n in icl.__all__:
        assert getattr(icl, n) is not None, n
    with pytest.raises(AttributeError, match="top-level names"):
        icl.prefix_updates


# fit_adapter fits a patch on a real LM (seconds to minutes): its library chapter (24_compress) runs it instead
EXAMPLES = [n for n in icl.__all__ if callable(getattr(icl, n))
            and n not in ("fit_adapter", "Compressed")]


@pytest.mark.parametrize("name", EXAMPLES)
def test_docstring_examples_run(name):
    "Every top-level callable's docstring holds an example, and it runs as written."
    if name == "load_pretrained" and missing("smollm2"):
        pytest.skip(missing("smollm2"))
    f = getattr(icl, name)
    tests = doctest.DocTestFinder(recurse=False).find(f, name, globs={})
    examples = sum(len(t.examples) for t in tests)
    assert examples >= 2, f"{name}: no example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests: runner.run(t)
    assert runner.failures == 0, f"{name}: {runner.failures} example(s) failed"


@pytest.mark.parametrize("name", VERBS)
def test_verbs_document_every_parameter(name):
    f = inspect.unwrap(getattr(icl, name))
    docs = docments(f, full=True)
    kinds = {p: v.kind for p, v in inspect.signature(f).parameters.items()}
    bare = [p for p, d in docs.items() if p != "return" and not d["docment"]
            and not (kinds[p] == inspect.Parameter.VAR_KEYWORD and f"`{p}`" in f.__doc__)]
    assert not bare, f"{name}: parameters without a comment: {bare}"
    assert len(f.__doc__.split()) > 30, f"{name}: a one-line docstring"


def models():
    "One model of each kind the verbs take, in float64, with a context and query."
    g = torch.Generator().manual_seed(1)
    feats = lambda B, T, d: torch.randn(B, T, d, generator=g, dtype=torch.float64)
    toks = lambda B, T: torch.randint(1, 50, (B, T), generator=g)
    cut = lambda C: (lambda y: y[:, C.shape[1]:])
    return {
        "block": (make_block("softmax", d=8, d_hidden=16, seed=2), feats(2, 5, 8), feats(2, 2, 8),
                  lambda m, C, x: m(C[:, :0], x), lambda m, C, x: m(C, x)),
        "preln": (PreLNBlock(8, heads=2, d_mlp=16).double(), feats(2, 5, 8), feats(2, 2, 8),
                  lambda m, C, x: m(x), lambda m, C, x: cut(C)(m(torch.cat([C, x], 1)))),
        "stack": (PreLNStack(StackConfig(depth=2, d_model=8, heads=2, d_mlp=16, dtype="float64")),
                  feats(2, 5, 8), feats(2, 2, 8),
                  lambda m, C, x: m(x), lambda m, C, x: cut(C)(m(torch.cat([C, x], 1)))),
        "tinylm": (TinyLM(LMConfig(depth=2, d_model=8, heads=2, d_mlp=16, vocab=50, n_pos=16,
                                   dtype="float64")), toks(2, 5), toks(2, 2),
                   lambda m, C, x: m(x), lambda m, C, x: cut(C)(m(torch.cat([C, x], 1)))),
        "llama": (icl.tiny_model("llama", "float64", seed=0, layers=2, d=16), toks(2, 5), toks(2, 2),
                  lambda m, C, x: m(x).logits,
                  lambda m, C, x: cut(C)(m(torch.cat([C, x], 1)).logits)),
    }


def snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", list(models()))
@pytest.mark.parametrize("mode", ["rank1", "bias"])
def test_one_verb_exact_on_every_kind(kind, mode):
    m, C, x, alone, full = models()[kind]
    with torch.no_grad():
        ref, before = full(m, C, x), snapshot(m)
        assert rel_err(alone(m, C, x), ref) > 1e-3        # the context matters
        P = icl.context_patches(m, C, x, mode)
        with icl.patched(m, P) as got:
            assert got is m
            assert rel_err(alone(m, C, x), ref) <= 1e-10
        assert same(before, snapshot(m))
        assert rel_err(alone(m, C, x), ref) > 1e-3        # the hooks are gone


@pytest.mark.parametrize("kind", list(models()))
def test_inplace_writes_and_restores_bits_even_on_exceptions(kind):
    m, C, x, alone, full = models()[kind]
    C, x = C[:1], x[:1, -1:]
    with torch.no_grad():
        ref, before = full(m, C, x), snapshot(m)
        P = icl.context_patches(m, C, x)
        with icl.patched(m, P, inplace=True):
            assert not same(before, snapshot(m))
            assert rel_err(alone(m, C, x), ref) <= 1e-10
        assert same(before, snapshot(m))
        with pytest.raises(RuntimeError, match="boom"):
            with icl.patched(m, P, inplace=True):
                raise RuntimeError("boom")
        assert same(before, snapshot(m))


def test_default_mode_is_one_for_every_verb():
    for n in ("context_patches", "patch_errors", "generate_without_context"):
        assert inspect.signature(getattr(icl, n)).parameters["mode"].default == "rank1"
    m, C, x, *_ = models()["stack"]
    assert icl.context_patches(m, C, x).mode == "rank1"   # deep's own default is 'bias'


class FakeTokenizer:
    "Token ids by character, a start token 1 with the special tokens."
    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = ([1] if add_special_tokens else []) + [2 + ord(c) % 40 for c in text]
        return type("Enc", (), {"input_ids": torch.tensor([ids])})()


def test_strings_need_a_tokenizer_and_use_it():
    m = icl.tiny_model("llama", "float64", seed=0, layers=2, d=16)
    with pytest.raises(TypeError, match="tokenizer=tok"):
        icl.context_patches(m, "France: Paris.", " Italy:")
    tok = FakeTokenizer()
    P = icl.context_patches(m, "France: Paris.", " Italy:", tokenizer=tok)
    C, x = tok("France: Paris.").input_ids, tok(" Italy:", add_special_tokens=False).input_ids
    assert P.start == C.shape[1] and torch.equal(P.query_ids, x)
    Q = icl.context_patches(m, C, x)
    assert torch.equal(P.layers[0].dW[0].u, Q.layers[0].dW[0].u)


def test_supported_names_the_reason():
    for kind, (m, *_) in models().items():
        assert icl.supported(m) is None, kind
    assert "neither a toy block" in icl.supported(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"icl.supported\(model\)"):
        icl.context_patches(torch.nn.Linear(2, 2), torch.zeros(1, 2, 2), torch.zeros(1, 1, 2))


@pytest.mark.parametrize("kind", ["stack", "llama"])
def test_load_patches_dispatches_and_refuses_other_weights(kind, tmp_path):
    m, C, x, alone, full = models()[kind]
    P = icl.context_patches(m, C, x)
    P.save(tmp_path / "p.safetensors")
    Q = icl.load_patches(tmp_path / "p.safetensors", m)
    assert type(Q) is type(P)
    first = lambda R: R.layers[1].dW if kind == "stack" else R.layers[1].dW[0]
    assert torch.equal(first(Q).u, first(P).u) and torch.equal(first(Q).v, first(P).v)
    with torch.no_grad():
        ref = full(m, C, x)
        with icl.patched(m, Q):
            assert rel_err(alone(m, C, x), ref) <= 1e-10
    twin = models()[kind][0]
    with torch.no_grad():
        next(twin.parameters()).add_(1e-3)
    with pytest.raises(ValueError, match="differ"):
        icl.load_patches(tmp_path / "p.safetensors", twin)


def test_a_stack_patch_holds_for_its_own_query_only():
    m, C, x, *_ = models()["tinylm"]
    P = icl.context_patches(m, C, x)
    with pytest.raises(ValueError, match="another query"):
        with torch.no_grad(), icl.patched(m, P):
            m(x.flip(1))


def test_hf_serves_at_most_12_names():
    import icl_book.hf as hf
    assert len(hf.__all__) <= 12
    assert {"context_patches", "patched", "patch_errors", "token_updates",
            "generate_without_context", "load_patches"} <= set(hf.__all__)


@pytest.mark.skipif(missing("smollm2") is not None, reason=str(missing("smollm2")))
def test_load_pretrained_says_once_where_it_caches_and_accepts_half_precision(tmp_path):
    "From a fresh cache: the conversion and the bytes written, then nothing more in that process."
    code = ("import icl_book as icl, torch\n"
            "m, _ = icl.load_pretrained('smollm2')\n"
            "h, _ = icl.load_pretrained('smollm2', 'bfloat16')\n"
            "assert next(h.parameters()).dtype == torch.bfloat16\n"
            "assert next(m.parameters()).dtype == torch.float32\n")
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "ICL_BOOK_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    said = [l for l in r.stderr.splitlines() if l.startswith("icl_book.load_pretrained:")]
    assert len(said) == 2, r.stderr                       # converting ..., wrote ... MB
    assert "4-bit" in said[0] and str(tmp_path) in said[0]
    written = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert f"wrote {written / 1e6:.0f} MB" in said[1], (said, written)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    said = [l for l in r.stderr.splitlines() if l.startswith("icl_book.load_pretrained:")]
    assert not said, r.stderr                  # a cached copy is read quietly
