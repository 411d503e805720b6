"""Prompt lookup first, a trained draft where lookup has nothing good: the default drafter.

The two drafters are strong in different places. Prompt lookup costs nothing and, after a long
match, is accepted nine times in ten, but most steps of open-ended text have no match worth copying.
A trained draft (the EAGLE head shipped for the default model) is accepted about 40% of the time
everywhere but costs a draft token's forward (0.04-0.07 of a target step on the kernel, session 4;
0.11-0.16 in session 24, once the target's step had become 4-7 times faster). :class:`LookupFirst`
asks both every step: lookup's proposal comes with its estimated chances of acceptance; the draft's
chance of acceptance per position is learned per sequence from what the target went on to commit
(from a prior). Each row takes the proposal that promises more tokens per unit of cost: the
target's measured cost of verifying it (the engine's :class:`~verispec.costs.StepCosts`), plus for
the draft its own measured cost per token; and the draft drafts only as many tokens as pay. The
engine then cuts either to the length worth verifying at the measured cost
(``Proposal.accept_probs``), and verification is the same exact rejection sampling either way: the
choice only moves speed, never the output distribution.

The draft is shown every committed token even in steps it does not draft (``observe``), so its
state is the same whichever drafter a row used last.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from verispec.costs import DraftTimes, StepCosts, best_rate, fixed_ratios
from verispec.proposers import AcceptanceCounts, PromptLookup, Proposal, Proposer, _empty
from verispec.sampling import SamplingTensors, is_seeded

DRAFT_COST_PRIOR = 0.1
"""The draft's cost per token in target steps before it is measured (:class:`LookupFirst`)."""

DRAFT_ACCEPTANCE_PRIOR = 0.4
"""Prior chance that a trained draft's token is accepted given the ones before it were: about the
shipped EAGLE head's first-token acceptance on Spec-Bench prompts (benchmarks/DRAFTS.md)."""


