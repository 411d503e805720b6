"""The copy oracle of ``benchmarks/lookup_rule.py ceiling``: it must bound what prompt lookup gets."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np

from verispec.proposers import PromptLookup

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "lookup_rule.py"
_SPEC = importlib.util.spec_from_file_location("lookup_rule", _PATH)
lookup_rule = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lookup_rule)

FREE = [1.0] * 9  # every step costs one token's: the cost counts target calls


def test_best_copy_finds_the_longest_source_inside_the_committed_text() -> None:
    full = np.array([5, 1, 2, 3, 9, 1, 2, 7, 1, 2, 3, 4])
    # At 8 the future is 1 2 3 4: source 1 (1 2 3 9) agrees on 3, source 5 (1 2 7) on 2.
    assert lookup_rule.best_copy(full, 8, 3) == 3
    assert lookup_rule.best_copy(full, 8, 2) == 2  # capped by the room
    assert lookup_rule.best_copy(full, 8, 0) == 0
    # A source must end where the committed text does: at 3 the future 3 9 1 ... has no earlier 3.
    assert lookup_rule.best_copy(full, 3, 4) == 0
    # Anchored on one token: the source must follow a 7 (full[7]); none does.
    assert lookup_rule.best_copy(full, 8, 3, anchor=1) == 0
    assert lookup_rule.best_copy(full, 9, 2, anchor=1) == 2  # after a 1: 2 3 (source 2)


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
            cost, calls = lookup_rule.copy_ceiling(prompt, output, FREE, 4, anchor)
            assert cost - 1.0 == calls
            assert calls <= real_calls, (trial, anchor)
        assert lookup_rule.copy_ceiling(prompt, output, FREE, 4, 0)[1] <= calls
