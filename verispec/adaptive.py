"""Adaptive draft length and the expected-speedup model used by ``verispec tune``.

With per-token acceptance rate ``a`` (i.i.d. approximation of Leviathan et al., 2023) and draft cost
``c`` relative to a target step, a draft of length k yields ``(1 - a^(k+1)) / (1 - a)`` tokens per step
at a cost of ``k c + v(k)`` target steps, where ``v(k)`` is the target's cost of verifying k + 1 tokens
relative to one (1 in the paper's idealisation; measured here, since it is not 1 on a CPU).
"""

from __future__ import annotations

from verispec.engine import SequenceState


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens from verifying a draft of k tokens: ``(1 - a^(k+1)) / (1 - a)``."""
    a = min(max(acceptance, 0.0), 0.999999)
    return (1 - a ** (k + 1)) / (1 - a)


def expected_speedup(acceptance: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Expected tokens per unit of target-step time, relative to plain decoding."""
    if k == 0:
        return 1.0
    return expected_tokens(acceptance, k) / (k * draft_cost + verify_cost)


def best_k(acceptance: float, draft_cost: float, verify_cost=lambda k: 1.0, k_max: int = 16) -> int:
    """The k in 0..k_max with the highest expected speedup (``verify_cost(k)`` per target step)."""
    return max(range(k_max + 1), key=lambda k: expected_speedup(acceptance, k, draft_cost, verify_cost(k)))


def adapt_k(seq: SequenceState, drafted: int, accepted: int) -> int:
    """Next draft length for one sequence: grow after a fully accepted draft, shrink after a rejection.

    Bounded by 1 and twice the configured k, so a run of easy text can speculate further than asked
    and a hard stretch falls back to cheap one-token drafts without switching speculation off.
    Only drafts that used the whole allowance count: a drafter that stopped short by itself (prompt
    lookup after a short match, a draft model below its confidence threshold) says nothing about
    whether the allowance is right, and shrinking it would cut the next long, likely match short.
    A draft cut by measured cost (``seq.cut_by_cost``: the drafter estimates its acceptance and
    learns from its rejections) already has its length chosen each step; for it k is only a cap,
    which grows after full acceptance and never shrinks below the configured k (a rejection would
    otherwise stop the next long copy early, where the estimate knows it is likely to hold).
    """
    if drafted == 0 or drafted < seq.k:  # no draft, or the drafter chose its own length
        return seq.k
    upper = max(1, 2 * seq.config.num_speculative_tokens)
    if accepted == drafted:
        return min(upper, seq.k + 1)
    floor = seq.config.num_speculative_tokens if seq.cut_by_cost else 1
    return max(floor, 1, min(seq.k - 1, accepted + 1))
