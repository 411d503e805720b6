"""The copy oracle (``verispec.bench.ceiling``, ``benchmarks/lookup_rule.py ceiling``): it must bound
what prompt lookup gets."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from verispec.bench.ceiling import add_copy_ceilings, best_copy, copy_ceiling
from verispec.bench.methods import MethodConfig, RunResult
from verispec.proposers import PromptLookup

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "lookup_rule.py"
_SPEC = importlib.util.spec_from_file_location("lookup_rule", _PATH)
lookup_rule = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lookup_rule)

FREE = [1.0] * 9  # every step costs one token's: the cost counts target calls


def test_best_copy_finds_the_longest_source_inside_the_committed_text() -> None:
    full = np.array([5, 1, 2, 3, 9, 1, 2, 7, 1, 2, 3, 4])
    # At 8 the future is 1 2 3 4: source 1 (1 2 3 9) agrees on 3, source 5 (1 2 7) on 2.
    assert best_copy(full, 8, 3) == 3
    assert best_copy(full, 8, 2) == 2  # capped by the room
    assert best_copy(full, 8, 0) == 0
    # A source must end where the committed text does: at 3 the future 3 9 1 ... has no earlier 3.
    assert best_copy(full, 3, 4) == 0
    # Anchored on one token: the source must follow a 7 (full[7]); none does.
    assert best_copy(full, 8, 3, anchor=1) == 0
    assert best_copy(full, 9, 2, anchor=1) == 2  # after a 1: 2 3 (source 2)


def test_oracle_needs_no_more_calls_than_prompt_lookup() -> None:
    """Prompt lookup copies a piece of the committed text after a match of at least one token, so
    the oracle (any source, or any source after a one-token match) never needs more target calls."""
    rng = random.Random(3)
    for trial in range(12):
        phrases = [[rng.randrange(40) for _ in range(rng.randint(2, 6))] for _ in range(6)]
        prompt = [t for _ in range(12) for t in rng.choice(phrases)]
        output = [t for _ in range(10) for t in rng.choice(phrases)][:48]
        lookup = lookup_rule.replay_one(lambda: PromptLookup(), prompt, output, FREE, 4, 0.0)
        real_calls = len(output) - 1 - lookup[2]  # each call emits its accepted tokens and one more
        for anchor in (0, 1):
            cost, calls = copy_ceiling(prompt, output, FREE, 4, anchor)
            assert cost - 1.0 == calls
            assert calls <= real_calls, (trial, anchor)
        assert copy_ceiling(prompt, output, FREE, 4, 0)[1] <= calls


def test_bench_rows_get_the_ceiling_and_the_bound_of_their_plain_outputs() -> None:
    """``add_copy_ceilings`` on one request worked by hand: prompt 7 1 2 3 4, plain output 9 1 2 3 4 8
    with 0.5 s to the first token and 0.1 s per later step (1.0 s in all)."""
    plain, lookup = MethodConfig("autoregressive"), MethodConfig("prompt-lookup", k=2)
    results = {plain: [RunResult([9, 1, 2, 3, 4, 8], 1.0, 0.5, 1)]}
    rows = [{"label": lookup.label, "category": cat} for cat in ("rag", "all")] + [
        {"label": plain.label, "category": "all"}
    ]
    add_copy_ceilings(
        rows, [plain, lookup], ["rag"], [[7, 1, 2, 3, 4]], results, {"float32": {1: 1.0, 2: 1.2, 3: 1.5}}
    )
    # Bound: any source, any length, free steps: one call copies 1 2 3 4 and adds the 8.
    # Ceiling: after a one-token match, 2 at most: 1 alone (nothing follows a 9 before), then 2 3
    # after the 1 (a 3-token step, 1.5), then the 8 alone: 3.5 steps' worth instead of 5.
    for row in rows[:2]:
        assert row["copy_bound"] == pytest.approx(1.0 / (0.5 + 0.1 * 1))
        assert row["lookup_ceiling"] == pytest.approx(1.0 / (0.5 + 0.1 * 3.5))
    assert rows[2]["lookup_ceiling"] is None and rows[2]["copy_bound"] is None  # not a copying method
