"""What any prompt lookup could reach on a run's own requests: the copy oracle.

Speculation is lossless, so a greedy request emits the plain greedy output whatever is drafted.
Given that output, an oracle can replay the request and draft, at every step, exactly the longest
run of the coming tokens that some piece of the request's committed text (prompt and output so far)
holds. Every drafted token is then accepted, and copying as far as possible at each step needs the
fewest target calls: whatever can be copied from position t, all but its first token can be copied
from t + 1 (the same source, one on). So no drafter that copies from the request needs fewer calls.

Two figures per prompt-lookup row of the bench (:func:`add_copy_ceilings`):

* ``lookup_ceiling``: sources after a one-token match only (every prompt lookup, ours,
  transformers' and llama.cpp's, needs one), each step charged the run's measured cost of verifying
  that many tokens;
* ``copy_bound``: any source, drafts of any length, every step charged one token's cost: no drafter
  that copies from the request could pass it, at any k and any verification cost.

Both are whole-request speedups over the same plain decoding runs the row's speedup divides by: the
plain run's prompt time stays, its decoding steps are replaced by the oracle's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from verispec.bench.methods import MethodConfig, RunResult

COPYING = frozenset({"prompt-lookup"})
"""Methods that draft only by copying the request's own text, bounded by the oracle."""


def best_copy(full: np.ndarray, at: int, room: int, anchor: int = 0) -> int:
    """How many of ``full[at : at + room]`` (``full`` ``[L]`` int64) the best copy of the committed
    text ``full[:at]`` gets right: the longest common prefix of the future with any ``full[j : at]``,
    ``j < at`` (the source ends where the committed text does). With ``anchor`` = a, only sources
    whose a tokens before them equal the committed text's last a tokens count."""
    if room <= 0:
        return 0
    alive = np.arange(anchor, at)
    for a in range(1, anchor + 1):
        alive = alive[full[alive - a] == full[at - a]]
    alive = alive[full[alive] == full[at]]
    n = 0
    while alive.size and n < room:
        n += 1
        if n == room:
            break
        alive = alive[alive + n < at]
        alive = alive[full[alive + n] == full[at + n]]
    return n


def copy_ceiling(
    prompt: Sequence[int], output: Sequence[int], costs: Sequence[float], k: int, anchor: int = 0
) -> tuple[float, int]:
    """Replay one request with the copy oracle (:func:`best_copy` with ``anchor``, drafts of at most
    ``k`` tokens). Returns ``(cost, calls)``: the cost in one-token steps, the first output token
    (the prompt's) counted as 1 and a step of w tokens as ``costs[w - 1]`` (``costs`` ``[W]``,
    extended past its end at its last increment); calls: target calls after the prompt."""
    full = np.asarray(list(prompt) + list(output), dtype=np.int64)
    at, cost, calls = len(prompt) + 1, 1.0, 0
    step = costs[-1] - costs[-2] if len(costs) > 1 else 0.0
    while at < len(full):
        n = best_copy(full, at, min(k, len(full) - at - 1), anchor)
        cost += costs[n] if n < len(costs) else costs[-1] + (n + 1 - len(costs)) * step
        calls += 1
        at += n + 1
    return cost, calls


def oracle_seconds(seconds: float, first_seconds: float, steps: int, oracle_steps: float) -> float:
    """A plain request's time (``seconds``, ``first_seconds`` of them to the first token, then
    ``steps`` one-token steps) with its decoding replaced by the oracle's ``oracle_steps`` one-token
    steps' worth, each at the plain run's mean step time."""
    per_step = (seconds - first_seconds) / steps if steps > 0 else 0.0
    return first_seconds + per_step * oracle_steps


def _curve(by_width: Mapping[int, float]) -> list[float]:
    """``[v(1), v(2), ...]`` from measured ``{width: cost}``, as far as the widths run without a gap,
    each at least 1 (a wider step that measured cheaper than one token is taken to cost as much)."""
    out = []
    while len(out) + 1 in by_width:
        out.append(max(1.0, float(by_width[len(out) + 1])))
    return out or [1.0]


def add_copy_ceilings(
    rows: list[dict],
    configs: Sequence[MethodConfig],
    categories: Sequence[str],
    prompts: Sequence[Sequence[int]],
    results: Mapping[MethodConfig, Sequence[RunResult]],
    costs: Mapping[str, Mapping[int, float]],
) -> None:
    """Set ``lookup_ceiling`` and ``copy_bound`` (module docstring) on each row of a method in
    :data:`COPYING` (None on other rows, and where the plain runs are missing). ``categories`` and
    ``prompts`` (token ids) are per prompt; ``costs``: per weight format, the measured cost of a
    step of each width over one token's. For ``lookup_ceiling`` the oracle drafts at most the row's
    k tokens (2k adaptive, as far as adaptive k goes), for ``copy_bound`` any number. Greedy runs
    only: sampled outputs are not fixed by the prompt."""
    by_label = {cfg.label: cfg for cfg in configs}
    memo: dict[tuple, tuple[float, int]] = {}
    for row in rows:
        row["lookup_ceiling"] = row["copy_bound"] = None
        cfg = by_label.get(row["label"])
        if cfg is None or cfg.method not in COPYING or cfg.baseline not in results:
            continue
        base = results[cfg.baseline]
        curve = _curve(costs.get(cfg.dtype, {}))
        k = cfg.k * (2 if cfg.adaptive else 1)
        plain = ceiling = bound = 0.0
        for i, cat in enumerate(categories):
            if row["category"] not in ("all", cat):
                continue
            run = base[i]
            anchored = (i, cfg.dtype, k, 1)
            if anchored not in memo:
                memo[anchored] = copy_ceiling(prompts[i], run.token_ids, curve, k, anchor=1)
            anywhere = (i, cfg.dtype, 0, 0)
            if anywhere not in memo:
                memo[anywhere] = copy_ceiling(prompts[i], run.token_ids, [1.0], len(run.token_ids), anchor=0)
            timing = (run.seconds, run.first_token_seconds, len(run.token_ids) - run.first_tokens)
            plain += run.seconds
            ceiling += oracle_seconds(*timing, memo[anchored][0] - 1.0)
            bound += oracle_seconds(*timing, memo[anywhere][1])
        if ceiling > 0 and bound > 0:
            row["lookup_ceiling"], row["copy_bound"] = plain / ceiling, plain / bound
