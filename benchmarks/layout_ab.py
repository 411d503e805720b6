"""Greedy step times of two builds of the C++ kernel whose weight layouts differ, alternating.

``benchmarks/kernel_ab.py`` runs both builds over one copy of the weights, which needs one layout.
When a change alters how the weights are packed (``q4_pack``, ``q8_pack``), each build must pack
its own: this loads the model once per build (each packed by its own build) and times greedy steps
of each width with each model in turn, round after round (each first in every other round). It
prints each model's weight bytes, then per source min / median ms per width.

    flock /tmp/verispec-cpu.lock python benchmarks/layout_ab.py OLD.cpp NEW.cpp [--dtype w4a8]
        [--rounds 10] [--reps 5] [--context 200] [--widths 1 2 5 9]

Two models in memory side by side can differ a little by where their weights land; alternating
keeps the machine's drift out of the comparison, not that.
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
    ap.add_argument("--dtype", default="w4a8")
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5, help="steps per width, model and round")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 5, 9])
    args = ap.parse_args()

    flags = fast_llama.kernel_flags()
    models = []
    for src in args.sources:
        fast_llama._SRC = src.resolve()
        fast_llama._kernel_module = fast_llama.compile_kernel(flags)[0]
        model = load_model(args.model, dtype=args.dtype, max_length=args.context + 2 * max(args.widths))
        print(f"{src}  weights {model.weight_bytes() / 1e6:.1f} MB", flush=True)
        models.append(model)
    times: list[dict[int, list[float]]] = [{t: [] for t in args.widths} for _ in models]
    for r in range(args.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            for t, secs in time_forwards(models[i], args.widths, args.context, args.reps, "greedy").items():
                times[i][t] += secs
    for src, got in zip(args.sources, times):
        cells = " ".join(f"{t}:{min(v) * 1e3:.2f}/{statistics.median(v) * 1e3:.2f}" for t, v in got.items())
        print(f"{src}  {cells}")


if __name__ == "__main__":
    main()
