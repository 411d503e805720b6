"""Drafters in isolation: what prompt lookup proposes for hand-made token sequences."""

from __future__ import annotations

from collections.abc import Iterator

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
        dict(vote_below=-1),
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


def _random_sequences(seed: int, count: int = 3000) -> Iterator[np.ndarray]:
    """Token sequences ``[n]`` over small vocabularies, 30% of them periodic text (many candidates,
    long matches)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n, vocab = int(rng.integers(1, 120)), int(rng.integers(1, 6))
        seq = rng.integers(0, vocab, n)
        if rng.random() < 0.3:
            seq = np.tile(seq[: max(1, n // 6)], 8)[:n]
        yield seq


def _assert_both_searches_find(pl: PromptLookup, seq: np.ndarray, expected: tuple[int, int]) -> None:
    """The numpy search and the one on Python ints (for few candidates) both find ``expected``."""
    assert pl.match(seq) == expected
    toks = seq.tolist()
    ends = [i for i in range(len(toks) - 1) if toks[i] == toks[-1]]
    assert pl._match_among(toks, ends) == expected


def test_match_is_the_longest_most_recent_earlier_occurrence() -> None:
    rng = np.random.default_rng(3)
    for seq in _random_sequences(3):
        pl = PromptLookup(max_ngram=int(rng.integers(1, 40)), vote_below=0)
        _assert_both_searches_find(pl, seq, _naive_match(seq.tolist(), pl.max_ngram))


def _naive_vote(seq: list[int], max_ngram: int, below: int) -> tuple[int, int]:
    """The definition of ``PromptLookup(vote_below=below).match``: the longest earlier match, the
    most recent among equals, but for matches shorter than ``below``, the most recent of those
    followed by the token most of them were followed by (ties: the one seen latest)."""
    n, lengths = len(seq), {}
    for end in range(n - 1):
        length = 0
        while length < max_ngram and end - length >= 0 and seq[end - length] == seq[n - 1 - length]:
            length += 1
        lengths[end] = length
    best = max(lengths.values(), default=0)
    if not best:
        return 0, 0
    if best >= below:
        return _naive_match(seq, max_ngram)
    counts: dict[int, int] = {}
    latest: dict[int, int] = {}
    for end, length in lengths.items():  # ascending: later ends overwrite
        if length == best:
            counts[seq[end + 1]] = counts.get(seq[end + 1], 0) + 1
            latest[seq[end + 1]] = end
    token = max(counts, key=lambda t: (counts[t], latest[t]))
    return latest[token] + 1, best


def test_short_matches_copy_their_most_common_continuation() -> None:
    seq = [1, 9, 2, 1, 9, 3, 1, 8, 4, 1]  # "1" was followed by 9, 9, 8: copy 9, from its latest
    assert PromptLookup(vote_below=0).match(np.array(seq)) == (7, 1)
    assert PromptLookup().match(np.array(seq)) == (4, 1)
    assert PromptLookup()._match_among(seq, [0, 3, 6]) == (4, 1)
    seq = [5, 1, 9, 5, 1, 8, 5, 1, 8, 2, 5, 1]  # "5 1" is 2 tokens long: the most recent, not the vote
    assert PromptLookup().match(np.array(seq)) == (8, 2)
    rng = np.random.default_rng(4)
    for seq in _random_sequences(4):
        below = int(rng.choice([0, 2, 3, 10**9]))
        pl = PromptLookup(max_ngram=int(rng.integers(1, 40)), vote_below=below)
        _assert_both_searches_find(pl, seq, _naive_vote(seq.tolist(), pl.max_ngram, below))


@pytest.mark.parametrize("few", [-1, 10**9, 3])
def test_propose_follows_growing_replaced_and_edited_sequences(few: int) -> None:
    """propose keeps each slot's tokens as an array extended between calls; whatever happens to the
    lists (growth past the buffer's capacity, a new sequence after ``start``, a list cut short or
    rewritten at its end), each proposal must be the one the lists' current tokens define."""
    rng = np.random.default_rng(5)
    pl = PromptLookup(max_ngram=12)
    pl.few_candidates = few  # both searches: numpy always, Python ints always, or by count
    params = SamplingTensors.from_configs([SamplingConfig(temperature=0.0)] * 2)
    seqs = [[int(t) for t in rng.integers(0, 20, 30)] for _ in range(2)]
    for slot, seq in enumerate(seqs):
        pl.start(slot, seq)
    proposed = 0
    for step in range(400):
        for slot, seq in enumerate(seqs):
            if step == 150 and slot == 0:  # a new, shorter sequence in the slot
                seqs[0] = seq = [int(t) for t in rng.integers(0, 20, 10)]
                pl.start(0, seq)
            elif step == 250 and slot == 1:  # a new one as long, ending as the old one did
                seqs[1] = seq = [int(t) for t in rng.integers(0, 20, len(seq) - 8)] + seq[-8:]
                pl.start(1, seq)
            elif step % 37 == 36:  # cut short, then regrown below with other tokens
                del seq[-int(rng.integers(1, 6)) :]
            elif step % 23 == 22:  # the last committed tokens rewritten in place
                seq[-int(rng.integers(1, 4))] = int(rng.integers(20, 25))
            if rng.random() < 0.5:  # a repeat: what prompt lookup lives on
                start = int(rng.integers(0, len(seq) - 3))
                seq += seq[start : start + int(rng.integers(1, 10))]
            else:
                seq += [int(t) for t in rng.integers(0, 20, int(rng.integers(1, 4)))]
        want = [int(w) for w in rng.integers(1, 8, 2)]
        prop = pl.propose([0, 1], seqs, torch.tensor(want), params, [None, None])
        fresh = PromptLookup(max_ngram=12).propose([0, 1], seqs, torch.tensor(want), params, [None, None])
        assert torch.equal(prop.tokens, fresh.tokens) and torch.equal(prop.num_draft, fresh.num_draft)
        assert prop.accept_probs is not None and prop.accept_probs.dtype == torch.float32
        for row, seq in enumerate(seqs):
            start, length = _naive_vote(seq, pl.max_ngram, pl.vote_below)
            draft = seq[start : start + want[row]] if length else []
            n = int(prop.num_draft[row])
            assert n == len(draft) and prop.tokens[row, :n].tolist() == draft
            assert not prop.tokens[row, n:].any() and not prop.accept_probs[row, n:].any()
            # The learned estimate for each copied token, from the scalar path.
            estimates = [pl.acceptance(row, length + i) for i in range(n)]
            assert torch.equal(prop.accept_probs[row, :n], torch.tensor(estimates, dtype=torch.float32))
            proposed += n
    assert len(seqs[1]) > 512 and proposed > 1000  # past two doublings of the buffer, drafting throughout
