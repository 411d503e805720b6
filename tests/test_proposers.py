"""Drafters in isolation: what prompt lookup proposes for hand-made token sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.config import SamplingConfig
from verispec.proposers import PromptLookup
from verispec.sampling import SamplingTensors


def test_lookup_continues_the_longest_earlier_match() -> None:
    pl = PromptLookup()
    # "1 2 3" recurs at the end: the match is 3 long; what followed it is proposed, up to k.
    assert pl.match([1, 2, 3, 9, 8, 1, 2, 3]) == (3, 3)
    assert pl.lookup([1, 2, 3, 9, 8, 1, 2, 3], 4) == [9, 8, 1, 2]
    # The longest match wins over a more recent shorter one: "5 2" twice, "7 5 2" once earlier.
    assert pl.lookup([7, 5, 2, 4, 4, 3, 5, 2, 6, 0, 7, 5, 2], 8) == [4, 4, 3, 5, 2, 6, 0, 7]
    # Among equally long matches the most recent one wins.
    assert pl.lookup([1, 2, 5, 1, 2, 6, 1, 2], 1) == [6]


def test_fixed_rule_caps_the_draft_by_the_match() -> None:
    pl = PromptLookup(tokens_per_match=2)
    one = [4, 9, 9, 9, 9, 9, 1, 4]  # only the last token recurs: 2 tokens may follow
    assert pl.lookup(one, 8) == [9, 9]
    assert PromptLookup(tokens_per_match=1).lookup(one, 8) == [9]
    assert pl.lookup(one, 1) == [9]  # k caps


def test_no_match_or_too_short_proposes_nothing() -> None:
    pl = PromptLookup(min_ngram=2)
    assert pl.lookup([1, 2, 3, 4], 4) == []
    assert pl.lookup([3, 1, 2, 3], 4) == []  # a 1-token match is below min_ngram
    assert pl.lookup([5], 4) == []
    assert pl.lookup(torch.tensor([1, 2, 1, 2]), 4) == [1, 2]


def test_propose_pads_rows_and_reports_lengths() -> None:
    pl = PromptLookup()
    params = SamplingTensors.from_configs([SamplingConfig(temperature=0.0)] * 2)
    prop = pl.propose([0, 1], [[1, 2, 3, 1, 2], [5, 6, 7]], torch.tensor([3, 3]), params, [None, None])
    assert prop.num_draft.tolist() == [3, 0] and prop.probs is None
    assert prop.tokens.tolist() == [[3, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_ngram=0),
        dict(max_ngram=2, min_ngram=3),
        dict(tokens_per_match=0),
        dict(prior=(0.5,)),
        dict(prior=(1.5,) * 8),
        dict(prior_weight=0),
    ],
)
def test_bad_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        PromptLookup(**bad)


def _naive_match(seq: list[int], max_ngram: int) -> tuple[int, int]:
    """The definition of ``PromptLookup.match``, token by token."""
    n, best, start = len(seq), 0, 0
    for end in range(n - 1):  # an earlier occurrence ending at `end`
        length = 0
        while length < max_ngram and end - length >= 0 and seq[end - length] == seq[n - 1 - length]:
            length += 1
        if length and length >= best:  # ties: the most recent
            best, start = length, end + 1
    return (start, best) if best else (0, 0)


def test_match_is_the_longest_most_recent_earlier_occurrence() -> None:
    rng = np.random.default_rng(3)
    for _ in range(3000):
        n, vocab = int(rng.integers(1, 120)), int(rng.integers(1, 6))
        seq = rng.integers(0, vocab, n)
        if rng.random() < 0.3:  # periodic text: many candidates, long matches
            seq = np.tile(seq[: max(1, n // 6)], 8)[:n]
        pl = PromptLookup(max_ngram=int(rng.integers(1, 40)))
        assert pl.match(seq) == _naive_match(seq.tolist(), pl.max_ngram)
