"""Print how long the book build took and which notebooks were slowest.

Reads the execution data myst-nb records in Sphinx's environment pickle.
Usage: python tools/book_report.py [--since UNIX_TIME] [--top N]
"""
import argparse
import pickle
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def exec_times(build=ROOT / "_build"):
    "Map docname -> seconds its notebook took to execute in the last build."
    with open(build / ".doctrees" / "environment.pickle", "rb") as f:
        env = pickle.load(f)
    meta = getattr(env, "nb_metadata", {})
    out = {}
    for doc, d in meta.items():
        ex = d.get("exec_data") or {}
        if ex.get("runtime") is not None:
            out[doc] = float(ex["runtime"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--since", type=float, default=None)
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    times = exec_times()
    pages = len(list((ROOT / "_build/html/nbs").glob("*.html")))
    figures = len([p for p in (ROOT / "_build/html/_images").glob("*")
                   if p.suffix in (".png", ".svg", ".jpg")])
    took = f"book built in {time.time() - a.since:.0f} s " if a.since else "book: "
    print(f"{took}({pages} pages, {figures} figures, "
          f"{sum(times.values()):.0f} s executing notebooks)")
    for doc, t in sorted(times.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"  {t:7.1f} s  {doc}")


if __name__ == "__main__":
    main()
