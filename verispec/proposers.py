"""Drafters behind one interface.

A :class:`Proposer` sees each row's committed tokens and returns up to k draft tokens per row, with
the distributions they were drawn from (or None: a point mass, as for n-gram lookup). The engine never
asks which proposer it holds.

- :class:`DraftModelProposer`: a smaller model sharing the target's tokenizer (Leviathan et al., 2023),
  with its own KV cache, rolled back to the committed tokens before each proposal.
- :class:`PromptLookup`: continue the longest recent n-gram that occurred earlier in the prompt or
  output (Saxena, 2023, "Prompt Lookup Decoding"); no second model. It estimates each copied token's
  chance of acceptance from the match length, learned per sequence from a measured prior, so the
  engine drafts only what pays for its verification.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from verispec.models.base import KVModel
from verispec.rejection import inverse_cdf, uniforms
from verispec.sampling import SamplingTensors, logits_to_probs


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for a batch of rows."""

    tokens: torch.Tensor  # [B, k] int64; slots past num_draft hold 0
    probs: torch.Tensor | None  # [B, k, V] distributions the tokens were drawn from; None = point mass
    num_draft: torch.Tensor  # [B] int64, real drafts per row (<= k)
    accept_probs: torch.Tensor | None = None
    """[B, k] float: the drafter's estimate that token i is accepted given that tokens 0..i-1 were;
    None = no estimate. With one, the engine cuts each row's draft to the length worth verifying at
    the measured cost (:func:`verispec.costs.best_draft_length`)."""
    alternatives: torch.Tensor | None = None
    """[B, k, S] int64: greedy only, up to S other candidates for draft position i (-1: none), each
    a leaf the target may verify beside token i (a tree of drafts, :func:`verispec.costs.best_tree`);
    None = a plain chain."""
    alternative_probs: torch.Tensor | None = None
    """[B, k, S] float: the drafter's estimate that each alternative is the target's token at
    position i, given that tokens 0..i-1 were accepted."""


