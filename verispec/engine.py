"""The speculative decoding loop: propose, verify in one target pass, accept, roll back.

Each step, for every active sequence: the proposer drafts up to k tokens (a drafter that estimates
each token's chance of acceptance has its draft cut to the length worth the target's measured cost of
verifying it, see :mod:`verispec.costs`); the target scores the pending token and the drafts in one
forward pass (``[B, k + 1]``); :func:`~verispec.rejection.rejection_sample_logits`
decides what is emitted; both caches are rolled back to the committed tokens. With k = 0 (or a drafter
that finds nothing) a step is one plain autoregressive step of the same engine, which is the baseline
every speedup is measured against.

Sequences occupy batch *slots* and may join or leave between any two steps (the server's continuous
batching uses exactly this); :func:`run_to_completion` drives a fixed set to the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from verispec.config import ConfigError, GenerationConfig, SamplingConfig
from verispec.costs import StepCosts, best_draft_length, best_tree, costs_for, fixed_ratios
from verispec.detokenize import IncrementalDecoder
from verispec.models.base import KVModel
from verispec.proposers import Proposal, Proposer
from verispec.rejection import (
    ACCEPT_STREAM,
    TOKEN_STREAM,
    greedy_accept,
    greedy_tokens,
    greedy_verify_tree,
    position_uniforms,
    rejection_sample_logits,
)
from verispec.sampling import SamplingTensors, SeededGenerator
from verispec.stats import GenerationStats


@dataclass
class SequenceState:
    """One request's progress. ``tokens`` is prompt + emitted; the last one is pending (not cached)."""

    tokens: list[int]
    prompt_len: int
    config: GenerationConfig
    generator: torch.Generator
    slot: int = -1
    k: int = 0
    """Current draft length (adapted per sequence when ``config.adaptive``)."""
    stats: GenerationStats = field(default_factory=GenerationStats)
    from_draft: list[bool] = field(default_factory=list)
    """Per emitted token: True when it was an accepted draft token."""
    drafting: bool = False
    """Whether the proposer holds this sequence's state (started lazily when k > 0)."""
    cut_by_cost: bool = False
    """Whether its last draft came with acceptance estimates, and so was cut to the length worth
    verifying at the measured cost (``k`` then only caps that length)."""
    finish_reason: str | None = None
    """None while running; then "stop" (EOS or stop string) or "length"."""
    started: float = field(default_factory=time.perf_counter)
    detokenize: Callable[[], str] | None = field(default=None, repr=False)
    """The engine's decoder of the visible output (None: no tokenizer, ``text`` stays empty)."""
    running_text: IncrementalDecoder | None = field(default=None, repr=False)
    """Decodes the output while it grows (streaming, stop strings), a few tokens per step."""
    stop_text: str | None = None
    """The text cut where a stop string begins, once one ended the sequence."""
    _decoded: tuple[tuple[int, str | None], str] = field(default=((-1, None), ""), repr=False)

    @property
    def text(self) -> str:
        """The output decoded, cut at a stop string if one ended it.

        Decoded when read and kept until tokens are added: decoding the whole output at every step
        grew with its length (113 us per step at 512 tokens here) for callers that read it once.
        While the sequence runs, ``running_text`` decodes only the newest tokens; once it finished,
        the whole output is decoded once more.
        """
        if self.stop_text is not None:
            return self.stop_text
        if self.detokenize is None:
            return ""
        key = (len(self.tokens), self.finish_reason)
        if self._decoded[0] != key:
            if self.finish_reason is None and self.running_text is not None:
                self._decoded = (key, self.running_text.text(self.output_ids))
            else:
                self._decoded = (key, self.detokenize())
        return self._decoded[1]

    @property
    def num_output(self) -> int:
        """How many tokens were emitted (no copy, unlike ``output_ids``)."""
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        """Emitted tokens."""
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        """True once a stop condition was met."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepEvent:
    """Tokens one sequence received in one step."""

    seq: SequenceState
    token_ids: list[int]
    from_draft: list[bool]


class Engine:
    """Runs speculative steps over the sequences occupying a target's batch slots."""

    def __init__(
        self,
        target: KVModel,
        proposer: Proposer | None,
        *,
        eos_token_ids: Sequence[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        adaptive: Callable[[SequenceState, int, int], int] | None = None,
        costs: StepCosts | None = None,
    ):
        self.target = target
        self.proposer = proposer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.decode = decode
        self.adaptive = adaptive
        """Given (sequence, drafted, accepted) after a step, return the sequence's next k."""
        self.costs = costs if costs is not None else costs_for(target)
        """Measured cost of a step by width (kept per target, so it outlives this engine)."""
        self._params: dict[tuple[SamplingConfig, ...], SamplingTensors] = {}
        """Sampling tensors per batch composition, built once (each step would otherwise make them)."""

    def _sampling(self, configs: list[SamplingConfig]) -> SamplingTensors:
        """:meth:`SamplingTensors.from_configs`, kept per tuple of settings (at most 64 kept)."""
        key = tuple(configs)
        params = self._params.get(key)
        if params is None:
            if len(self._params) >= 64:
                self._params.clear()
            params = self._params[key] = SamplingTensors.from_configs(configs)
        return params

    def new_sequence(self, prompt: Sequence[int], config: GenerationConfig) -> SequenceState:
        """Validate a prompt against the target and make its state (not yet in a slot)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ConfigError("the prompt is empty")
        if any(t < 0 or t >= self.target.vocab_size for t in prompt):
            raise ConfigError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        room = self.target.max_length - len(prompt)
        if room < 1:
            raise ConfigError(
                f"the prompt has {len(prompt)} tokens, more than the model's context of "
                f"{self.target.max_length} allows (at least one new token must fit)"
            )
        gen = SeededGenerator() if config.seed is not None else torch.Generator()
        gen.manual_seed(config.seed if config.seed is not None else int(torch.randint(0, 2**62, (1,))))
        k = config.num_speculative_tokens if self.proposer is not None else 0
        seq = SequenceState(tokens=prompt, prompt_len=len(prompt), config=config, generator=gen, k=k)
        if self.decode is not None:
            decode = self.decode
            seq.detokenize = lambda: decode(self._visible(seq))
            seq.running_text = IncrementalDecoder(decode)
        return seq

    def add(self, seq: SequenceState, slot: int) -> None:
        """Put ``seq`` in ``slot`` and process its prompt (all but the pending last token)."""
        seq.slot = slot
        start = time.perf_counter()
        seq.started = start
        self.target.truncate(torch.zeros(1, dtype=torch.int64), rows=[slot])
        if seq.prompt_len > 1:
            self.target.forward(torch.tensor([seq.tokens[:-1]]), rows=[slot], logits="none")
        seq.drafting = False
        if self.proposer is not None and seq.k > 0:
            self.proposer.start(slot, seq.tokens)
            seq.drafting = True
        seq.stats.prompt_tokens = seq.prompt_len
        seq.stats.prefill_seconds = time.perf_counter() - start

    def step(self, seqs: list[SequenceState]) -> list[StepEvent]:
        """One speculative step for every sequence in ``seqs`` (all in distinct slots, unfinished)."""
        slots = [s.slot for s in seqs]
        params = self._sampling([s.config.sampling for s in seqs])
        gens = [s.generator for s in seqs]
        # Never draft past what may still be emitted or past the context.
        room = [
            max(
                0,
                min(
                    s.k,
                    s.config.max_new_tokens - s.num_output - 1,
                    self.target.max_length - len(s.tokens) - 1,
                ),
            )
            for s in seqs
        ]
        context = max(len(s.tokens) for s in seqs) - 1  # cached tokens before the step, longest row
        proposal = None
        drafted = [0] * len(seqs)  # draft tokens to verify per row
        tree: list[list[tuple[int, int]]] | None = None
        if self.proposer is not None and max(room) > 0:
            proposal, drafted, tree = self._propose(seqs, room, params, context)
        width = max(drafted)
        start = time.perf_counter()
        if tree is not None and any(tree):
            assert isinstance(proposal, Proposal)
            pending = torch.tensor([[s.tokens[-1]] for s in seqs])  # [B, 1]
            num_draft = torch.tensor(drafted, dtype=torch.int64)
            return self._tree_step(seqs, slots, pending, proposal, num_draft, tree, start, context)
        if params.all_greedy:  # greedy_verify, on Python ints; the target reads only the argmax
            drafts: list[list[int]] = [[] for _ in seqs]  # [B][width]
            if width and isinstance(proposal, list):  # per-row lists, padded to one width
                drafts = [d + [0] * (width - len(d)) for d in proposal]
            elif width:
                assert proposal is not None
                drafts = proposal.tokens[:, :width].tolist()
            lines = [[s.tokens[-1], *d] for s, d in zip(seqs, drafts)]  # [B][width + 1]
            best = greedy_tokens(self.target, lines, slots)  # [B][width + 1]
            emitted, accepted = greedy_accept(drafts, best, drafted)
        else:
            pending = torch.tensor([[s.tokens[-1]] for s in seqs])  # [B, 1]
            if width:
                assert isinstance(proposal, Proposal)
                draft_tokens = proposal.tokens[:, :width]  # [B, width]
                draft_probs = None if proposal.probs is None else proposal.probs[:, :width]  # [B, width, V]
                inputs = torch.cat([pending, draft_tokens], dim=1)  # [B, width + 1]
            else:
                draft_tokens, draft_probs, inputs = None, None, pending
            logits = self.target.forward(inputs, rows=slots, logits="all")  # [B, width + 1, V]
            if draft_tokens is None:
                draft_tokens = torch.zeros(len(seqs), 0, dtype=torch.int64)
            limits = torch.tensor(drafted, dtype=torch.int64)
            keys = [g.initial_seed() for g in gens]
            starts = [s.num_output for s in seqs]  # the output position of each row's first token
            token_u = position_uniforms(keys, starts, width + 1, TOKEN_STREAM)  # [B, width + 1]
            accept_u = None if draft_probs is None else position_uniforms(keys, starts, width, ACCEPT_STREAM)
            # The target's distributions (logits_to_probs) only at the positions the verdict reaches.
            verdict = rejection_sample_logits(
                draft_tokens, draft_probs, logits, params, limits, token_u, accept_u
            )
            accepted = verdict.num_accepted.tolist()
            emitted = [tokens[: a + 1] for tokens, a in zip(verdict.tokens.tolist(), accepted)]
        no_alternatives = [0] * len(seqs)
        return self._finish(
            seqs, slots, emitted, accepted, drafted, no_alternatives, width + 1, start, context
        )

    def _finish(
        self,
        seqs: list[SequenceState],
        slots: list[int],
        emitted: list[list[int]],
        accepted: list[int],
        drafted: list[int],
        alternatives: list[int],
        width: int,
        start: float,
        context: int,
    ) -> list[StepEvent]:
        """Commit each row's ``emitted`` tokens (its ``accepted`` draft tokens, then the target's),
        roll the target's cache back to them and time the step (``width`` tokens per row, after
        ``context`` cached tokens)."""
        events = []
        keep_lengths = []
        for row, seq in enumerate(seqs):
            tokens = emitted[row]
            flags = [True] * accepted[row] + [False] * (len(tokens) - accepted[row])
            seq.stats.record_step(drafted[row], accepted[row], alternatives=alternatives[row])
            tokens, flags = self._commit(seq, tokens, flags)
            keep_lengths.append(len(seq.tokens) - 1)
            if self.adaptive is not None and seq.config.adaptive:
                seq.k = self.adaptive(seq, drafted[row], min(accepted[row], drafted[row]))
            events.append(StepEvent(seq=seq, token_ids=tokens, from_draft=flags))
        self.target.truncate(keep_lengths, rows=slots)
        self.costs.record(len(seqs), width, time.perf_counter() - start, context)
        return events

    def _tree_step(
        self,
        seqs: list[SequenceState],
        slots: list[int],
        pending: torch.Tensor,
        proposal: Proposal,
        num_draft: torch.Tensor,
        tree: list[list[tuple[int, int]]],
        start: float,
        context: int,
    ) -> list[StepEvent]:
        """Verify each row's chain of ``num_draft`` drafts and, beside chain position i, its chosen
        alternatives ``tree[row]`` (``(i, s)``: ``proposal.alternatives[row, i, s]``), all greedy, in
        one target call (:func:`~verispec.rejection.greedy_verify_tree`).

        Row layout ``[B, 1 + W + A]``: the pending token, the chain padded to the widest (W), then
        the alternatives padded to the most (A). Each alternative is fed at its chain position's
        offset (``FastLlama.forward``'s ``offsets``), so it sees the pending token and chain tokens
        0..i-1 only; an accepted one is then moved into place (``keep_path``).
        """
        assert proposal.alternatives is not None
        batch = len(seqs)
        width = int(num_draft.max())
        most = max(len(t) for t in tree)
        chain = proposal.tokens[:, :width]  # [B, W]
        alt_tokens = torch.zeros(batch, most, dtype=torch.int64)  # [B, A]
        alt_positions = torch.full((batch, most), -1, dtype=torch.int64)  # [B, A]
        for row, picks in enumerate(tree):
            for j, (i, s) in enumerate(picks):
                alt_tokens[row, j] = proposal.alternatives[row, i, s]
                alt_positions[row, j] = i
        inputs = torch.cat([pending, chain, alt_tokens], dim=1)  # [B, 1 + W + A]
        # Padding alternatives sit at offset 0 (after the committed tokens only) and are never read.
        offsets = torch.cat([torch.arange(width + 1).expand(batch, -1), alt_positions + 1], dim=1)
        logits = self.target.forward(inputs, rows=slots, logits="argmax", offsets=offsets)  # all greedy
        verdict = greedy_verify_tree(chain, num_draft, alt_tokens, alt_positions, logits)
        accepted = verdict.num_accepted.tolist()
        emitted = [tokens[: a + 1] for tokens, a in zip(verdict.tokens.tolist(), accepted)]
        for row, alt in enumerate(verdict.alternative.tolist()):
            if alt >= 0:  # its cache entry moves to its place after the accepted chain tokens
                kept = accepted[row]  # the chain tokens before it, and the pending token
                start_at = len(seqs[row].tokens) - 1
                self.target.keep_path(slots[row], start_at, [*range(kept), 1 + width + alt])
        alternatives = [len(t) for t in tree]
        return self._finish(
            seqs, slots, emitted, accepted, num_draft.tolist(), alternatives, 1 + width + most, start, context
        )

    def _propose(
        self, seqs: list[SequenceState], ks: list[int], params: SamplingTensors, context: int
    ) -> tuple[Proposal | list[list[int]], list[int], list[list[tuple[int, int]]] | None]:
        """Draft for the rows with ``ks > 0`` (the most draft tokens each row may take) only,
        scattered back to the whole batch.

        Greedy steps with a drafter that drafts on Python lists (``propose_rows``: prompt lookup,
        with or without an n-gram table) come back as each row's draft tokens to verify
        (``[B][n_i]``) instead of a :class:`Proposal`: the tensors cost more than the lookup
        (session 32: 160 of 7,150 us per step where nothing was drafted, in float32).

        Returns a :class:`Proposal` over all B rows, the draft tokens to verify per row (``[B]``,
        cut by cost; the bookkeeping stays on Python ints: after a forward has streamed the weights
        through every cache level each small torch operation costs 20-60 us) and, when the drafter
        gave alternatives and the step can verify a tree (all rows greedy, a target that takes
        ``offsets``), the alternatives chosen per row (``(i, s)`` pairs, see
        :func:`~verispec.costs.best_tree`), else None; costs are read at ``context`` cached tokens
        (the longest row's). A row whose k was 0 when it joined (speculation off, or capped by a
        batch policy) starts its drafter here.
        """
        assert self.proposer is not None
        rows = [i for i, k in enumerate(ks) if k > 0]
        for i in rows:
            if not seqs[i].drafting:
                self.proposer.start(seqs[i].slot, seqs[i].tokens)
                seqs[i].drafting = True
        propose_rows = getattr(self.proposer, "propose_rows", None)
        if propose_rows is not None and params.all_greedy:
            return self._propose_lists(propose_rows, seqs, rows, ks, context)
        every = len(rows) == len(seqs)  # the common case: no subsets to build
        sub_ks = ks if every else [ks[i] for i in rows]
        sub = self.proposer.propose(
            [seqs[i].slot for i in rows],
            [seqs[i].tokens for i in rows],
            torch.tensor(sub_ks, dtype=torch.int64),
            params if every else params.select(rows),
            [seqs[i].generator for i in rows],
        )
        sub_num = [min(n, k) for n, k in zip(sub.num_draft.tolist(), sub_ks)]
        for i in rows:
            seqs[i].cut_by_cost = sub.accept_probs is not None
        sub_tree = None
        if (
            sub.alternatives is not None
            and sub.alternative_probs is not None
            and sub.accept_probs is not None
            and params.all_greedy
            and getattr(self.target, "supports_tree", False)
        ):
            picked = [seqs[i] for i in rows]
            sub_num, sub_tree = self._worth_verifying_tree(picked, sub, sub_num, len(seqs), context)
        elif sub.accept_probs is not None:
            sub_num = self._worth_verifying(
                [seqs[i] for i in rows],
                sub.accept_probs.tolist(),
                sub_num,
                len(seqs),
                context,
                sampled=sub.probs is not None,
            )
        tree = None
        if sub_tree is not None:
            tree = [[] for _ in seqs]
            for i, picks in zip(rows, sub_tree):
                tree[i] = picks
        if len(rows) == len(seqs):
            return sub, sub_num, tree
        index = torch.tensor(rows)
        tokens = torch.zeros(len(seqs), sub.tokens.shape[1], dtype=torch.int64)
        tokens[index] = sub.tokens
        probs = None
        if sub.probs is not None:
            probs = sub.probs.new_zeros(len(seqs), *sub.probs.shape[1:])
            probs[index] = sub.probs
        drafted = [0] * len(seqs)
        for i, n in zip(rows, sub_num):
            drafted[i] = n
        num_draft = torch.tensor(drafted, dtype=torch.int64)
        alternatives = None
        if sub.alternatives is not None:
            alternatives = torch.full((len(seqs), *sub.alternatives.shape[1:]), -1, dtype=torch.int64)
            alternatives[index] = sub.alternatives
        merged = Proposal(tokens=tokens, probs=probs, num_draft=num_draft, alternatives=alternatives)
        return merged, drafted, tree

    def _propose_lists(
        self,
        propose_rows: Callable[[list[int], list[list[int]], list[int]], list[tuple[list[int], list[float]]]],
        seqs: list[SequenceState],
        rows: list[int],
        ks: list[int],
        context: int,
    ) -> tuple[list[list[int]], list[int], None]:
        """:meth:`_propose` for a greedy step of a drafter that drafts on Python lists: each row's
        draft tokens worth verifying (``[B][n_i]``), their counts ``[B]``, and no tree."""
        sub_ks = [ks[i] for i in rows]
        found = propose_rows([seqs[i].slot for i in rows], [seqs[i].tokens for i in rows], sub_ks)
        for i in rows:
            seqs[i].cut_by_cost = True
        sub_num = [min(len(tokens), k) for (tokens, _), k in zip(found, sub_ks)]
        estimates = [probs for _, probs in found]  # [n][k_i]
        sub_num = self._worth_verifying([seqs[i] for i in rows], estimates, sub_num, len(seqs), context)
        drafts: list[list[int]] = [[] for _ in seqs]
        drafted = [0] * len(seqs)
        for i, (tokens, _), n in zip(rows, found, sub_num):
            drafts[i], drafted[i] = tokens[:n], n
        return drafts, drafted, None

    def _worth_verifying_tree(
        self, seqs: list[SequenceState], proposal: Proposal, num_draft: list[int], batch: int, context: int
    ) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """Per row, the chain length and the alternatives beside it worth verifying at this target's
        measured cost (:func:`~verispec.costs.best_tree`); ``num_draft`` ``[n]`` caps the chain, and
        the tree never reaches past the context."""
        assert proposal.accept_probs is not None and proposal.alternatives is not None
        assert proposal.alternative_probs is not None
        accept = proposal.accept_probs.tolist()
        alts = proposal.alternatives.tolist()
        alt_probs = proposal.alternative_probs.tolist()
        per_row = []
        for row, n in enumerate(num_draft):
            # An empty slot (-1) counts as an alternative that never hits: best_tree drops it.
            options = [
                [q if t >= 0 else 0.0 for t, q in zip(alts[row][i], alt_probs[row][i], strict=True)]
                for i in range(n)
            ]
            per_row.append((n, options))
        nodes = max((n + sum(len(o) for o in opts) for n, opts in per_row), default=0)
        room = min(self.target.max_length - len(s.tokens) for s in seqs)  # cache positions left
        nodes = max(0, min(nodes, room, getattr(self.target, "kernel_max_tokens", 16) - 1))
        curve = self.costs.ratios(nodes + 1, batch, context)
        out = list(num_draft)
        tree = []
        for row, (n, options) in enumerate(per_row):
            out[row], picks = best_tree(accept[row][:n], options, curve)
            tree.append(picks)
        # Rows share one call of 1 + widest chain + most alternatives tokens: where that would pass
        # the limit (the context, the kernel's bitwise-exact widths), the chains go alone.
        if max(out, default=0) + max(map(len, tree), default=0) > nodes:
            tree = [[] for _ in tree]
        return out, tree

    def _worth_verifying(
        self,
        seqs: list[SequenceState],
        accept: list[list[float]],
        num_draft: list[int],
        batch: int,
        context: int,
        sampled: bool = False,
    ) -> list[int]:
        """Cut each row's draft (estimates ``accept`` ``[n][k_i]``, ``num_draft`` ``[n]``) to the length
        with the most expected tokens per unit of this target's measured step cost at ``context``
        cached tokens; 0 where no draft pays for its verification. ``sampled``: the drafter drew its
        tokens (it gave distributions); its sampling rows are then cut by a stopping rule, without
        looking ahead (:func:`~verispec.costs.best_draft_length`).

        A seeded sampled request whose drafter drew its tokens (``sampled``) is cut by the fixed cost
        curve instead (``fixed_ratios``): measured times differ from run to run, and such a draft's
        length decides which tokens it offers and how they are tested, so only a cut that does not
        depend on the clock lets the seed reproduce the response. A point-mass draft needs no such
        care: whatever its length, every emitted token is the target's own draw from its position's
        uniform (:mod:`verispec.rejection`), so the seed gives the plain response.
        """
        out = list(num_draft)
        widest = max(out, default=0)
        if widest == 0:
            return out
        curves: dict[bool, list[float]] = {}  # built once per step, and only the ones a row needs
        for row, (seq, n) in enumerate(zip(seqs, num_draft)):
            if n:
                fixed = sampled and seq.config.seed is not None and not seq.config.sampling.greedy
                if fixed not in curves:
                    width = widest + 1
                    curves[fixed] = fixed_ratios(width) if fixed else self.costs.ratios(width, batch, context)
                lookahead = not (sampled and not seq.config.sampling.greedy)
                out[row] = best_draft_length(accept[row][:n], curves[fixed], lookahead=lookahead)
        return out

    def _commit(
        self, seq: SequenceState, emitted: list[int], flags: list[bool]
    ) -> tuple[list[int], list[bool]]:
        """Append emitted tokens, applying max_new_tokens, EOS and stop strings; returns what was kept."""
        room = seq.config.max_new_tokens - seq.num_output
        if len(emitted) >= room:
            emitted, flags = emitted[:room], flags[:room]
            seq.finish_reason = "length"
        if not seq.config.ignore_eos:
            for i, tok in enumerate(emitted):
                if tok in self.eos_token_ids:
                    emitted, flags = emitted[: i + 1], flags[: i + 1]
                    seq.finish_reason = "stop"
                    break
        seq.tokens.extend(emitted)
        seq.from_draft.extend(flags)
        seq.stats.new_tokens = seq.num_output
        if self.decode is not None and seq.config.stop:
            self._apply_stop_strings(seq)
        return emitted, flags

    def _visible(self, seq: SequenceState) -> list[int]:
        out = seq.output_ids
        return out[:-1] if out and out[-1] in self.eos_token_ids and seq.finish_reason == "stop" else out

    def _apply_stop_strings(self, seq: SequenceState) -> None:
        hits = [i for i in (seq.text.find(s) for s in seq.config.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        seq.stop_text = seq.text[:cut]
        # Keep the shortest token prefix whose text reaches the stop string.
        out = seq.output_ids
        keep = len(out)
        for n in range(1, len(out) + 1):
            if len(self.decode(out[:n])) > cut:  # type: ignore[misc]
                keep = n
                break
        del seq.tokens[seq.prompt_len + keep :]
        del seq.from_draft[keep:]
        seq.stats.new_tokens = keep
        seq.finish_reason = "stop"

    def run(self, seqs: list[SequenceState]) -> Iterator[list[StepEvent]]:
        """Place ``seqs`` in slots 0..B-1 and step until all finish, yielding each step's events."""
        self.target.reset(len(seqs))
        for slot, seq in enumerate(seqs):
            self.add(seq, slot)
        active = list(seqs)
        while active:
            events = self.step(active)
            now = time.perf_counter()
            for seq in active:
                seq.stats.seconds = now - seq.started
            yield events
            active = [s for s in active if not s.finished]
