"""What a verification step costs, measured while generating, and the draft length it makes worth it.

Speculation pays only when the tokens a step is expected to emit outgrow what the wider step costs.
On a CPU that cost is far from the idealised 1 (Leviathan et al., 2023), and it differs by machine
and weight format: a forward over 5 tokens cost 1.0-1.2 one-token steps with float32 weights on the
Xeon of sessions 9-17, 2.1 on a Zen 3 EPYC reading float32 from the GGUF's 4-bit blocks, and 1.3-1.6
with int8 weights (``benchmarks/SESSIONS.md``); it also moves with the context's length and the
machine's load. So the engine times every step by its width (tokens per row) and its context and
keeps the figures per target (:func:`costs_for`), starting from a curve measured once per machine
where the target has one, and :func:`best_draft_length` picks, per row, the draft length with
the most expected tokens per unit of measured cost, given the drafter's estimate of each draft
token's chance of acceptance (:attr:`verispec.proposers.Proposal.accept_probs`).
"""

from __future__ import annotations

import statistics
import weakref
from collections import deque
from collections.abc import Sequence

PRIOR_EXTRA_TOKEN_COST = 0.05
"""Cost of each further token of a step before any is measured, relative to a one-token step, where
no curve measured on this machine is known (:attr:`StepCosts.prior`). Optimistic on purpose: an
unmeasured width gets tried and measured instead of never being used."""


CONTEXT_BUCKET_TOKENS = 256
"""Cached tokens below which a step's cost counts as a short context's (:func:`context_bucket`)."""


