"""`python -m icl_book ...`: the last line is one JSON object; bad input exits 2."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT


def run(*args):
    r = subprocess.run([sys.executable, "-m", "icl_book", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    return r, (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float64", 1e-12)])
def test_verify_headline_configuration(dtype, tol):
    r, res = run("verify", "--layers", "10", "--context", "256", "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    assert res["layers"] == 10 and res["context"] == 256 and res["dtype"] == dtype
    assert 0 < res["max_rel_err"] <= tol


def test_verify_other_settings_are_echoed():
    r, res = run("verify", "--layers", "2", "--context", "8", "--query", "3",
                 "--layer-kind", "gru", "--mode", "rank1", "--seed", "4", "--dtype", "float64")
    assert r.returncode == 0, r.stderr
    assert (res["query"], res["layer_kind"], res["mode"], res["seed"]) == (3, "gru", "rank1", 4)
    assert res["max_rel_err"] <= 1e-12


def test_bench_trajectory_small():
    r, res = run("bench", "trajectory", "--n", "24", "--layers", "2", "--d-model", "16")
    assert r.returncode == 0, r.stderr
    assert res["speedup"] > 0 and res["max_rel_diff"] <= 1e-9 and res["n"] == 24


@pytest.mark.parametrize("args,msg", [
    (["verify", "--layers", "0"], "layers must be a positive integer"),
    (["verify", "--context", "-3"], "context must be a positive integer"),
])
def test_bad_settings_are_an_error_message(args, msg):
    r, _ = run(*args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("claim,keys", [
    ("equivalence", ["layers", "max_rel_err"]),
    ("rnn-convergence", ["attention_late_over_early", "gru_late_over_early",
                         "lstm_late_over_early"]),
    ("thought-patch", ["K", "train_err", "test_err", "no_patch_err"]),
])
def test_reproduce_prints_the_claims_numbers(claim, keys):
    r, res = run("reproduce", claim)
    assert r.returncode == 0, r.stderr
    assert res["claim"] == claim and all(k in res for k in keys)
    if claim == "equivalence":
        assert res["layers"] == 10 and res["max_rel_err"] <= 1e-6
    if claim == "rnn-convergence":
        assert res["attention_late_over_early"] < 0.5 * min(res["gru_late_over_early"],
                                                          res["lstm_late_over_early"])
    if claim == "thought-patch":
        assert len(res["K"]) == len(res["train_err"]) == len(res["test_err"])
        assert res["K"] == sorted(res["K"]) and res["test_err"][-1] < res["no_patch_err"]


@pytest.mark.parametrize("args,msg", [
    (["verify", "--d-model", "1000000"], "needs about"),
    (["verify", "--layers", "100000", "--d-model", "512"], "needs about"),
    (["verify", "--context", str(10**8)], "needs about"),
    (["verify", "--query", str(10**7)], "needs about"),
    (["bench", "trajectory", "--n", str(10**8)], "needs about"),
    (["verify", "--seed", str(2**64)], "seed must be an integer in 0.."),
    (["bench", "trajectory", "--seed", str(2**64)], "seed must be an integer"),
    (["verify", "--heads", "3"], "multiple of heads=3"),
    (["compress", "--task", "antonym", "--seed", str(2**64), "--quiet"],
     "--seed must be an integer in 0.."),          # before SmolLM2 loads
    (["compress", "--task", "antonym", "--budget", "kv/0", "--quiet"],
     "give a number, kv/N or none"),
])
def test_huge_or_bad_sizes_are_one_line_not_a_traceback(args, msg):
    r, _ = run(*args)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and err[-1].count("error") >= 1


def test_reproduce_finetune_alignment_prints_what_the_chapter_computes(monkeypatch, capsys):
    """The CLI's plumbing for chapter 07's claim, in-process: its numbers are
    checked by test_experiments.py and by chapter 07 itself (a minute each)."""
    import icl_book.__main__ as M
    import icl_book.experiments.finetune as F
    calls = []
    monkeypatch.setattr(F, "reproduce_finetune_alignment",
                        lambda: calls.append(1) or {"cosine_median": -0.25, "z": 1.5})
    res = M.main(["reproduce", "finetune-alignment"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert calls == [1] and last == res
    assert res["claim"] == "finetune-alignment"
    assert (res["cosine_median"], res["z"]) == (-0.25, 1.5)


def test_a_sub_commands_own_seconds_are_kept(monkeypatch, capsys):
    import icl_book.__main__ as M

    def add_fake(sub):
        p = sub.add_parser("fake")
        p.set_defaults(run=lambda a: {"seconds": {"stage": 1.5}, "x": 1})

    monkeypatch.setattr(M, "SUBCOMMANDS", M.SUBCOMMANDS + [add_fake])
    res = M.main(["fake"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == res and res["seconds"] == {"stage": 1.5}
    assert isinstance(res["cli_seconds"], float) and res["cli_seconds"] >= 0
    res = M.main(["verify", "--layers", "1", "--context", "4"])   # its own,
    assert 0 <= res["seconds"] <= res["cli_seconds"]            # inside the total

    def add_bare(sub):                                           # none: the total
        sub.add_parser("bare").set_defaults(run=lambda a: {"x": 1})

    monkeypatch.setattr(M, "SUBCOMMANDS", M.SUBCOMMANDS + [add_bare])
    res = M.main(["bare"])
    assert res["seconds"] == res["cli_seconds"] >= 0
