"""Publishing: the GitHub workflows run the README's commands, and the
configuration they publish with is one Jupyter Book accepts."""
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, tool

WF = ROOT / ".github" / "workflows"
sys.path.insert(0, str(ROOT / "tools"))
from publish_config import publish_config  # noqa: E402


def _workflow(name):
    wf = yaml.safe_load((WF / name).read_text())
    on = wf.get("on", wf.get(True))              # YAML 1.1 reads the key `on` as True
    steps = [s for job in wf["jobs"].values() for s in job.get("steps", [])]
    return wf, on, steps


def test_test_workflow_runs_make_test():
    wf, on, steps = _workflow("test.yml")
    assert {"push", "pull_request"} <= set(on)
    runs = [s.get("run", "") for s in steps]
    assert "make test" in runs, runs
    assert any("setup-python" in s.get("uses", "") for s in steps)


def test_book_workflow_builds_and_deploys_pages():
    wf, on, steps = _workflow("book.yml")
    assert "push" in on and wf["permissions"]["pages"] == "write"
    runs = [s.get("run", "") for s in steps]
    assert "make book" in runs
    assert any("publish_config.py" in r for r in runs)
    upload = [s for s in steps if "upload-pages-artifact" in s.get("uses", "")]
    assert upload and upload[0]["with"]["path"] == "_build/html"
    assert any("deploy-pages" in s.get("uses", "") for s in steps)


def test_publish_config_sets_launch_buttons():
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    out = publish_config(cfg, "someone/icl_book", "main")
    assert out["repository"]["url"] == "https://github.com/someone/icl_book"
    assert out["launch_buttons"]["binderhub_url"] and out["launch_buttons"]["colab_url"]
    thebe = out["sphinx"]["config"]["thebe_config"]
    assert thebe["repository_url"] == "https://github.com/someone/icl_book"
    assert thebe["repository_branch"] == "main"
    rest = lambda c: {k: v for k, v in c["sphinx"]["config"].items() if k != "thebe_config"}
    assert out["execute"] == cfg["execute"] and rest(out) == rest(cfg)   # nothing else changes
    assert cfg["sphinx"]["config"]["thebe_config"]["repository_url"].endswith("icl-book/icl_book")
    assert cfg["repository"] != out["repository"]                                 # input not mutated
    with pytest.raises(SystemExit, match="OWNER/REPO"):
        publish_config(cfg, "not a repo")


def test_published_config_is_valid_for_jupyter_book(tmp_path):
    for f in ("_config.yml", "_toc.yml"):
        shutil.copy(ROOT / f, tmp_path / f)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "publish_config.py"), "someone/icl_book",
                        "--config", str(tmp_path / "_config.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([tool("jupyter-book"), "config", "sphinx", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    conf = (tmp_path / "conf.py").read_text()
    assert "'repository_url': 'https://github.com/someone/icl_book'" in conf
    assert "mybinder.org" in conf and "colab.research.google.com" in conf


def test_binder_environment():
    post = ROOT / "binder" / "postBuild"
    assert os.access(post, os.X_OK), "binder/postBuild must be executable"
    assert 'pip install --no-cache-dir -e ".[hf]"' in post.read_text()


def test_newest_workflow_tests_the_newest_releases_on_a_schedule():
    wf, on, steps = _workflow("newest.yml")
    assert "schedule" in on and on["schedule"][0]["cron"]
    runs = [s.get("run", "") for s in steps]
    assert "make venv" in runs                          # the locked .venv to compare with
    assert any(r.startswith(".venv/bin/python tools/lock.py newest") for r in runs), runs
