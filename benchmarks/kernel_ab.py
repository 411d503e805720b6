"""Greedy step times of two builds of the C++ kernel over one copy of the weights, alternating.

Two models loaded side by side can differ by a fifth or more with the same build on these machines
(where their weights land in memory), and timings drift within minutes. So this compiles both
sources (two versions of ``verispec/csrc/fast_llama.cpp``), loads the model once, builds one kernel
object per source over the same weight tensors and cache, and times greedy steps of each width with
each kernel in turn, round after round (each kernel first in every other round). It prints, per
source, min / median ms per width.

    flock /tmp/verispec-cpu.lock python benchmarks/kernel_ab.py OLD.cpp NEW.cpp [--dtype float32]
        [--rounds 8] [--reps 5] [--context 200] [--widths 1 2 3 4 5 6 9]

``git show HEAD:verispec/csrc/fast_llama.cpp > /tmp/old.cpp`` gives the committed source. Both
builds take the flags this CPU allows (``fast_llama.kernel_flags``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from verispec.models import fast_llama
from verispec.models.loading import load_model
from verispec.models.schedule import time_forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs=2, type=Path)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="steps per width, kernel and round")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 9])
    args = ap.parse_args()

    flags = fast_llama.kernel_flags()
    modules = []
    for src in args.sources:
        fast_llama._SRC = src.resolve()
        modules.append(fast_llama.compile_kernel(flags)[0])
    fast_llama._kernel_module = modules[0]
    model = load_model(args.model, dtype=args.dtype, max_length=args.context + 2 * max(args.widths))
    schedule = tuple(model._kernel.get_schedule())
    kernels = []
    for module in modules:
        fast_llama._kernel_module = module
        kernel = model._build_kernel()
        try:  # _build_kernel gives it the model's block rows, not its schedule
            kernel.set_schedule(*schedule)
        except TypeError:  # a source from before session 35, whose schedule had three fields
            kernel.set_schedule(*schedule[:3])
        kernel.set_cache(model.k_cache, model.v_cache)
        kernels.append(kernel)

    times: list[dict[int, list[float]]] = [{t: [] for t in args.widths} for _ in kernels]
    pairs = list(zip(kernels, times))
    for r in range(args.rounds):
        for kernel, got in pairs if r % 2 == 0 else reversed(pairs):  # each goes first half the time
            model._kernel = kernel
            for t, secs in time_forwards(model, args.widths, args.context, args.reps, "greedy").items():
                got[t] += secs
    for src, got in zip(args.sources, times):
        cells = " ".join(f"{t}:{min(v) * 1e3:.2f}/{statistics.median(v) * 1e3:.2f}" for t, v in got.items())
        print(f"{src}  {cells}")


if __name__ == "__main__":
    main()
