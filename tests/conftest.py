"""Shared fixtures: the repository root and the project's command-line tools."""
import os
import shutil
import sys
import threading
from pathlib import Path

import subprocess

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    "Path of a console script installed next to the running Python."
    p = BIN / name
    return str(p) if p.exists() else shutil.which(name) or name


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def pytest_addoption(parser):
    parser.addoption("--device", action="store", default="cpu", choices=("cpu", "cuda"),
                     help="where the device tests run: cpu (default) or cuda; the tests "
                          "marked `cuda` run only with --device cuda on a machine with CUDA")


def pytest_configure(config):
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def cuda_skip_reason(device: str, available: bool):
    "Why a test marked `cuda` does not run with `--device device`, or None when it runs."
    if device != "cuda":
        return "needs --device cuda (the tests ran with --device cpu)"
    if not available:
        return "--device cuda, but torch.cuda.is_available() is False on this machine"
    return None


# fixtures that imply a marker: `-m "not book"` runs everything but the book build
FIXTURE_MARKS = {"book": "book", "smollm2": "hf"}


def pytest_collection_modifyitems(config, items):
    for it in items:
        for fixture, mark in FIXTURE_MARKS.items():
            if fixture in getattr(it, "fixturenames", ()):
                it.add_marker(getattr(pytest.mark, mark))
    # the book's tests last (its build runs beside the others: pytest_collection_finish)
    books = [it for it in items if "book" in getattr(it, "fixturenames", ())]
    if books and not config.option.collectonly:
        late = set(map(id, books))
        items[:] = [it for it in items if id(it) not in late] + books
    cuda = [it for it in items if it.get_closest_marker("cuda")]
    if not cuda: return
    device = config.getoption("--device")
    available = False
    if device == "cuda":
        import torch
        available = torch.cuda.is_available()
    why = cuda_skip_reason(device, available)
    if why:
        for it in cuda: it.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def device(request) -> str:
    "The device the tests were asked to run on (`--device`): 'cpu' or 'cuda'."
    d = request.config.getoption("--device")
    if d == "cuda":
        import torch
        if not torch.cuda.is_available():
            pytest.skip(cuda_skip_reason(d, False))
    return d


def toc_files():
    "Documents listed in _toc.yml, root first (paths without suffix)."
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    def add(entries):                   # a chapter, then the sections under it
        for c in entries:
            files.append(c["file"]); add(c.get("sections", []))
    for part in toc.get("parts", []):
        add(part["chapters"])
    return files


_BUILD = {}     # the book build started in the background: its process and log file


def start_book_build():
    """Start `jupyter-book build --all -W -n --keep-going .` in the background, once.

    It runs while the tests that do not need it run (the `book` tests run last,
    see `pytest_collection_modifyitems`): on two cores the build and the other
    tests each get one, with one BLAS thread each (ICL_BOOK_BACKGROUND=0: build
    in the foreground when the first `book` test asks for it)."""
    if _BUILD or os.environ.get("ICL_BOOK_REUSE_BUILD") == "1": return
    import tempfile
    if not (ROOT / "_vendor").exists():
        subprocess.run(["bash", str(ROOT / "tools/vendor.sh")], check=True)
    log = tempfile.TemporaryFile(mode="w+")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    # on a fresh machine the first load converts SmolLM2 and says so on stderr:
    # done here, so that no chapter's output carries that one-time message
    subprocess.run([sys.executable, "-c", "from icl_book.weights import load_pretrained, "
                    "missing\nmissing('smollm2') or load_pretrained('smollm2')"],
                   cwd=ROOT, env=env, capture_output=True)
    _BUILD.update(log=log, proc=subprocess.Popen(
        [tool("jupyter-book"), "build", "--all", "-W", "-n", "--keep-going", "."],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, preexec_fn=_die_with_parent))
    _kill_build_on_sigterm()


def _die_with_parent():
    "In the build's process: Linux sends it SIGKILL when pytest dies (even by SIGKILL)."
    import ctypes, signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):        # not Linux: sessionfinish still kills it
        pass


def _kill_build(wait=True):
    """Kill the build and its kernels (its own process group); wait for it, except
    inside a signal handler (the interrupted code may hold Popen.wait's lock)."""
    proc = _BUILD.get("proc")
    if proc is not None and proc.returncode is None:
        import signal
        try: os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError: pass
        if wait: proc.wait()


def _kill_build_on_sigterm():
    "A SIGTERM to pytest (a CI timeout, `kill`) takes the background build with it."
    import signal
    if threading.current_thread() is not threading.main_thread(): return
    old = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        _kill_build(wait=False)
        signal.signal(signal.SIGTERM, old if callable(old) or old == signal.SIG_IGN
                      else signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)          # then die as pytest would have
    signal.signal(signal.SIGTERM, on_term)


def pytest_collection_finish(session):
    "Start the book build now if a selected test needs it (after -m/-k deselection)."
    if session.config.option.collectonly or os.environ.get("ICL_BOOK_BACKGROUND", "1") == "0":
        return
    if any("book" in getattr(it, "fixturenames", ()) for it in session.items):
        start_book_build()
        import torch
        _BUILD["threads"] = torch.get_num_threads()
        torch.set_num_threads(1)                      # one core each


def pytest_runtest_setup(item):
    "The build's core is free again once it has finished: give torch both back."
    proc = _BUILD.get("proc")
    if "threads" in _BUILD and proc is not None and proc.poll() is not None:
        import torch
        torch.set_num_threads(_BUILD.pop("threads"))


