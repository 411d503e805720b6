"""Whether two builds of the C++ kernel give bitwise the same logits, format by format.

A kernel change meant to keep the arithmetic (a new thread split, a loop reordered over outputs)
must leave every logit bitwise as it was. This compiles both sources (versions of
``verispec/csrc/fast_llama.cpp``), loads the model once per format, builds one kernel per source
over the same weights and cache (``kernel_ab.shared_weights``), and compares the logits of both
after 0-1000 cached tokens for calls of 1-64 tokens (random token ids, fixed seed). It prints, per
format, how many of the calls differ, and each that does with its largest difference.

    flock /tmp/verispec-cpu.lock python benchmarks/bitwise_ab.py OLD.cpp NEW.cpp \
        [--dtypes w4a8,int8,float32,int4,bfloat16]

``VERISPEC_KV_CACHE=bfloat16`` in the environment checks the formats that take it (int4, w4a8)
over a bfloat16 cache. ``git show HEAD:verispec/csrc/fast_llama.cpp > /tmp/old.cpp`` gives the
committed source. Exits 1 if any call differs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from kernel_ab import shared_weights

from verispec.models import fast_llama
from verispec.models.loading import load_model

# (cached tokens, widths of the calls after them)
CASES = [(c, (1, 2, 3, 5, 9, 13, 64)) for c in (0, 1, 37, 200, 600)] + [(1000, (1, 5, 9, 64))]


def compare(model, kernels: list, ids: torch.Tensor) -> list[tuple[int, int, float]]:
    """``(context, width, largest difference)`` for each case whose logits differ between the
    kernels; ``ids`` ``[1, L]`` the token ids fed."""
    differ = []
    for ctx, widths in CASES:
        for w in widths:
            outs = []
            for kernel in kernels:
                model._kernel = kernel
                model.reset(1)
                if ctx:
                    model.forward(ids[:, :ctx], logits="none")
                outs.append(model.forward(ids[:, ctx : ctx + w], logits="all").clone())  # [1, w, V]
            if not torch.equal(outs[0], outs[1]):
                differ.append((ctx, w, (outs[0] - outs[1]).abs().max().item()))
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--dtypes", default="w4a8,int8,float32")
    ap.add_argument("--model", default="default")
    args = ap.parse_args()

    flags = fast_llama.kernel_flags()
    modules = []
    for src in (args.old, args.new):
        fast_llama._SRC = src.resolve()
        modules.append(fast_llama.compile_kernel(flags)[0])
    cache = os.environ.get("VERISPEC_KV_CACHE")
    failed = False
    for dtype in args.dtypes.split(","):
        fast_llama._kernel_module = modules[0]
        model = load_model(args.model, dtype=dtype, max_length=1200)
        kernels = shared_weights(model, modules)
        ids = torch.randint(0, model.vocab_size, (1, 1100), generator=torch.Generator().manual_seed(1))
        differ = compare(model, kernels, ids)
        calls = sum(len(w) for _, w in CASES)
        over = f" over a {cache} cache" if cache else ""
        print(f"{dtype}{over}: {calls} calls, {len(differ)} differ", flush=True)
        for ctx, w, most in differ:
            print(f"  {ctx} cached, {w} tokens: largest difference {most:.3g}")
        failed = failed or bool(differ)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
