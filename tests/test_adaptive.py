"""Adaptive draft length: what evidence moves a sequence's k."""

from __future__ import annotations

import torch

from verispec.adaptive import adapt_k
from verispec.config import GenerationConfig
from verispec.engine import SequenceState


def _seq(k: int, configured: int = 4) -> SequenceState:
    config = GenerationConfig(max_new_tokens=32, num_speculative_tokens=configured, adaptive=True)
    return SequenceState(tokens=[1, 2], prompt_len=2, config=config, generator=torch.Generator(), k=k)


def test_full_acceptance_grows_k_up_to_twice_the_configured() -> None:
    assert adapt_k(_seq(4), drafted=4, accepted=4) == 5
    assert adapt_k(_seq(8), drafted=8, accepted=8) == 8


def test_rejection_of_a_full_draft_shrinks_k_but_not_to_zero() -> None:
    assert adapt_k(_seq(6), drafted=6, accepted=2) == 3
    assert adapt_k(_seq(2), drafted=2, accepted=0) == 1
    assert adapt_k(_seq(1), drafted=1, accepted=0) == 1


def test_drafts_shorter_than_allowed_leave_k_alone() -> None:
    # The drafter stopped by itself (short match, low confidence): no evidence about the cap.
    assert adapt_k(_seq(8), drafted=2, accepted=0) == 8
    assert adapt_k(_seq(8), drafted=2, accepted=2) == 8
    assert adapt_k(_seq(4), drafted=0, accepted=0) == 4


def test_a_cap_on_drafts_cut_by_cost_never_shrinks_below_the_configured_k() -> None:
    seq = _seq(6, configured=4)
    seq.cut_by_cost = True  # the engine chose the length from acceptance estimates and cost
    assert adapt_k(seq, drafted=6, accepted=1) == 4
    assert adapt_k(seq, drafted=6, accepted=6) == 7
    seq.k = 4
    assert adapt_k(seq, drafted=4, accepted=0) == 4
