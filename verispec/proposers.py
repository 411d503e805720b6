"""Drafters behind one interface.

A :class:`Proposer` sees each row's committed tokens and returns up to k draft tokens per row, with
the distributions they were drawn from (or None: a point mass, as for n-gram lookup). The engine never
asks which proposer it holds.

- :class:`DraftModelProposer`: a smaller model sharing the target's tokenizer (Leviathan et al., 2023),
  with its own KV cache, rolled back to the committed tokens before each proposal.
- :class:`PromptLookup`: continue the longest recent n-gram that occurred earlier in the prompt or
  output (Saxena, 2023, "Prompt Lookup Decoding"); no second model.
"""

from __future__ import annotations

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
    return inverse_cdf(probs, uniforms(generators, 1, probs.dtype)[:, 0].to(probs.device)), probs


def _empty(batch: int) -> Proposal:
    return Proposal(
        tokens=torch.zeros(batch, 0, dtype=torch.int64),
        probs=None,
        num_draft=torch.zeros(batch, dtype=torch.int64),
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


class PromptLookup:
    """n-gram prompt lookup: find the earlier occurrence of the longest suffix of the sequence (the
    most recent one among equally long matches) and propose the tokens that followed it.

    The draft length grows with the match: ``tokens_per_match`` tokens per matched token, capped by
    the k the engine asks for. A long match predicts a long copy; a one-token match (a common word)
    rarely predicts more than a token or two. Measured on SmolLM2-135M over held-out Spec-Bench
    prompts (greedy), the first draft token was accepted after 20% of 1-token matches, 50-58% of 2-3
    token matches, 78% of 6-9 and 92% of 10+; a fixed k either wastes verification on short matches
    or stops long copies early. Rows with no match (or a match shorter than ``min_ngram``) propose
    nothing, so the step costs what plain decoding costs.
    """

    def __init__(self, max_ngram: int = 64, min_ngram: int = 1, tokens_per_match: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if tokens_per_match < 1:
            raise ValueError("tokens_per_match must be >= 1")
        self.max_ngram = max_ngram
        """Longest match searched for (longer matches count as this long)."""
        self.min_ngram = min_ngram
        """Shortest match worth proposing from."""
        self.tokens_per_match = tokens_per_match
        """Draft tokens per matched token, before the cap of k."""

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        """Stateless: nothing to prepare."""

    def propose(
        self,
        slots: list[int],
        committed: list[list[int]],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        """Point-mass proposals copied from earlier in each row's own tokens."""
        batch = len(slots)
        k = int(num_tokens.max()) if batch else 0
        if k == 0:
            return _empty(batch)
        tokens = torch.zeros(batch, k, dtype=torch.int64)
        num_draft = torch.zeros(batch, dtype=torch.int64)
        for row, toks in enumerate(committed):
            found = self.lookup(toks, int(num_tokens[row]))
            tokens[row, : len(found)] = torch.tensor(found, dtype=torch.int64)
            num_draft[row] = len(found)
        return Proposal(tokens=tokens, probs=None, num_draft=num_draft)

    def match(self, seq: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """``(start, length)``: the longest suffix of ``seq`` ``[N]`` that also occurs earlier
        (ending before the last token), most recent first among equals; ``start`` is the index of
        the token that followed that occurrence. ``(0, 0)`` when even the last token never occurred.
        """
        a = np.asarray(seq)
        n = a.shape[0]
        if n < 2:
            return 0, 0
        ends = np.flatnonzero(a[:-1] == a[-1])  # candidate occurrences, by their last index
        if ends.size == 0:
            return 0, 0
        length = 1
        # Extend every candidate backwards together; the survivors of the longest round win.
        while length < self.max_ngram:
            ok = ends[ends >= length]
            ok = ok[a[ok - length] == a[n - 1 - length]]
            if ok.size == 0:
                break
            ends, length = ok, length + 1
        return int(ends[-1]) + 1, length

    def lookup(self, seq: Sequence[int] | torch.Tensor, k: int) -> list[int]:
        """Up to ``min(k, tokens_per_match * match length)`` tokens that followed the match of
        ``seq``'s longest recurring suffix; empty when the match is shorter than ``min_ngram``.
        """
        a = seq.numpy() if isinstance(seq, torch.Tensor) else np.asarray(seq, dtype=np.int64)
        start, length = self.match(a)
        if length < self.min_ngram:
            return []
        return a[start : start + min(k, self.tokens_per_match * length)].tolist()
