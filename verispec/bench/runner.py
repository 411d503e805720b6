"""The interleaved benchmark loop and the per-category rows of ``results.json``.

For each prompt every method runs once before the next prompt starts, in a seeded random order
drawn anew for each prompt and round, so machine noise (other jobs, clock changes) and what the
previous run left in the caches fall on all methods alike. A warm-up run of every method on the
shortest prompt comes first and is not counted.

The order was once rotated by one each round. A rotation keeps every method's predecessor (in the
session-4 command int8 prompt lookup at k=4 always ran right after float32 adaptive lookup), so
whatever one run leaves in the caches and the allocator fell on the same method every time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from verispec.bench.measure import conditional_acceptance, draft_fraction
from verispec.bench.methods import COPYING, SPECULATIVE, MethodConfig, Runner, RunResult, Sampling
from verispec.stats import GenerationStats

ALL = "all"
"""The category name of rows aggregated over every prompt."""

INTERVAL_LEVEL = 0.9
"""Coverage of the speedup intervals in ``results.json`` (``speedup_interval``)."""
BOOTSTRAP_DRAWS = 2000
"""Resamples of the prompts behind each interval."""


def run_interleaved(
    configs: list[MethodConfig],
    runners: dict[MethodConfig, Runner],
    prompts: list[list[int]],
    request: Sampling,
    warmup: Sampling | None = None,
    progress: bool = True,
    between_prompts: Callable[[], None] | None = None,
    repeats: int = 1,
    seed: int = 0,
) -> dict[MethodConfig, list[RunResult]]:
    """Run every config on every prompt (``prompts``: token ids), interleaved; results in prompt order.

    ``warmup``: the request for one uncounted run of each config on the shortest prompt first.
    ``between_prompts``: called after each prompt's runs (the bench reads the memory bandwidth
    there, so the bound is measured through the run, under the load the runs saw).
    ``repeats``: rounds of every config per prompt (each round in its own order); each config keeps
    its fastest round on the prompt, so a burst of other load on one request does not decide a cell
    (every round's time stays in ``round_seconds``). Every config is treated alike: each round's
    order is a random permutation from a generator seeded with ``seed``, so every config runs in
    every position and after every other config about equally often.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup is not None:
        shortest = min(prompts, key=len)
        for cfg in tqdm(configs, desc="warm-up", file=sys.stderr, disable=not progress, leave=False):
            runners[cfg](shortest, cfg, warmup)
    results: dict[MethodConfig, list[RunResult]] = {cfg: [] for cfg in configs}
    bar = tqdm(
        total=len(prompts) * len(configs) * repeats,
        desc="bench",
        file=sys.stderr,
        disable=not progress,
        unit="run",
    )
    order_rng = np.random.default_rng(seed)
    for i, ids in enumerate(prompts):
        rounds: dict[MethodConfig, list[RunResult]] = {cfg: [] for cfg in configs}
        for _ in range(repeats):
            for c in order_rng.permutation(len(configs)).tolist():
                cfg = configs[c]
                bar.set_postfix_str(f"prompt {i + 1}/{len(prompts)} {cfg.label}", refresh=False)
                rounds[cfg].append(runners[cfg](ids, cfg, request))
                bar.update(1)
        for cfg in configs:
            fastest = min(rounds[cfg], key=lambda run: run.seconds)
            results[cfg].append(replace(fastest, round_seconds=tuple(run.seconds for run in rounds[cfg])))
        if between_prompts is not None:
            between_prompts()
    bar.close()
    return results


def ratio_interval(
    tokens: Sequence[float],
    seconds: Sequence[float],
    base_tokens: Sequence[float],
    base_seconds: Sequence[float],
    rounds: Sequence[Sequence[float] | None] | None = None,
    base_rounds: Sequence[Sequence[float] | None] | None = None,
    level: float = INTERVAL_LEVEL,
    draws: int = BOOTSTRAP_DRAWS,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Paired bootstrap interval of ``sum(tokens)/sum(seconds)`` over ``sum(base_tokens)/sum(base_seconds)``.

    Entry i of each sequence (``[n]``) is prompt i: its new tokens and seconds through a method and
    through the baseline. Prompts are drawn with replacement, each bringing both of its runs, and the
    ratio is taken on every draw; the interval is the central ``level`` of those ratios (the
    percentile bootstrap, Efron and Tibshirani, 1993). That covers which prompts ran. With
    ``rounds`` (``[n][R]``: every round's seconds, of which ``seconds`` holds the least; likewise
    ``base_rounds``), each drawn prompt's seconds are also redrawn: the least of R rounds drawn with
    replacement from its own, which covers the machine's noise between rounds too. Rounds are used
    only where every prompt has the same number R >= 2 of them. None with fewer than two prompts.
    Seeded: the same runs give the same interval.
    """
    n = len(tokens)
    if not n == len(seconds) == len(base_tokens) == len(base_seconds):
        raise ValueError("every sequence needs one entry per prompt")
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=draws)  # [draws, n]

    def rate(tok: Sequence[float], sec: Sequence[float], by_round) -> np.ndarray:
        took = np.asarray(sec, dtype=np.float64)[None, :]  # [1, n]
        widths = {len(r or ()) for r in by_round} if by_round is not None and len(by_round) == n else set()
        if len(widths) == 1 and widths.pop() >= 2:
            times = np.asarray(by_round, dtype=np.float64)  # [n, R]
            pick = rng.integers(0, times.shape[1], size=(draws, *times.shape))  # [draws, n, R]
            took = times[np.arange(n)[:, None], pick].min(axis=2)  # [draws, n]
        return counts @ np.asarray(tok, dtype=np.float64) / (counts * took).sum(axis=1)  # [draws]

    ratios = rate(tokens, seconds, rounds) / rate(base_tokens, base_seconds, base_rounds)  # [draws]
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(ratios, [tail, 1.0 - tail])
    return float(lo), float(hi)


def _summary(runs: list[RunResult]) -> dict:
    new = sum(len(r.token_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    decode_tokens = sum(len(r.token_ids) - r.first_tokens for r in runs)
    decode_seconds = sum(r.seconds - r.first_token_seconds for r in runs)
    return {
        "prompts": len(runs),
        "new_tokens": new,
        "seconds": seconds,
        "first_token_seconds": sum(r.first_token_seconds for r in runs),
        "tokens_per_second": new / seconds if seconds > 0 else 0.0,
        "decode_tokens_per_second": decode_tokens / decode_seconds if decode_seconds > 0 else 0.0,
    }


def aggregate(
    configs: list[MethodConfig],
    categories: list[str],
    results: dict[MethodConfig, list[RunResult]],
    *,
    greedy: bool,
    reference: MethodConfig,
    predict: Callable[[MethodConfig, GenerationStats], float | None],
    seeded: bool = False,
) -> list[dict]:
    """One row per (config, category) and per config over all prompts (category ``"all"``).

    ``speedup`` is tokens/s over the config's baseline's (the same engine's plain decoding) on the same
    prompts, with ``speedup_interval`` its :func:`ratio_interval` (None for a baseline itself and
    for a cell of one prompt); ``relative_to_autoregressive`` is over ``reference`` (our plain
    decoding). With greedy decoding, ``outputs_match_baseline`` says whether every prompt's tokens
    equal the baseline's (for plain decoding of other engines and weight formats: equal
    ``reference``'s). When sampling with a seed (``seeded``) it does so for our copying methods
    (:data:`~verispec.bench.methods.COPYING`), whose seeded output is the plain one; else None.
    """
    rows = []
    cats = [*dict.fromkeys(categories), ALL]
    for cfg in configs:
        base_cfg = cfg.baseline if cfg.baseline != cfg else reference
        for cat in cats:
            idx = [i for i, c in enumerate(categories) if cat in (ALL, c)]
            runs = [results[cfg][i] for i in idx]
            row = {
                "method": cfg.method,
                "label": cfg.label,
                "dtype": cfg.dtype,
                "adaptive": cfg.adaptive,
                "category": cat,
                "num_speculative_tokens": cfg.k,
            }
            row.update(_summary(runs))
            row["speedup_interval"] = None
            for name, other in (("speedup", cfg.baseline), ("relative_to_autoregressive", reference)):
                if other in results:
                    base_runs = [results[other][i] for i in idx]
                    ref = _summary(base_runs)
                    row[name] = row["tokens_per_second"] / ref["tokens_per_second"]
                    if name == "speedup":
                        row["decode_speedup"] = (
                            row["decode_tokens_per_second"] / ref["decode_tokens_per_second"]
                        )
                        if other != cfg:
                            row["speedup_interval"] = ratio_interval(
                                [len(r.token_ids) for r in runs],
                                [r.seconds for r in runs],
                                [len(r.token_ids) for r in base_runs],
                                [r.seconds for r in base_runs],
                                [r.round_seconds for r in runs],
                                [r.round_seconds for r in base_runs],
                            )
                else:
                    row[name] = None
            stats = [r.stats for r in runs if r.stats is not None]
            if stats and cfg.method in SPECULATIVE:
                merged = GenerationStats()
                for s in stats:
                    merged.merge(s)
                row["acceptance_rate"] = merged.acceptance_rate
                row["conditional_acceptance"] = conditional_acceptance(merged)
                row["draft_fraction"] = draft_fraction(merged)
                row["mean_accepted_length"] = merged.mean_accepted_length
                row["acceptance_by_position"] = [
                    a / d if d else 0.0
                    for a, d in zip(merged.accepted_per_position, merged.drafted_per_position)
                ]
                row["predicted_speedup"] = predict(cfg, merged)
            else:
                row["acceptance_rate"] = None
                row["mean_accepted_length"] = 1.0 if stats else None
                row["acceptance_by_position"] = None
                row["predicted_speedup"] = None
            if (greedy or (seeded and cfg.method in COPYING)) and base_cfg in results:
                matching = sum(results[cfg][i].token_ids == results[base_cfg][i].token_ids for i in idx)
                row["outputs_match_baseline"] = matching == len(idx)
                row["prompts_matching_baseline"] = matching
            else:
                row["outputs_match_baseline"] = None
            rows.append(row)
    return rows
