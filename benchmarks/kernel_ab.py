"""Greedy step times of two (or more) builds of the C++ kernel, alternating.

Two models loaded side by side can differ by a fifth or more with the same build on these machines
(where their weights land in memory), and timings drift within minutes. So this compiles each of
the sources (versions of ``verispec/csrc/fast_llama.cpp``), loads the model once, builds one kernel
object per source over the same weight tensors and cache, and times greedy steps of each width with
each kernel in turn, round after round (each kernel first in every other round). It prints, per
source, min / median ms per width, and for each source after the first its time against the
first's paired by round (the median of the per-round ratios: drift over minutes cancels).

    flock /tmp/verispec-cpu.lock python benchmarks/kernel_ab.py OLD.cpp NEW.cpp [MORE.cpp ...]
        [--dtype float32] [--rounds 8] [--reps 5] [--context 200] [--widths 1 2 3 4 5 6 9] [--own-weights]
        [--placement]

``--own-weights``: for a change to how the weights are packed (``q4_pack``, ``q8_pack``), which one
copy of the weights cannot serve: the model is loaded once per build, each packed by its own build,
and each model's weight bytes are printed. The models then differ by where their weights land too;
alternating keeps only the machine's drift out. (Session 43's ``benchmarks/layout_ab.py`` was this
mode as a script of its own.)

``--placement``: also split the rounds by where the two threads' cores sat (a VM's vCPUs can move
between cores that share an L3 and cores on different CCDs within minutes, and multi-token steps
follow; benchmarks/README.md), read before each round as ``verispec bench`` reads it.

``git show HEAD:verispec/csrc/fast_llama.cpp > /tmp/old.cpp`` gives the committed source. Both
builds take the flags this CPU allows (``fast_llama.kernel_flags``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from verispec.bench.measure import placement_groups
from verispec.models import fast_llama
from verispec.models.loading import load_model
from verispec.models.schedule import time_forwards


def shared_weights(model: Any, modules: list[Any]) -> list[Any]:
    """One kernel object per build over ``model``'s weight tensors and cache."""
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
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", type=Path, help="two or more kernel sources")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="steps per width, kernel and round")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 9])
    ap.add_argument("--own-weights", action="store_true", help="one model per build, packed by it")
    ap.add_argument(
        "--placement", action="store_true", help="also split the rounds by where the two threads' cores sat"
    )
    args = ap.parse_args()
    if len(args.sources) < 2:
        ap.error("give at least two sources")

    flags = fast_llama.kernel_flags()
    max_length = args.context + 2 * max(args.widths)
    modules = []
    models = []  # one per build with --own-weights; else the one model, below
    for src in args.sources:
        fast_llama._SRC = src.resolve()
        modules.append(fast_llama.compile_kernel(flags)[0])
        if args.own_weights:
            fast_llama._kernel_module = modules[-1]
            models.append(load_model(args.model, dtype=args.dtype, max_length=max_length))
            print(f"{src}  weights {models[-1].weight_bytes() / 1e6:.1f} MB", flush=True)
    if args.own_weights:
        kernels = [m._kernel for m in models]
    else:
        fast_llama._kernel_module = modules[0]
        model = load_model(args.model, dtype=args.dtype, max_length=max_length)
        kernels = shared_weights(model, modules)
        models = [model] * len(kernels)

    # times[i][r][T]: kernel i's seconds per step of T tokens in round r
    times: list[list[dict[int, list[float]]]] = [[] for _ in kernels]
    probe = next((m for m in reversed(modules) if hasattr(m, "core_roundtrip_ns")), None)
    roundtrips: list[float] = []
    for r in range(args.rounds):
        if args.placement and probe is not None:
            roundtrips.append(probe.core_roundtrip_ns())
        order = list(range(len(kernels)))
        for i in order if r % 2 == 0 else order[::-1]:  # each goes first half the time
            models[i]._kernel = kernels[i]
            times[i].append(time_forwards(models[i], args.widths, args.context, args.reps, "greedy"))
    report(args.sources, times, range(args.rounds), "")
    if args.placement:
        split_by_placement(args.sources, times, roundtrips)


def report(sources: list[Path], times: list[list[dict[int, list[float]]]], rounds: Any, label: str) -> None:
    """Per source, min / median ms per width over the given rounds, and for each source after the
    first its time against the first's, paired by round: the median over rounds of the ratio of
    the two builds' median steps in that round (the builds alternate within a round, so drift over
    minutes cancels; 0.97x is 3% faster)."""
    rounds = list(rounds)
    for i, (src, got) in enumerate(zip(sources, times)):
        per = {t: [s for r in rounds for s in got[r][t]] for t in got[0]}
        cells = " ".join(f"{t}:{min(v) * 1e3:.2f}/{statistics.median(v) * 1e3:.2f}" for t, v in per.items())
        if i > 0 and rounds:
            ratios = {t: statistics.median(_round_ratio(got, times[0], r, t) for r in rounds) for t in got[0]}
            cells += "  paired: " + " ".join(f"{t}:{q:.3f}x" for t, q in ratios.items())
        print(f"{src}  {label}{cells}")


def _round_ratio(
    got: list[dict[int, list[float]]], first: list[dict[int, list[float]]], r: int, t: int
) -> float:
    """A build's median step of width t in round r over the first build's in the same round."""
    return statistics.median(got[r][t]) / statistics.median(first[r][t])


def split_by_placement(
    sources: list[Path], times: list[list[dict[int, list[float]]]], roundtrips: list[float]
) -> None:
    """The rounds again, split where the threads' cores sat: a cache line's round trip between two
    threads read before each round (the kernel's ``core_roundtrip_ns``), cut at the geometric mean
    of the least and the most as ``verispec bench`` cuts its verify readings (``placement_groups``)."""
    groups = placement_groups(roundtrips)
    if groups is None:
        seen = f"{min(roundtrips):.0f}-{max(roundtrips):.0f} ns" if roundtrips else "none"
        print(f"placement: not split (round trips {seen}: one placement all run, or not read)")
        return
    for name, rounds in groups.items():
        ns = statistics.median(roundtrips[r] for r in rounds)
        report(sources, times, rounds, f"{name} ({len(rounds)} rounds, {ns:.0f} ns) ")


if __name__ == "__main__":
    main()