def pytest_sessionfinish(session, exitstatus):
    _kill_build()                                   # stopped early (-x, Ctrl-C)


@pytest.fixture(scope="session")
def book():
    """Build the whole book once per session (--all): every notebook is executed (force,
    raise_on_error) and warnings are errors. Returns (return code, build log)."""
    log_file, rc_file = ROOT / "_build" / "build.log", ROOT / "_build" / "build.rc"
    if os.environ.get("ICL_BOOK_REUSE_BUILD") == "1":   # local reruns of the HTML checks:
        if not rc_file.exists():                        # the last build's own result
            pytest.fail("ICL_BOOK_REUSE_BUILD=1 but no recorded build: build once without it")
        return int(rc_file.read_text()), log_file.read_text()
    start_book_build()
    rc = _BUILD["proc"].wait()
    if "threads" in _BUILD:                           # the build's core is free again
        import torch
        torch.set_num_threads(_BUILD.pop("threads"))
    _BUILD["log"].seek(0); log = _BUILD["log"].read()
    (ROOT / "_build").mkdir(exist_ok=True)
    log_file.write_text(log); rc_file.write_text(str(rc))
    return rc, log


@pytest.fixture(scope="session")
def smollm2():
    "(model, tokenizer) of the offline SmolLM2 weights, loaded once per session."
    from icl_book.weights import load_pretrained
    return load_pretrained("smollm2")


def exec_data(doc):
    "myst-nb's record of executing `doc` in the last book build (or None)."
    import pickle
    env = ROOT / "_build" / ".doctrees" / "environment.pickle"
    if not env.exists():
        return None
    with open(env, "rb") as f:
        meta = getattr(pickle.load(f), "nb_metadata", {})
    return (meta.get(doc) or {}).get("exec_data")


# --- helpers shared by the transformers tests (test_hf.py, test_families.py)
def model_output(model, ids, **kw):
    "Logits of a causal LM, last hidden states of an encoder."
    import torch
    with torch.no_grad():
        r = model(ids, **kw)
    return r.logits if hasattr(r, "logits") else r.last_hidden_state


def random_ids(B, T, seed, vocab=97, low=0):
    "Token ids (B, T) in low..vocab-1 from a seeded generator."
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (B, T), generator=g)


def snapshot(model):
    "A copy of every tensor of the model's state, to compare after a patch."
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt, as in an interactive Python.

    A shell starts a background job (`make test &`, CI runners, nohup) with
    SIGINT ignored, and Python then keeps it ignored: the tests that emulate a
    Ctrl-C through the installed SIGINT handler would call SIG_IGN."""
    import signal
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        old = signal.signal(signal.SIGINT, signal.default_int_handler)
        yield
        signal.signal(signal.SIGINT, old)
    else:
        yield


def dense_steps(ad, patches, part):
    "(n, L) steps of the measured maps, from dense matrices per prefix."
    import torch
    from icl_book.lm_dynamics import PARTS
    assert set(PARTS) == {"first", "last", "post"}
    rows, prev = [], None
    for p in patches:
        now = []
        for l, lp in enumerate(p.layers):
            pl, lay = part if isinstance(part, str) else part[l], ad.layers[l]
            if pl == "first":
                mats = [torch.outer(r.u[0, -1], r.v[0, -1]) for r in lp.dW]
            elif pl == "last":
                mats = [torch.outer(lp.dW_out.u[0, -1], lp.dW_out.v[0, -1])]
            else:
                s = (lay.family or ad.family).post_offset + lay.post.weight
                mats = [lp.ds_post[0, -1] * s]
            now.append(mats)
        rows.append(torch.stack([
            sum(((a - (b if prev else 0)) ** 2).sum()
                for a, b in zip(now[l], (prev or now)[l])).sqrt()
            for l in range(len(now))]))
        prev = now
    return torch.stack(rows)


# --- float64 eager attention and patch comparison (test_lm_dynamics.py, test_zoo.py)
def eager64(module, query, key, value, attention_mask, dropout=0.0,
            scaling=None, softcap=None, **kw):
    "Eager attention with its softmax in the inputs' dtype."
    import torch
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    s = query @ k.transpose(2, 3) * (module.head_dim ** -0.5
                                     if scaling is None else scaling)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is not None:
        s = s + attention_mask
    w = s.softmax(-1)
    return (w @ v).transpose(1, 2).contiguous(), w


def register_eager64():
    "Register `eager64` with transformers' attention and mask interfaces (idempotent)."
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    AttentionInterface.register("eager64", eager64)
    AttentionMaskInterface.register("eager64", eager_mask)


def patch_err(P, i, Q, l):
    "Relative error of row i of P's layer-l patch (all parts) against Q's."
    from icl_book.blocks import RankOne
    a, b = P.layers[l], Q.layers[l]
    num = den = 0.
    pairs = list(zip(a.dW, b.dW)) + ([(a.dW_out, b.dW_out)]
                                     if b.dW_out is not None else [])
    for x, y in pairs:
        ra, rb = RankOne(x.u[i], x.v[i]), RankOne(y.u[0], y.v[0])
        num += (ra.diff_norm(rb) ** 2).sum()
        den += (rb.norm() ** 2).sum()
    if b.ds_post is not None:
        num += ((a.ds_post[i] - b.ds_post[0]) ** 2).sum()
        den += (b.ds_post[0] ** 2).sum()
    return (num / den).sqrt().item()