class LookupFirst:
    """Per row, prompt lookup's proposal or the draft's, whichever promises more accepted tokens.

    Args:
        draft: a proposer (the shipped EAGLE head, a draft model); ``observe(slots, committed)``, when
            it has one, is called for rows it did not draft for, to keep its state current.
        lookup: the prompt-lookup drafter (default: a new :class:`PromptLookup`).
        draft_tokens: at most this many draft-model tokens per step (lookup may use all of k).
        draft_cost: the draft's cost per token in target steps, charged with the verification
            when choosing. None (the default): measured, as the median seconds per token of this
            proposer's recent draft calls over the target's one-token step (``costs``), and
            :data:`DRAFT_COST_PRIOR` until both are known. It moves with the target: 0.04-0.07 of a
            float32 step on the kernel in session 4, 0.11-0.16 in session 24.
        costs: the target's measured step costs (:func:`verispec.costs.costs_for`, which the
            engine fills); None prices verification by the fixed curve (``fixed_ratios``) and leaves
            the draft's cost at its prior.
        prior, prior_weight: the draft's prior acceptance per position, and how many observations it
            counts as.
    """

    def __init__(
        self,
        draft: Proposer,
        lookup: PromptLookup | None = None,
        *,
        draft_tokens: int = 2,
        draft_cost: float | None = None,
        costs: StepCosts | None = None,
        prior: float = DRAFT_ACCEPTANCE_PRIOR,
        prior_weight: float = 4.0,
    ):
        if draft_tokens < 1:
            raise ValueError("draft_tokens must be >= 1")
        if not 0.0 <= prior <= 1.0 or prior_weight <= 0:
            raise ValueError("need a prior in [0, 1] and prior_weight > 0")
        self.draft = draft
        self.lookup = lookup if lookup is not None else PromptLookup()
        self.draft_tokens = draft_tokens
        self.fixed_draft_cost = None if draft_cost is None else float(draft_cost)
        self.costs = costs
        self._draft_times = DraftTimes()
        """The draft's recent calls, seconds per drafted token."""
        self._stats = AcceptanceCounts([prior] * draft_tokens, prior_weight)
        """The draft's acceptance by position in its proposal, learned per slot."""
        self.chosen = {"lookup": 0, "draft": 0}
        """Rows that took each drafter's proposal, over the proposer's life."""

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        self.lookup.start(slot, tokens)
        self.draft.start(slot, tokens)
        self._stats.start(slot)

    def draft_cost(self, batch: int = 1, context: int = 0, measured: bool = True) -> float:
        """The draft's cost per token in target steps (see the class's ``draft_cost``); with
        ``measured`` False, never the clock's: the fixed cost, else :data:`DRAFT_COST_PRIOR`."""
        if self.fixed_draft_cost is not None:
            return self.fixed_draft_cost
        timed = self._draft_times.in_steps(self.costs, batch, context) if measured else None
        return DRAFT_COST_PRIOR if timed is None else timed

    def _prices(self, k: int, batch: int, context: int, seeded: bool) -> tuple[list[float], float]:
        """The verification curve for up to k drafts and the draft's cost per token: measured, or
        for a seeded sampled row the fixed curve (``fixed_ratios``) and the unmeasured cost."""
        if seeded or self.costs is None:
            curve = fixed_ratios(k + 1)
        else:
            curve = self.costs.ratios(k + 1, batch, context)
        return curve, self.draft_cost(batch, context, measured=not seeded)

    def acceptance(self, slot: int) -> list[float]:
        """The draft's estimated conditional acceptance at each position for this slot."""
        return self._stats.estimates(slot)[: self.draft_tokens]

    def propose(
        self,
        slots: list[int],
        committed: list[list[int]],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        batch = len(slots)
        k = int(num_tokens.max()) if batch else 0
        if k == 0:
            return _empty(batch)
        for slot, toks in zip(slots, committed):
            self._stats.learn(slot, toks)
        look = self.lookup.propose(slots, committed, num_tokens, params, generators)
        assert look.accept_probs is not None  # prompt lookup always estimates its tokens
        n_draft = min(k, self.draft_tokens)
        estimates = [self.acceptance(slot)[:n_draft] for slot in slots]
        context = max((len(toks) for toks in committed), default=0)
        temperature = params.temperature.tolist()
        prices: dict[bool, tuple[list[float], float]] = {}  # built once per step, only those needed
        use_draft, lengths = [], []
        for row, est in enumerate(estimates):
            # A seeded sampled row is priced without the clock: which drafter and how many tokens
            # decide how its random numbers are consumed, and the seed must reproduce the response.
            seeded = is_seeded(generators[row]) and temperature[row] > 0
            if seeded not in prices:
                prices[seeded] = self._prices(k, batch, context, seeded)
            curve, cost = prices[seeded]
            n = int(look.num_draft[row])
            from_lookup, _ = best_rate(look.accept_probs[row, :n].tolist(), curve)
            from_draft, length = best_rate(est[: int(num_tokens[row])], curve, cost)
            use_draft.append(length > 0 and from_draft > from_lookup)
            lengths.append(length)
        rows = [r for r, u in enumerate(use_draft) if u]
        rest = [r for r, u in enumerate(use_draft) if not u]
        observe = getattr(self.draft, "observe", None)
        if rest and observe is not None:
            observe([slots[r] for r in rest], [committed[r] for r in rest])
        self.chosen["draft"] += len(rows)
        self.chosen["lookup"] += sum(1 for r in rest if int(look.num_draft[r]) > 0)
        if not rows:
            return look
        start = time.perf_counter()
        sub = self.draft.propose(
            [slots[r] for r in rows],
            [committed[r] for r in rows],
            torch.tensor([lengths[r] for r in rows], dtype=num_tokens.dtype),
            params.select(rows),
            [generators[r] for r in rows],
        )
        self._draft_times.record(time.perf_counter() - start, int(sub.num_draft.max()))
        tokens = look.tokens.clone()  # [B, k]; the draft's rows are at most n_draft <= k wide
        num = look.num_draft.clone()
        accept = look.accept_probs.clone()
        probs = alts = alt_probs = None
        if sub.alternatives is not None and sub.alternative_probs is not None:
            # A greedy tree: lookup's rows have no alternatives.
            alts = torch.full((batch, k, sub.alternatives.shape[-1]), -1, dtype=torch.int64)
            alt_probs = torch.zeros(batch, k, sub.alternatives.shape[-1])
        if sub.probs is not None:  # sampling: lookup's rows are point masses on their tokens
            probs = torch.zeros(batch, k, sub.probs.shape[-1], dtype=sub.probs.dtype)
            probs.scatter_(2, tokens[:, :, None], 1.0)
        for i, r in enumerate(rows):
            m = int(sub.num_draft[i])
            drafted = sub.tokens[i, :m]
            tokens[r] = 0
            tokens[r, :m] = drafted
            num[r] = m
            accept[r] = 1.0
            # The draft's own per-token estimates when it gives them (an EAGLE head's confidence),
            # else what this sequence's history says about its positions.
            own = sub.accept_probs
            accept[r, :m] = own[i, :m] if own is not None else torch.tensor(estimates[r][:m])
            if probs is not None:
                probs[r] = 0.0
                probs[r, :m] = sub.probs[i, :m]
            if alts is not None and alt_probs is not None:
                alts[r, :m] = sub.alternatives[i, :m]
                alt_probs[r, :m] = sub.alternative_probs[i, :m]
            self._stats.remember(slots[r], len(committed[r]), range(m), drafted.tolist())
        return Proposal(
            tokens=tokens,
            probs=probs,
            num_draft=num,
            accept_probs=accept,
            alternatives=alts,
            alternative_probs=alt_probs,
        )