@runtime_checkable
class Proposer(Protocol):
    """Proposes draft tokens; owns whatever state it needs per batch slot."""

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        """A sequence with these committed tokens now occupies ``slot``."""

    def propose(
        self,
        slots: list[int],
        committed: list[list[int]],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        """Propose up to ``num_tokens[i]`` (``[B]`` int64) tokens after ``committed[i]`` for ``slots[i]``."""


def draw(
    logits: torch.Tensor, params: SamplingTensors, generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row from ``logits`` ``[B, V]``: ``(tokens [B], probs [B, V] or None)``.

    Greedy rows take the argmax and need no distribution (greedy verification compares tokens only);
    otherwise the token is drawn from the same ``logits_to_probs`` the target's verification uses.
    """
    if params.all_greedy:
        return logits.argmax(dim=-1), None
    probs = logits_to_probs(logits, params)  # [B, V]
    return inverse_cdf(probs, uniforms(generators, 1)[:, 0].to(probs.device)), probs


def expected_acceptance(probs: torch.Tensor) -> torch.Tensor:
    """A sampled draft token's chance of acceptance as its drafter may report it: ``[B, V]`` draft
    distributions -> ``[B]`` ``sum_x q(x)^2``, the mean of ``q(x)`` over the tokens ``x ~ q``.

    Why not ``q(x)`` of the token drawn: the engine verifies a token only where its estimate makes it
    worth the cost (``Proposal.accept_probs``), and rejection sampling is exact only for a token
    verified whatever it turned out to be. Verifying ``x`` only when ``q(x)`` is high emits the
    draft's likely tokens too often (tested in ``test_exactness.py``). An estimate from the
    distribution alone (known before the draw) keeps the choice independent of the token. Greedy
    drafts may use ``q(x)``: there the token is a function of the distribution.
    """
    return (probs * probs).sum(dim=-1)


def _empty(batch: int) -> Proposal:
    return Proposal(
        tokens=torch.zeros(batch, 0, dtype=torch.int64),
        probs=None,
        num_draft=torch.zeros(batch, dtype=torch.int64),
    )


def point_mass(rows: Sequence[tuple[Sequence[int], Sequence[float]]], k: int) -> Proposal:
    """A point-mass :class:`Proposal` ``[B, k]`` from per-row lists: each row's draft tokens and
    their estimated chances of acceptance (empty where the row drafts nothing). Filled as arrays,
    one tensor each at the end: a torch call per row costs more than the row."""
    tokens = np.zeros((len(rows), k), dtype=np.int64)
    accept = np.zeros((len(rows), k), dtype=np.float32)
    num_draft = np.zeros(len(rows), dtype=np.int64)
    for row, (found, probs) in enumerate(rows):
        tokens[row, : len(found)] = found
        accept[row, : len(found)] = probs
        num_draft[row] = len(found)
    return Proposal(
        tokens=torch.from_numpy(tokens),
        probs=None,
        num_draft=torch.from_numpy(num_draft),
        accept_probs=torch.from_numpy(accept),
    )


class DraftModelProposer:
    """Drafts by sampling k tokens from a smaller model with the same sampling transform as the target.

    The draft's cache for each slot holds the first ``_agreed[slot]`` committed tokens followed by the
    draft tokens it fed while drafting (``_drafted[slot]``); before proposing, each
    row is rolled back to its longest prefix shared with the committed tokens and the missing tokens
    are fed in one call.
    """

    def __init__(self, model: KVModel, max_batch_size: int = 1, confidence_threshold: float = 0.0):
        self.model = model
        self.confidence_threshold = confidence_threshold
        """Stop drafting a row once the draft's top probability falls below this (0 = never)."""
        self._agreed: dict[int, int] = {}
        self._drafted: dict[int, list[int]] = {}
        self._batch = 0
        self._ensure(max_batch_size)

    def _ensure(self, slots: int) -> None:
        if slots > self._batch:
            self.model.reset(slots)
            self._batch = slots
            self._agreed, self._drafted = {}, {}

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        """Prefill the draft with all committed tokens but the newest."""
        self._ensure(slot + 1)
        self.model.truncate(torch.zeros(1, dtype=torch.int64), rows=[slot])
        prefix = list(tokens[:-1])
        if prefix:
            self.model.forward(torch.tensor([prefix]), rows=[slot], logits="none")
        self._agreed[slot] = len(prefix)
        self._drafted[slot] = []

    def propose(
        self,
        slots: list[int],
        committed: list[list[int]],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        """Sample ``max(num_tokens)`` draft tokens per row, one draft forward per token."""
        batch = len(slots)
        k = int(num_tokens.max()) if batch else 0
        if k == 0:
            return _empty(batch)
        logits = self._catch_up(slots, committed)  # [B, V]
        tokens = torch.zeros(batch, k, dtype=torch.int64)
        probs_out: list[torch.Tensor] = []
        num_draft = num_tokens.clone()
        for i in range(k):
            tok, probs = draw(logits, params, generators)
            if probs is None:  # greedy: only the confidence check below needs a distribution
                probs = torch.softmax(logits, dim=-1) if self.confidence_threshold > 0 else logits
            tokens[:, i] = tok.cpu()
            probs_out.append(probs)
            if self.confidence_threshold > 0:
                # A token the draft itself doubts is likely rejected: stop the row before it.
                low = (probs.max(dim=-1).values.cpu() < self.confidence_threshold) & (num_draft > i)
                num_draft = torch.where(low, torch.tensor(i), num_draft)
            if i + 1 >= int(num_draft.max()):
                break
            logits = self.model.forward(tok[:, None], rows=slots, logits="last")  # [B, V]
        for row, slot in enumerate(slots):
            self._drafted[slot] = tokens[row, : len(probs_out) - 1].tolist()
        used = len(probs_out)
        if params.all_greedy:
            return Proposal(tokens=tokens[:, :used], probs=None, num_draft=num_draft.clamp(max=used))
        return Proposal(
            tokens=tokens[:, :used], probs=torch.stack(probs_out, dim=1), num_draft=num_draft.clamp(max=used)
        )

    def cached_length(self, slot: int) -> int:
        """Tokens the draft's cache holds for ``slot`` (committed prefix plus fed draft tokens)."""
        return self._agreed[slot] + len(self._drafted[slot])

    def _catch_up(self, slots: list[int], committed: list[list[int]]) -> torch.Tensor:
        """Feed each row the committed tokens its cache lacks; return ``[B, V]`` logits after them."""
        need = []
        for slot, toks in zip(slots, committed):
            # Only the drafted tail can disagree with the committed tokens: compare just that.
            common = self._agreed[slot]
            for tok in self._drafted[slot]:
                if common >= len(toks) - 1 or toks[common] != tok:
                    break
                common += 1
            need.append(len(toks) - common)
        width = max(need)
        # Feed the same number of tokens to every row: a row that lacks fewer re-feeds some it holds
        # (rewriting identical cache entries), unless its sequence is too short to do so.
        even = [i for i, toks in enumerate(committed) if len(toks) >= width]
        out: list[torch.Tensor | None] = [None] * len(slots)
        groups = [even] + [[i] for i in range(len(slots)) if i not in even]
        for group in groups:
            if not group:
                continue
            w = width if group is even else need[group[0]]
            rows = [slots[i] for i in group]
            self.model.truncate(torch.tensor([len(committed[i]) - w for i in group]), rows=rows)
            ids = torch.tensor([committed[i][-w:] for i in group])
            logits = self.model.forward(ids, rows=rows, logits="last")
            for j, i in enumerate(group):
                out[i] = logits[j]
                self._agreed[slots[i]] = len(committed[i])
                self._drafted[slots[i]] = []
        return torch.stack(out)  # type: ignore[arg-type]


LOOKUP_BUCKETS = (1, 2, 3, 4, 6, 10, 16, 32)
"""Match lengths at which prompt lookup's acceptance estimate changes (lower bounds of the buckets)."""

LOOKUP_ACCEPTANCE_PRIOR = (0.19, 0.46, 0.60, 0.70, 0.79, 0.85, 0.95, 0.95)
"""Chance that the next copied token is accepted, per bucket of the current match length (a match
continued i times counts as i tokens longer). Measured with SmolLM2-135M, greedy, float32, 64 new
tokens, on held-out Spec-Bench prompts (questions 6 and 7 of each of the 13 categories; the benchmark
uses the first ones): ``python benchmarks/lookup_acceptance.py --skip 5 --per-category 2`` gave
0.19 (496 copied tokens seen), 0.46 (246), 0.60 (195), 0.70 (315), 0.79 (472), 0.85 (356), 0.98 (753)
and 0.94 (1486); the last two, mostly a few long copies in extraction and translation, are pooled."""


class AcceptanceCounts:
    """Per-slot estimates of a drafter's chance of acceptance, one per bucket, learned from the
    tokens committed after each proposal.

    Each bucket's ``prior`` probability counts as ``prior_weight`` observations. A proposal is
    remembered with the bucket of each of its tokens and scored at the next one against what the
    target committed meanwhile (as verification decided or, past the verified drafts, as the target's
    own next tokens went): every token up to and including the first miss is an observation.
    """

    def __init__(self, prior: Sequence[float], prior_weight: float):
        self.prior = tuple(float(p) for p in prior)
        self.prior_weight = float(prior_weight)
        self._fresh = [p * self.prior_weight / self.prior_weight for p in self.prior]
        """The estimates of a slot that has seen nothing: the prior, as :meth:`estimates` rounds it."""
        self._counts: dict[int, tuple[list[float], list[float]]] = {}
        """Per slot, tokens accepted and tokens observed, by bucket (``[buckets]`` each)."""
        self._estimates: dict[int, list[float]] = {}
        """Per slot, :meth:`estimates` as of its last :meth:`learn` (Python floats: after a forward,
        the numpy calls that computed them at every proposal cost more than the drafting)."""
        self._last: dict[int, tuple[int, list[int], list[int]]] = {}
        """Per slot, the previous proposal: (tokens committed then, its tokens' buckets, its tokens)."""

    def start(self, slot: int) -> None:
        """A new sequence in ``slot``: forget what the previous one taught."""
        self._counts[slot] = ([0.0] * len(self.prior), [0.0] * len(self.prior))
        self._estimates[slot] = list(self._fresh)
        self._last.pop(slot, None)

    def estimate(self, slot: int, bucket: int) -> float:
        """The slot's chance of acceptance in ``bucket`` (see :meth:`estimates`)."""
        return self.estimates(slot)[bucket]

    def estimates(self, slot: int) -> list[float]:
        """Per bucket, ``(prior * prior_weight + accepted) / (prior_weight + observed)`` for the slot
        (a list the caller must not change)."""
        found = self._estimates.get(slot)
        return found if found is not None else self._fresh

    def remember(self, slot: int, at: int, buckets: Sequence[int], tokens: Sequence[int]) -> None:
        """A proposal of ``tokens`` made when ``at`` tokens were committed."""
        self._last[slot] = (at, list(buckets), list(tokens))

    def learn(self, slot: int, committed: Sequence[int]) -> None:
        """Score the slot's previous proposal against the tokens committed since."""
        last = self._last.pop(slot, None)
        counts = self._counts.get(slot)
        if last is None or counts is None:
            return
        at, buckets, draft = last
        ok, seen = counts
        for b, proposed, got in zip(buckets, draft, committed[at : at + len(draft)]):
            seen[b] += 1
            if proposed != got:
                break
            ok[b] += 1
        w = self.prior_weight
        self._estimates[slot] = [(p * w + a) / (w + n) for p, a, n in zip(self.prior, ok, seen)]


LOOKUP_VOTE_BELOW = 2
"""Match lengths below which prompt lookup copies the continuation most often seen after the match
(:attr:`PromptLookup.vote_below`): one-token matches. Replaying the cost rule on held-out Spec-Bench
outputs (``benchmarks/lookup_rule.py``, int8 costs at 200 and 1000 cached tokens, k = 8; session 15)
raised the decode speedup on summarization 1.297 -> 1.343 and 1.227 -> 1.256 (questions 6-11),
1.554 -> 1.597 and 1.450 -> 1.468 (questions 12-23), on rag 1.361 -> 1.408 / 1.287 -> 1.320 and
1.734 -> 1.757 / 1.573 -> 1.589, and on reasoning 1.301 -> 1.332; it lost on humanities (1.252 ->
1.233), math (1.298 -> 1.285) and translation (1.552 -> 1.545); all categories 1.252 -> 1.259 and
1.434 -> 1.444. Voting at every match length gained no more."""


def _most_common_latest(tokens: Sequence[int]) -> int:
    """Index into ``tokens`` (oldest first) of the latest occurrence of the most common token; among
    equally common tokens, the one that occurred latest. On Python ints: a handful of tokens per
    call, where numpy's unique and scatter took 40 us against 3-12 here."""
    count: dict[int, int] = {}
    latest: dict[int, int] = {}
    for i, t in enumerate(tokens):
        count[t] = count.get(t, 0) + 1
        latest[t] = i
    return latest[max(count, key=lambda t: (count[t], latest[t]))]


def lookup_bucket(length: int) -> int:
    """Index of the :data:`LOOKUP_BUCKETS` bucket holding match length ``length`` (>= 1)."""
    return bisect.bisect_right(LOOKUP_BUCKETS, length) - 1


class _TokenBuffer:
    """One slot's committed tokens, kept between proposals and extended by the tokens added since the
    last sync instead of converting the whole list at every proposal (which cost a third of one):
    a copy of the list, each token's positions in it, and (built when asked) an int64 array.

    The engine only appends to a slot's list between ``start`` calls; a list that got shorter, or
    whose last :data:`_SYNC_CHECK` already-synced tokens no longer match, is taken again whole.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}
        """Each token's positions in ``tokens``, ascending."""
        self.data = np.empty(256, dtype=np.int64)  # [capacity]; the first `in_array` hold tokens
        self.in_array = 0

    def sync(self, toks: Sequence[int]) -> None:
        """Make the buffer hold ``toks``."""
        n, have = len(toks), len(self.tokens)
        check = min(have, _SYNC_CHECK)
        if n < have or (check and list(toks[have - check : have]) != self.tokens[have - check : have]):
            self.tokens, self.where, self.in_array, have = [], {}, 0, 0
        for i in range(have, n):
            t = int(toks[i])
            self.tokens.append(t)
            self.where.setdefault(t, []).append(i)

    def array(self) -> np.ndarray:
        """``[N]`` int64 view of the synced tokens, valid until the next sync."""
        n, have = len(self.tokens), self.in_array
        if n > self.data.shape[0]:  # double the capacity: appends stay amortised O(1)
            grown = np.empty(max(n, 2 * self.data.shape[0]), dtype=np.int64)
            grown[:have] = self.data[:have]
            self.data = grown
        if n > have:
            self.data[have:n] = self.tokens[have:n]
        self.in_array = n
        return self.data[:n]


_SYNC_CHECK = 8
"""Already-synced tokens compared with the list at each sync (the tail, where a rewrite would be)."""


class PromptLookup:
    """n-gram prompt lookup: find the earlier occurrence of the longest suffix of the sequence and
    propose the tokens that followed it. Among equally long matches it copies the most recent one,
    except below :attr:`vote_below` tokens (a one-token match, by default), where it copies the most
    recent of those followed by the token that most of them were followed by.

    How far to copy is the engine's call, made from measured costs: each proposed token comes with
    the chance it is accepted (``Proposal.accept_probs``), which grows with the match. A match of m
    tokens continued i times is m + i long, so copied token i gets the acceptance of match length
    m + i. That acceptance starts from :data:`LOOKUP_ACCEPTANCE_PRIOR` (a one-token match, a common
    word, is continued about a fifth of the time; a ten-token one nearly always) and is learned per
    sequence: at each proposal the tokens committed since the previous one show how far that copy
    held, as verification decided (or, past the verified drafts, as the target's own next token did).
    Counted as ``prior_weight`` observations, the prior gives way once a sequence has shown its own
    rate. Rows with no match (or one shorter than ``min_ngram``) propose nothing, so the step costs
    what plain decoding costs.
    """

    def __init__(
        self,
        max_ngram: int = 64,
        min_ngram: int = 1,
        tokens_per_match: int | None = None,
        prior: Sequence[float] = LOOKUP_ACCEPTANCE_PRIOR,
        prior_weight: float = 4.0,
        vote_below: int = LOOKUP_VOTE_BELOW,
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if tokens_per_match is not None and tokens_per_match < 1:
            raise ValueError("tokens_per_match must be >= 1")
        if len(prior) != len(LOOKUP_BUCKETS) or not all(0.0 <= p <= 1.0 for p in prior):
            raise ValueError(f"prior needs {len(LOOKUP_BUCKETS)} probabilities, one per match-length bucket")
        if prior_weight <= 0:
            raise ValueError("prior_weight must be > 0")
        if vote_below < 0:
            raise ValueError("vote_below must be >= 0")
        self.max_ngram = max_ngram
        """Longest match searched for (longer matches count as this long)."""
        self.min_ngram = min_ngram
        """Shortest match worth proposing from."""
        self.tokens_per_match = tokens_per_match
        """If set, at most this many draft tokens per matched token (a fixed rule; None: as many as k)."""
        self.vote_below = vote_below
        """When the longest match is shorter than this many tokens and occurred more than once, copy
        from the most recent occurrence whose next token is the most common next token among those
        occurrences; otherwise (and with 0) from the most recent occurrence."""
        self.few_candidates = 48
        """Up to this many earlier occurrences of the last token, the match is found on Python ints;
        beyond, with numpy over all of them at once. After a forward has streamed the weights
        through every cache level each numpy call costs about 7 us, and the vectorised search made
        about fifteen; repetitive text (hundreds of candidates, long matches) needs numpy."""
        self._stats = AcceptanceCounts(prior, prior_weight)
        """Acceptance by match-length bucket, learned per slot."""
        self._buffers: dict[int, _TokenBuffer] = {}
        """Per slot, the committed tokens and where each occurs, extended at each proposal."""

    @property
    def prior(self) -> tuple[float, ...]:
        return self._stats.prior

    @property
    def prior_weight(self) -> float:
        return self._stats.prior_weight

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        """A new sequence: forget what the slot's previous one taught."""
        self._stats.start(slot)
        self._buffers.pop(slot, None)

    def acceptance(self, slot: int, length: int) -> float:
        """Estimated chance that the token copied after a match of ``length`` tokens is accepted."""
        return self._stats.estimate(slot, lookup_bucket(length))

    def propose(
        self,
        slots: list[int],
        committed: list[list[int]],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        """Point-mass proposals copied from earlier in each row's own tokens, with their estimated
        chances of acceptance."""
        batch = len(slots)
        wants = num_tokens.tolist()  # [batch]
        k = max(wants, default=0)
        if k == 0:
            return _empty(batch)
        return point_mass(self.propose_rows(slots, committed, wants), k)

    def propose_rows(
        self, slots: list[int], committed: list[list[int]], wants: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        """:meth:`propose` on Python lists: per row, up to ``wants[i]`` copied tokens and each one's
        estimated chance of acceptance (both empty where the row has no match)."""
        out: list[tuple[list[int], list[float]]] = []
        for slot, toks, want in zip(slots, committed, wants):
            self._stats.learn(slot, toks)
            if want <= 0:
                out.append(([], []))
                continue
            buffer = self._buffers.get(slot)
            if buffer is None:
                buffer = self._buffers[slot] = _TokenBuffer()
            buffer.sync(toks)
            seen = buffer.where.get(buffer.tokens[-1], []) if buffer.tokens else []
            ends = seen[:-1]  # the last token's earlier positions (its own is the last one listed)
            if len(ends) <= self.few_candidates:
                start, length = self._match_among(buffer.tokens, ends)
            else:
                start, length = self.match(buffer.array(), np.asarray(ends, dtype=np.int64))
            if length < self.min_ngram:
                out.append(([], []))
                continue
            found = buffer.tokens[start : start + self._cap(length, want)]
            buckets = [lookup_bucket(length + i) for i in range(len(found))]
            estimate = self._stats.estimates(slot)  # [buckets]
            out.append((found, [estimate[b] for b in buckets]))
            self._stats.remember(slot, len(toks), buckets, found)
        return out

    def _cap(self, length: int, k: int) -> int:
        return k if self.tokens_per_match is None else min(k, self.tokens_per_match * length)

    def match(self, seq: Sequence[int] | np.ndarray, ends: np.ndarray | None = None) -> tuple[int, int]:
        """``(start, length)``: the longest suffix of ``seq`` ``[N]`` that also occurs earlier
        (ending before the last token), most recent first among equals; ``start`` is the index of
        the token that followed that occurrence. ``(0, 0)`` when even the last token never occurred.
        ``ends`` ``[C]``: the earlier positions of the last token, ascending, when already known.
        """
        a = np.asarray(seq)
        n = a.shape[0]
        if n < 2:
            return 0, 0
        if ends is None:
            ends = np.flatnonzero(a[:-1] == a[-1])  # [C] candidate occurrences, by their last index
        if ends.size == 0:
            return 0, 0
        # Compare every candidate with the suffix at all offsets at once ([C, L] booleans) and
        # count each one's leading run of equal tokens: one pass of numpy instead of a round per
        # matched token (repetitive text, where many candidates match long, cost milliseconds).
        span = min(self.max_ngram, n - 1)
        pos = ends[:, None] - np.arange(span)  # [C, L] positions at offsets 0..L-1 back from each end
        same = (pos >= 0) & (a[np.maximum(pos, 0)] == a[n - span :][::-1])  # suffix read backwards
        lengths = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # [C]
        last = lengths.size - 1 - int(lengths[::-1].argmax())  # the most recent of the longest
        if lengths[last] < self.vote_below:
            tied = np.flatnonzero(lengths == lengths[last])  # [T] the longest, ascending
            if tied.size > 1:
                last = int(tied[_most_common_latest(a[ends[tied] + 1].tolist())])
        return int(ends[last]) + 1, int(lengths[last])

    def _match_among(self, toks: list[int], ends: list[int]) -> tuple[int, int]:
        """:meth:`match` of ``toks`` given the earlier positions ``ends`` (ascending) of its last
        token, on Python ints: a few candidates, each compared until its first mismatch."""
        n, best, start = len(toks), 0, 0
        span = min(self.max_ngram, n - 1)
        tied: list[int] = []  # the ends of every match as long as the best, latest first
        for end in reversed(ends):  # the most recent first: a later one must be longer to win
            length = 1
            while length < span and end >= length and toks[end - length] == toks[n - 1 - length]:
                length += 1
            if length > best:
                best, start = length, end + 1
                tied = [end]
                if best == span and best >= self.vote_below:
                    break
            elif length == best and best < self.vote_below:
                tied.append(end)
        if len(tied) > 1 and best < self.vote_below:
            nxt = [toks[e + 1] for e in reversed(tied)]  # oldest first
            start = tied[len(tied) - 1 - _most_common_latest(nxt)] + 1
        return start, best

    def lookup(self, seq: Sequence[int] | torch.Tensor, k: int) -> list[int]:
        """Up to k tokens (fewer with ``tokens_per_match``) that followed the match of ``seq``'s
        longest recurring suffix; empty when the match is shorter than ``min_ngram``.
        """
        a = seq.numpy() if isinstance(seq, torch.Tensor) else np.asarray(seq, dtype=np.int64)
        start, length = self.match(a)
        if length < self.min_ngram:
            return []
        return a[start : start + self._cap(length, k)].tolist()