def context_bucket(context: int) -> int:
    """The bucket of a step over ``context`` cached tokens: 0 below :data:`CONTEXT_BUCKET_TOKENS`
    (256), then one per doubling (256-511 -> 1, 512-1023 -> 2, 1024-2047 -> 3, ...).

    A wider step's extra cost grows with the context: its attention reads the cache once per token
    while the weights are read once for all. SmolLM2-135M, int8 weights, on the Xeon (median of 9,
    ``benchmarks/SESSIONS.md``, session 15): 5 tokens over 1 cost 1.22 at 50 cached tokens, 1.23 at 200,
    1.40 at 500, 1.41 at 1000 and 1.53 at 1500; 9 tokens 1.82, 1.85, 2.34, 2.23 and 2.35.
    """
    return (max(0, context) // CONTEXT_BUCKET_TOKENS).bit_length()


class StepCosts:
    """Running cost of a target step by (batch size, context bucket, width), relative to a one-token
    step over the same batch at the same context bucket (:func:`context_bucket`).

    Each step of width w > 1 is stored as its time over the current median one-token time of its
    batch size and context bucket, so the figure compares calls made at about the same context
    length and machine load; the ratio of a width is the median of its recent samples (a thread
    probe or another process's burst is one outlier). A wider step in a bucket without a one-token
    time yet is not recorded. Samples expire after ``horizon`` steps in their bucket: a width judged
    too dear during a burst of load is no longer drafted, so nothing would correct its figure; once
    expired, the optimistic extrapolation has it tried and measured again (a few steps every
    ``horizon``). Counting steps per bucket keeps the figures of contexts seen rarely (long prompts
    among many short ones) until they are needed again.

    A bucket with nothing measured at or below a width borrows the nearest shorter bucket that has
    it, else takes the prior: both are optimistic, so the width gets tried and measured in its own
    bucket. A longer context's figure would be pessimistic, and a width never drafted there would
    never be measured.
    """

    window: int = 31
    """Samples kept per (batch, bucket, width)."""
    min_samples: int = 3
    """Unexpired samples a width needs before its own median replaces the extrapolation."""
    horizon: int = 512
    """Steps (of any width) in its bucket after which a sample of a wider step expires."""

    def __init__(self, prior: Sequence[float] | None = None) -> None:
        self.prior: list[float] | None = [float(v) for v in prior] if prior and len(prior) >= 2 else None
        """``[v(1), ..., v(W)]`` measured once on this machine for this target (greedy steps at a short
        context, :func:`verispec.models.schedule.apply_step_costs`), which stands in for
        :data:`PRIOR_EXTRA_TOKEN_COST` until this process has timed a width itself; None: that
        constant."""
        self._single: dict[tuple[int, int], deque[float]] = {}
        """Per (batch, bucket), the recent one-token step times."""
        self._ratios: dict[tuple[int, int, int], deque[tuple[int, float]]] = {}
        """Per (batch, bucket, width), the recent (step, ratio) samples."""
        self._orders: dict[tuple[int, int], list[int]] = {}
        """Per (batch, bucket), :meth:`_bucket_order`'s answer until a width or bucket is first
        sampled."""
        self._steps: dict[tuple[int, int], int] = {}
        """Per (batch, bucket), the steps recorded there (the clock of its samples' expiry)."""
        self._medians: dict[tuple[int, int, int], tuple[float, float | None]] = {}
        """Per (batch, bucket, width), the last :meth:`_measured` answer until a sample arrives: (step
        at which its oldest sample expires, median). Every step asks for every width, and a median
        over the window each time cost more than the rest of choosing a draft length."""

    def record(self, batch: int, width: int, seconds: float, context: int = 0) -> None:
        """One step over ``batch`` rows of ``width`` tokens, after ``context`` cached tokens (the
        longest row's), took ``seconds``."""
        bucket = context_bucket(context)
        now = self._steps[batch, bucket] = self._steps.get((batch, bucket), 0) + 1
        if width <= 1:
            self._single.setdefault((batch, bucket), deque(maxlen=self.window)).append(seconds)
            return
        single = self._single.get((batch, bucket))
        if not single:
            return  # nothing to compare with yet
        base = statistics.median(single)
        if base > 0:
            key = (batch, bucket, width)
            samples = self._ratios.get(key)
            if samples is None:
                samples = self._ratios[key] = deque(maxlen=self.window)
                self._orders.clear()  # a bucket may have gained its first samples
            samples.append((now, seconds / base))
            self._medians.pop(key, None)

    def _measured(self, batch: int, bucket: int, width: int) -> float | None:
        """Median of the unexpired samples of ``width`` in ``bucket``, if there are enough."""
        key = (batch, bucket, width)
        samples = self._ratios.get(key)
        if not samples:
            return None
        now = self._steps.get((batch, bucket), 0)
        cached = self._medians.get(key)
        if cached is not None and now < cached[0]:
            return cached[1]
        recent = [(step, r) for step, r in samples if step > now - self.horizon]
        value = statistics.median(r for _, r in recent) if len(recent) >= self.min_samples else None
        # Valid until a new sample arrives or the oldest one used expires (None: until a new sample).
        expires = recent[0][0] + self.horizon if recent and value is not None else float("inf")
        self._medians[key] = (expires, value)
        return value

    def _ratio_in(self, batch: int, bucket: int, width: int) -> float | None:
        """``v(width)`` from ``bucket``'s samples alone: its own median, else the widest measured
        width below extrapolated at that width's cost per extra token (at least the prior's); None
        when no width in 2..``width`` is measured there."""
        own = self._measured(batch, bucket, width)
        if own is not None:
            return own
        for w in range(width - 1, 1, -1):  # the widest measured width below
            v = self._measured(batch, bucket, w)
            if v is not None:
                per_token = max(PRIOR_EXTRA_TOKEN_COST, (v - 1.0) / (w - 1))
                return v + per_token * (width - w)
        return None

    def _bucket_order(self, batch: int, context: int) -> list[int]:
        """The buckets to read a ratio from: the context's own, then shorter ones with samples,
        nearest first. Kept until a width or bucket is first sampled."""
        home = context_bucket(context)
        order = self._orders.get((batch, home))
        if order is None:
            shorter = {b for (n, b, _) in self._ratios if n == batch and b < home}
            order = self._orders[batch, home] = [home, *sorted(shorter, reverse=True)]
        return order

    def ratio(self, width: int, batch: int = 1, context: int = 0) -> float:
        """``v(width)``: a step of ``width`` tokens per row over a one-token step (1 for width <= 1),
        after ``context`` cached tokens.

        An unmeasured width extrapolates the widest measured one below it at that width's own cost
        per extra token (at least the prior's); with nothing measured in the context's bucket, the
        nearest shorter bucket's figure (see the class); with nothing there either, the prior.
        """
        if width <= 1:
            return 1.0
        for bucket in self._bucket_order(batch, context):
            v = self._ratio_in(batch, bucket, width)
            if v is not None:
                return v
        return self.prior_ratio(width)

    def prior_ratio(self, width: int) -> float:
        """``v(width)`` before this process has measured anything: :attr:`prior` (past its widest
        width, extended at its mean cost per extra token, at least :data:`PRIOR_EXTRA_TOKEN_COST`),
        else :data:`PRIOR_EXTRA_TOKEN_COST` per extra token."""
        prior = self.prior
        if width <= 1 or prior is None:
            return _guess(width)
        if width <= len(prior):
            return prior[width - 1]
        per_token = max(PRIOR_EXTRA_TOKEN_COST, (prior[-1] - 1.0) / (len(prior) - 1))
        return prior[-1] + per_token * (width - len(prior))

    def step_seconds(self, batch: int = 1, context: int = 0) -> float | None:
        """Median seconds of a recent one-token step over ``batch`` rows after ``context`` cached
        tokens: its bucket's, else the nearest shorter bucket's with any; None before any."""
        home = context_bucket(context)
        for bucket in range(home, -1, -1):
            single = self._single.get((batch, bucket))
            if single:
                return statistics.median(single)
        return None

    def ratios(self, widths: int, batch: int = 1, context: int = 0) -> list[float]:
        """``[v(1), ..., v(widths)]`` after ``context`` cached tokens."""
        return [self.ratio(w, batch, context) for w in range(1, widths + 1)]


class DraftTimes:
    """A drafter's recent seconds per drafted token, read as a fraction of the target's one-token
    step (:meth:`StepCosts.step_seconds`): what :class:`~verispec.lookup_first.LookupFirst` and
    the EAGLE head's stopping rule charge per draft token."""

    window: int = 31
    """Draft calls kept."""

    def __init__(self) -> None:
        self._seconds: deque[float] = deque(maxlen=self.window)

    def record(self, seconds: float, tokens: int) -> None:
        """A draft call that took ``seconds`` for ``tokens`` positions (none: not recorded)."""
        if tokens > 0:
            self._seconds.append(seconds / tokens)

    def in_steps(self, costs: StepCosts | None, batch: int = 1, context: int = 0) -> float | None:
        """The median seconds per token over ``costs``' one-token step; None until both exist."""
        step = costs.step_seconds(batch, context) if costs is not None else None
        if not self._seconds or not step:
            return None
        return statistics.median(self._seconds) / step


def _guess(width: int) -> float:
    """``v(width)`` with nothing measured, on this machine or in this process:
    :data:`PRIOR_EXTRA_TOKEN_COST` per extra token."""
    return 1.0 + PRIOR_EXTRA_TOKEN_COST * (max(width, 1) - 1)


FIXED_EXTRA_TOKEN_COST = 0.1
"""Cost of each further token of a step for rows priced without the clock (a sampled request with a
seed, whose response must not depend on measured times): ``v(w) = 1 + 0.1 (w - 1)``, 1.4 for 5
tokens, within what this project measured for its quantised formats on CPUs (1.3-1.7 in w4a8 and
int8; float32 1.97, a GPU near 1). Not the optimistic :data:`PRIOR_EXTRA_TOKEN_COST`, whose optimism
measurement corrects: these rows are never measured. w4a8 at temperature 0.7 and top-p 0.9, ten
Spec-Bench prompts per category, seed 0 (benchmarks/SESSIONS.md, session 44, runs Q and R): at 0.05,
21-22% of the drafted tokens were accepted and prompt lookup ran 1.02x plain (two cells below
0.95x); at 0.1, 27-29% and 1.04x (one cell)."""


def fixed_ratios(widths: int) -> list[float]:
    """The cost curve of rows priced without the clock: ``[v(1), ..., v(widths)]``
    (:data:`FIXED_EXTRA_TOKEN_COST`)."""
    return [1.0 + FIXED_EXTRA_TOKEN_COST * (w - 1) for w in range(1, widths + 1)]


_BY_TARGET: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def costs_for(target: object) -> StepCosts:
    """The step costs measured for ``target`` so far, shared by every engine that runs it (a
    request's engine is short-lived; what its steps measured stays with the model). Their prior is
    the target's ``step_cost_prior`` where it has one (the kernel ``FastLlama``'s, measured once per
    machine), so that a fresh process prices its first drafts at this machine's costs."""
    prior = getattr(target, "step_cost_prior", None)  # a curve measured once on this machine
    try:
        costs = _BY_TARGET.get(target)
        if costs is None:
            costs = _BY_TARGET[target] = StepCosts(prior)
        return costs
    except TypeError:  # not weakly referenceable or not hashable: measure per engine
        return StepCosts(prior)


EXTRA_COST_WEIGHT = 1.0
"""Weight on the measured extra cost of a wider step when choosing the draft length: drafting L
tokens is judged to cost ``1 + EXTRA_COST_WEIGHT * (v(L + 1) - 1)``; above 1, a draft must beat
break-even by a margin (at 1.5 a copied token must be accepted 1.5 times as often as break-even).
Replaying the rule on held-out Spec-Bench outputs (``benchmarks/lookup_rule.py``, questions 6-9 of
each category) favoured 1.5 by 0.2-2% overall, but the one benchmark run with 1.5 cut prompt
lookup's tokens per call on extraction and rag (float32 2.3 -> 2.0, 1.66 -> 1.49) for no gain on
coding, so the plain figures stay the default (see benchmarks/SESSIONS.md, session 3 second pass)."""


def best_draft_length(
    accept_probs: Sequence[float],
    costs: Sequence[float],
    extra_cost_weight: float = EXTRA_COST_WEIGHT,
    lookahead: bool = True,
) -> int:
    """The draft length L in 0..len(accept_probs) with the most expected tokens per unit of cost.

    ``accept_probs[i]``: the chance draft token i is accepted given that tokens 0..i-1 were;
    ``costs[L]``: the cost of verifying L drafts (a step of L + 1 tokens) relative to a plain step
    (``costs[0]`` = 1). A step emits one token plus every accepted draft token, so drafting L yields
    ``1 + sum_{i<L} prod_{j<=i} accept_probs[j]`` tokens for ``costs[L]``; L = 0 (a plain step,
    1 token for 1) wins whenever no draft pays for its verification. Each cost's excess over a plain
    step is weighed by ``extra_cost_weight`` (see :data:`EXTRA_COST_WEIGHT`).

    ``lookahead=False`` makes it a stopping rule: the first length whose next token does not raise
    the rate, so whether token i is kept depends on the estimates of tokens 0..i only. Sampled
    drafts need that: a draft model's estimate for token i + 1 depends on which token i it drew,
    and a token verified or not depending on which token it is breaks rejection sampling's law
    (``test_sampled_draft_lengths_never_look_at_later_tokens``). Point-mass and greedy drafts are
    functions of the context, and may look ahead.
    """
    return best_rate(accept_probs, costs, extra_cost_weight=extra_cost_weight, lookahead=lookahead)[1]


def best_rate(
    accept_probs: Sequence[float],
    costs: Sequence[float],
    per_token: float = 0.0,
    extra_cost_weight: float = EXTRA_COST_WEIGHT,
    lookahead: bool = True,
) -> tuple[float, int]:
    """:func:`best_draft_length`'s rate and length: ``(tokens per unit of cost, L)``, with drafting
    itself charged ``per_token`` one-token steps per draft token (0 where the drafts are already
    made: the engine's cut; a draft model's measured cost where the choice is whether to draft:
    :class:`~verispec.lookup_first.LookupFirst`)."""
    best, best_rate = 0, 1.0 / costs[0]
    tokens, reach = 1.0, 1.0
    for length, p in enumerate(accept_probs[: len(costs) - 1], start=1):
        reach *= p
        tokens += reach
        rate = tokens / (1.0 + extra_cost_weight * (costs[length] - 1.0) + per_token * length)
        if rate > best_rate:
            best, best_rate = length, rate
        elif not lookahead:
            break
    return best_rate, best


def best_tree(
    accept_probs: Sequence[float],
    alternatives: Sequence[Sequence[float]],
    costs: Sequence[float],
    extra_cost_weight: float = EXTRA_COST_WEIGHT,
) -> tuple[int, list[tuple[int, int]]]:
    """:func:`best_draft_length` for a chain of drafts with alternatives beside it (greedy only).

    ``accept_probs[i]``: the chance chain token i is accepted given that tokens 0..i-1 were;
    ``alternatives[i][s]``: the chance that alternative s to chain token i is the target's token
    there, given that tokens 0..i-1 were accepted. An alternative is a leaf: verified beside chain
    token i, it adds one token (itself; the target's next token follows from its logits) when the
    chain misses at i and it hits. Every node's expected tokens are the chance that verification
    reaches and accepts it: ``prod_{j<i} a_j * a_i`` for chain token i, ``prod_{j<i} a_j * q`` for an
    alternative. Nodes are taken in order of that value (a chain token comes before the later
    chain tokens, and an alternative only after its chain token) and the prefix
    with the most expected tokens per unit of cost wins; ``costs[N]`` is the cost of verifying N
    nodes (a step of N + 1 tokens).

    Returns ``(chain length L, [(i, s), ...])``: the chosen alternatives, each beside chain token
    ``i < L``.
    """
    nodes: list[tuple[float, int, int, int]] = []  # (value, position, 0 chain / 1 alternative, s)
    reach = 1.0
    for i, p in enumerate(accept_probs):
        nodes.append((reach * p, i, 0, 0))
        if i < len(alternatives):
            nodes.extend((reach * q, i, 1, s) for s, q in enumerate(alternatives[i]))
        reach *= p
    nodes.sort(key=lambda n: (-n[0], n[1], n[2], n[3]))
    # An alternative is verified beside its chain token: one ranked above that token (a drafter
    # that rates it above its own choice) is dropped.
    taken, ordered = 0, []
    for node in nodes:
        if node[2] == 0:
            taken += 1
        elif node[1] >= taken or node[0] <= 0.0:
            continue
        ordered.append(node)
    nodes = ordered
    best, best_rate = 0, 1.0 / costs[0]
    tokens = 1.0
    for count, node in enumerate(nodes[: len(costs) - 1], start=1):
        tokens += node[0]
        rate = tokens / (1.0 + extra_cost_weight * (costs[count] - 1.0))
        if rate > best_rate:
            best, best_rate = count, rate
    chosen = nodes[:best]
    length = sum(1 for n in chosen if n[2] == 0)
    return length, sorted((n[1], n[3]) for n in chosen if n[2] == 1)
