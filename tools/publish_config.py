"""Point the book's repository, Binder, Colab and Thebe settings at a GitHub repository.

The committed `_config.yml` builds offline and shows no launch buttons; the
publishing workflow (.github/workflows/book.yml) runs

    python tools/publish_config.py OWNER/REPO [--branch main]

in its checkout before `make book`, so the published pages link the repository
they were built from.  It rewrites `_config.yml` in place (comments are lost).
"""
import argparse
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def publish_config(cfg: dict, repo: str, branch: str = "main") -> dict:
    "Return `cfg` with repository and launch buttons for github.com/`repo`."
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repo):
        raise SystemExit(f"expected OWNER/REPO (as in $GITHUB_REPOSITORY), got {repo!r}")
    cfg = dict(cfg)
    cfg["repository"] = {"url": f"https://github.com/{repo}", "branch": branch,
                         "path_to_book": ""}
    cfg["html"] = {**cfg.get("html", {}), "use_repository_button": True,
                   "use_issues_button": True}
    sphinx = dict(cfg.get("sphinx", {}))
    sphinx["config"] = {**sphinx.get("config", {}), "thebe_config": {
        "repository_url": f"https://github.com/{repo}", "repository_branch": branch,
        "path_to_docs": "."}}
    cfg["sphinx"] = sphinx
    cfg["launch_buttons"] = {"notebook_interface": "jupyterlab",
                             "binderhub_url": "https://mybinder.org",
                             "colab_url": "https://colab.research.google.com"}
    return cfg


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", help="OWNER/REPO, e.g. $GITHUB_REPOSITORY")
    ap.add_argument("--branch", default="main")
    ap.add_argument("--config", type=Path, default=ROOT / "_config.yml")
    args = ap.parse_args()
    cfg = publish_config(yaml.safe_load(args.config.read_text()), args.repo, args.branch)
    args.config.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    print(f"{args.config}: buttons point at https://github.com/{args.repo} ({args.branch})")
