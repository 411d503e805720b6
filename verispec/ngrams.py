"""An n-gram table of the target's own answers, drafting beside prompt lookup.

Prompt lookup drafts only what recurs within one request; elsewhere (an essay, an explanation, a
chat answer) it has nothing to copy. A small instruct model answering greedily repeats itself
across requests, though: the same openings, list markers, connectives and phrasings. This drafter
keeps those as a table: for each context of 1 to :attr:`NgramTable.orders` tokens seen in a corpus
of the target's greedy answers to verispec's own training prompts (:mod:`verispec.distill.prompts`,
none from Spec-Bench), the token that most often followed it. It drafts by walking the table from
the longest context it knows, and its chance of acceptance is that token's share of what followed
the context, calibrated on held-out answers and then learned per sequence (as prompt lookup
learns its own).

:class:`NgramLookup` asks both prompt lookup and the table for each row and keeps the draft with
more tokens expected to be accepted; the engine then verifies only what pays at the measured cost
(``Proposal.accept_probs``). Drafts are only proposals: whatever the table holds, the output is the
target's own (greedy: its greedy output; sampled: its distribution, as for any point-mass drafter).

A table is a folder (``ngrams.json`` and ``ngrams.npz``) bound to its target by
:func:`~verispec.distill.shipped.target_id`, made by ``verispec ngrams``; one is shipped for the
default model in ``verispec/drafts/``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from verispec.config import ConfigError
from verispec.proposers import AcceptanceCounts, PromptLookup, Proposal, point_mass
from verispec.sampling import SamplingTensors

META = "ngrams.json"
TOKENS = "ngrams.npz"

SHARE_EDGES = (0.0, 0.25, 0.4, 0.55, 0.7, 0.85, 0.95)
"""Lower bounds of the buckets of a table entry's share ``count / (total + 1)`` (the ``+ 1`` ranks
a context seen once below one seen a hundred times with the same share). Each bucket has its own
chance of acceptance (a table's ``prior``, measured on held-out answers when it is built)."""

_MASK = (1 << 64) - 1
_MULT = 0x9E3779B97F4A7C15  # odd: multiplying by it mod 2^64 is a bijection
_SEED = 0x632BE59BD9B4E019


def share_bucket(share: float) -> int:
    """Index of the :data:`SHARE_EDGES` bucket holding ``share``."""
    return bisect.bisect_right(SHARE_EDGES, share) - 1


def _hashes(tokens: Sequence[int], orders: int) -> list[int]:
    """64-bit keys of the contexts of 1..``orders`` tokens ending ``tokens`` (fewer if it is
    shorter), shortest first: each folds one more token, the newest first, into the one before,
    so all of them cost ``orders`` multiply-adds. The same keys as :func:`_hash_columns`."""
    h, keys = _SEED, []
    for t in reversed(tokens[-orders:]):
        h = (h * _MULT + t + 1) & _MASK
        keys.append(h)
    return keys


def _hash_columns(columns: Sequence[np.ndarray]) -> np.ndarray:
    """:func:`_hashes`' key of the n-token contexts whose tokens are ``columns`` (n arrays ``[P]``,
    the oldest token first), ``[P]`` uint64 (numpy wraps uint64 products mod 2^64, as ``_MASK``)."""
    h = np.full(columns[0].shape, _SEED, dtype=np.uint64)
    for col in reversed(columns):
        h = h * np.uint64(_MULT) + col.astype(np.uint64) + np.uint64(1)
    return h


class NgramTable:
    """For each context of 1..``orders`` tokens in ``sequences``, the token that followed it most
    often and that token's share bucket (:data:`SHARE_EDGES`).

    Args:
        sequences: token ids, one list per answer, each preceded by ``context[i]`` tokens that are
            only context (the end of its prompt): nothing is learned about predicting them.
        context: ``[S]`` leading context tokens per sequence.
        orders: longest context, in tokens.

    Contexts are keyed by a 64-bit hash of their tokens (:func:`_hashes`); two contexts sharing a
    key would only make a worse draft, never a wrong output.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], context: Sequence[int], orders: int = 4):
        if orders < 1:
            raise ValueError("orders must be >= 1")
        if len(sequences) != len(context):
            raise ValueError("one context length per sequence")
        self.orders = orders
        self.sequences = [list(map(int, s)) for s in sequences]
        self.context = [int(c) for c in context]
        self._entries: dict[int, int] = {}
        """Context key -> ``token * 16 + share bucket``."""
        lengths = np.asarray([len(s) for s in self.sequences], dtype=np.int64)  # [S]
        flat = np.asarray([t for s in self.sequences for t in s], dtype=np.int64)  # [N]
        offset = np.arange(flat.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # [N]
        skip = np.repeat(np.asarray(self.context, dtype=np.int64), lengths)  # [N] context per position
        for n in range(1, orders + 1):
            at = np.flatnonzero(offset >= np.maximum(skip, n))  # [P] predicted from the n tokens before
            if at.size:
                self._add(_hash_columns([flat[at - n + j] for j in range(n)]), flat[at])

    def _add(self, key: np.ndarray, nxt: np.ndarray) -> None:
        """Enter each distinct context of ``key`` ``[P]`` (uint64) with its most frequent next token
        in ``nxt`` ``[P]`` (the smallest id among equally frequent ones)."""
        order = np.lexsort((nxt, key))
        key, nxt = key[order], nxt[order]
        starts = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])])  # [Q] pairs
        counts = np.diff(np.r_[starts, key.shape[0]])  # [Q]
        pair_key, pair_next = key[starts], nxt[starts]
        best = np.lexsort((-counts, pair_key))  # by context, the most frequent pair first
        pair_key, pair_next, counts = pair_key[best], pair_next[best], counts[best]
        first = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])  # [K] each context's best
        totals = np.add.reduceat(counts, first)  # [K]
        buckets = np.searchsorted(np.asarray(SHARE_EDGES), counts[first] / (totals + 1.0), side="right") - 1
        packed = pair_next[first] * 16 + buckets
        self._entries.update(zip(pair_key[first].tolist(), packed.tolist()))

    def __len__(self) -> int:
        return len(self._entries)

    def predict(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """``(token, share bucket)`` after ``tokens`` from the longest context the table knows, or
        None when it knows not even the last token."""
        for key in reversed(_hashes(tokens, self.orders)):  # the longest context first
            packed = self._entries.get(key)
            if packed is not None:
                return packed >> 4, packed & 15
        return None

    def draft(self, tokens: Sequence[int], k: int) -> tuple[list[int], list[int]]:
        """Up to ``k`` tokens walked through the table after ``tokens`` (each predicted from the
        previous ones as if accepted), and each one's share bucket; stops where the table knows
        nothing."""
        ctx = list(tokens[-self.orders :])
        out: list[int] = []
        buckets: list[int] = []
        for _ in range(k):
            hit = self.predict(ctx)
            if hit is None:
                break
            out.append(hit[0])
            buckets.append(hit[1])
            ctx = (ctx + [hit[0]])[-self.orders :]
        return out, buckets

    def calibrate(
        self, sequences: Sequence[Sequence[int]], context: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Per share bucket, how often the table's token was the next token of ``sequences``
        (held-out answers, ``context`` as in the constructor) and how often it predicted one:
        ``(hits [buckets], predictions [buckets])``."""
        hits = [0] * len(SHARE_EDGES)
        seen = [0] * len(SHARE_EDGES)
        for seq, c in zip(sequences, context):
            for t in range(max(c, 1), len(seq)):
                hit = self.predict(seq[max(0, t - self.orders) : t])
                if hit is not None:
                    seen[hit[1]] += 1
                    hits[hit[1]] += int(hit[0] == seq[t])
        return hits, seen


def save_table(folder: str | Path, table: NgramTable, meta: dict) -> Path:
    """Write ``table``'s corpus (``ngrams.npz``: tokens, lengths and context lengths) and ``meta``
    (``ngrams.json``; it must hold ``prior``, one probability per share bucket) to ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if len(meta.get("prior", ())) != len(SHARE_EDGES):
        raise ValueError(f"meta needs a prior of {len(SHARE_EDGES)} probabilities")
    parts = [np.asarray(s, dtype=np.int32) for s in table.sequences]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    np.savez_compressed(
        folder / TOKENS,
        tokens=tokens,
        lengths=np.asarray([len(s) for s in table.sequences], dtype=np.int64),
        context=np.asarray(table.context, dtype=np.int64),
    )
    (folder / META).write_text(json.dumps({**meta, "orders": table.orders}, indent=2) + "\n")
    return folder


def read_meta(folder: str | Path) -> dict:
    """A table folder's ``ngrams.json``."""
    path = Path(folder) / META
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not an n-gram table ({exc})") from exc


def load_table(folder: str | Path, target=None) -> tuple[NgramTable, dict]:
    """The table in ``folder`` and its meta. With ``target``, the table must have been built for
    it (same :func:`~verispec.distill.shipped.target_id`): another model's tokens would be ids of
    another vocabulary."""
    meta = read_meta(folder)
    if target is not None:
        from verispec.distill.shipped import target_id

        mine = target_id(target)
        if meta.get("target_id") != mine:
            raise ConfigError(
                f"{folder}: this n-gram table was built for another target "
                f"(target id {meta.get('target_id')}, this one {mine}); build one with `verispec ngrams`"
            )
    return _read_table(folder, meta), meta


def _read_table(folder: str | Path, meta: dict) -> NgramTable:
    """The table whose corpus is ``folder``'s ``ngrams.npz`` and whose meta is ``meta``."""
    with np.load(Path(folder) / TOKENS) as data:
        tokens, lengths, context = data["tokens"], data["lengths"], data["context"]
    ends = np.cumsum(lengths)
    sequences = [tokens[e - n : e].tolist() for e, n in zip(ends.tolist(), lengths.tolist())]
    return NgramTable(sequences, context.tolist(), orders=int(meta.get("orders", 4)))


SHIPPED = Path(__file__).resolve().parent / "drafts"


def shipped_table_for(target) -> tuple[NgramTable, dict] | None:
    """The table shipped with verispec for ``target``, or None when none was built for it."""
    from verispec.distill.shipped import target_id

    try:
        mine = target_id(target)
    except (ConfigError, AttributeError):
        return None
    for path in sorted(SHIPPED.glob(f"*/{META}")):
        meta = read_meta(path.parent)
        if meta.get("target_id") == mine and (path.parent / TOKENS).is_file():
            return _read_table(path.parent, meta), meta
    return None


def expected_accepted(probs: Sequence[float]) -> float:
    """Tokens expected to be accepted from a draft whose token i is accepted with chance
    ``probs[i]`` once tokens 0..i-1 were: ``sum_i prod_{j <= i} probs[j]``."""
    total, run = 0.0, 1.0
    for p in probs:
        run *= p
        total += run
    return total


class NgramLookup:
    """Prompt lookup, or the n-gram table where it expects more accepted tokens (per row and step).

    Args:
        table: the target's table (:func:`load_table`, :func:`shipped_table_for`).
        prior: chance of acceptance per share bucket (the table's meta ``prior``).
        prior_weight: observations the prior counts as, before a sequence's own outcomes.
        lookup: the prompt lookup to ask first (a fresh :class:`PromptLookup` by default).
    """

    def __init__(
        self,
        table: NgramTable,
        prior: Sequence[float],
        prior_weight: float = 4.0,
        lookup: PromptLookup | None = None,
    ):
        if len(prior) != len(SHARE_EDGES) or not all(0.0 <= p <= 1.0 for p in prior):
            raise ValueError(f"prior needs {len(SHARE_EDGES)} probabilities, one per share bucket")
        self.table = table
        self.lookup = lookup if lookup is not None else PromptLookup()
        self._stats = AcceptanceCounts(prior, prior_weight)
        self.table_drafts = 0
        """Rows drafted from the table so far (the rest of the drafting rows: prompt lookup)."""
        self.lookup_drafts = 0

    @classmethod
    def shipped(cls, target) -> NgramLookup | None:
        """The drafter with the table shipped for ``target``, or None when none was built for it."""
        found = shipped_table_for(target)
        return None if found is None else cls(found[0], found[1]["prior"])

    @classmethod
    def for_target(cls, target, folder: str | Path | None = None) -> NgramLookup:
        """The drafter for ``target`` with the table in ``folder``, or the shipped one."""
        if folder is not None:
            table, meta = load_table(folder, target)
            return cls(table, meta["prior"])
        drafter = cls.shipped(target)
        if drafter is None:
            raise ConfigError("no n-gram table is shipped for this target; build one with `verispec ngrams`")
        return drafter

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        self.lookup.start(slot, tokens)
        self._stats.start(slot)

    def propose(
        self,
        slots: list[int],
        committed: list[list[int]],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        """Per row, prompt lookup's draft or the table's, with their estimated chances of acceptance
        (``[B, k]``)."""
        wants = num_tokens.tolist()  # [B]
        k = max(wants, default=0)
        if k == 0:
            return self.lookup.propose(slots, committed, num_tokens, params, generators)
        return point_mass(self.propose_rows(slots, committed, wants), k)

    def propose_rows(
        self, slots: list[int], committed: list[list[int]], wants: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        """:meth:`propose` on Python lists: per row, up to ``wants[i]`` tokens (lookup's or the
        table's) and each one's estimated chance of acceptance (both empty where neither drafts)."""
        # After a forward has streamed the weights through every cache level each small torch call
        # costs tens of microseconds: the engine takes these lists as they are for greedy steps.
        rows = self.lookup.propose_rows(slots, committed, wants)  # [B] (tokens, estimates)
        for row, (slot, toks, want) in enumerate(zip(slots, committed, wants)):
            self._stats.learn(slot, toks)
            drafted, buckets = self.table.draft(toks, want) if want > 0 else ([], [])
            if not drafted:
                self.lookup_drafts += bool(rows[row][0])
                continue
            estimate = self._stats.estimates(slot)  # [buckets]
            probs = [estimate[b] for b in buckets]
            # Scored at the next proposal whichever draft is verified: the committed tokens are the
            # target's either way.
            self._stats.remember(slot, len(toks), buckets, drafted)
            if expected_accepted(probs) > expected_accepted(rows[row][1]):
                rows[row] = (drafted, probs)
                self.table_drafts += 1
            else:
                self.lookup_drafts += bool(rows[row][0])
        return rows
