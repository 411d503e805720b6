"""The speculative decoding loop: propose, verify in one target pass, accept, roll back.

Each step, for every active sequence: the proposer drafts up to k tokens (a drafter that estimates
each token's chance of acceptance has its draft cut to the length worth the target's measured cost of
verifying it, see :mod:`verispec.costs`); the target scores the pending token and the drafts in one
forward pass (``[B, k + 1]``); :func:`~verispec.rejection.rejection_sample`
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

from verispec.config import ConfigError, GenerationConfig
from verispec.costs import StepCosts, best_draft_length, costs_for, prior_ratios
from verispec.models.base import KVModel
from verispec.proposers import Proposal, Proposer
from verispec.rejection import greedy_verify, rejection_sample
from verispec.sampling import SamplingTensors, logits_to_probs
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
    text: str = ""
    started: float = field(default_factory=time.perf_counter)

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
        gen = torch.Generator()
        gen.manual_seed(config.seed if config.seed is not None else int(torch.randint(0, 2**62, (1,))))
        k = config.num_speculative_tokens if self.proposer is not None else 0
        return SequenceState(tokens=prompt, prompt_len=len(prompt), config=config, generator=gen, k=k)

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
        params = SamplingTensors.from_configs([s.config.sampling for s in seqs])
        gens = [s.generator for s in seqs]
        # Never draft past what may still be emitted or past the context.
        ks = torch.tensor(
            [
                max(
                    0,
                    min(
                        s.k,
                        s.config.max_new_tokens - s.num_output - 1,
                        self.target.max_length - len(s.tokens) - 1,
                    ),
                )
                for s in seqs
            ],
            dtype=torch.int64,
        )
        proposal, num_draft = None, torch.zeros(len(seqs), dtype=torch.int64)
        if self.proposer is not None and int(ks.max()) > 0:
            proposal, num_draft = self._propose(seqs, ks, params)
        width = int(num_draft.max())
        start = time.perf_counter()
        pending = torch.tensor([[s.tokens[-1]] for s in seqs])  # [B, 1]
        if width:
            draft_tokens = proposal.tokens[:, :width]  # [B, width]
            draft_probs = None if proposal.probs is None else proposal.probs[:, :width]  # [B, width, V]
            inputs = torch.cat([pending, draft_tokens], dim=1)  # [B, width + 1]
        else:
            draft_tokens, draft_probs, inputs = torch.zeros(len(seqs), 0, dtype=torch.int64), None, pending
        logits = self.target.forward(inputs, rows=slots, logits="all")  # [B, width + 1, V]
        if params.all_greedy:
            verdict = greedy_verify(draft_tokens, logits, num_draft)
        else:
            target_probs = logits_to_probs(logits, params)
            if draft_probs is not None:
                draft_probs = draft_probs.to(target_probs.dtype)
            verdict = rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, gens)

        events = []
        keep_lengths = []
        for row, seq in enumerate(seqs):
            accepted = int(verdict.num_accepted[row])
            emitted = verdict.tokens[row, : accepted + 1].tolist()
            flags = [True] * accepted + [False]
            seq.stats.record_step(int(num_draft[row]), accepted)
            emitted, flags = self._commit(seq, emitted, flags)
            keep_lengths.append(len(seq.tokens) - 1)
            if self.adaptive is not None and seq.config.adaptive:
                seq.k = self.adaptive(seq, int(num_draft[row]), accepted)
            events.append(StepEvent(seq=seq, token_ids=emitted, from_draft=flags))
        self.target.truncate(torch.tensor(keep_lengths), rows=slots)
        self.costs.record(len(seqs), width + 1, time.perf_counter() - start)
        return events

    def _propose(
        self, seqs: list[SequenceState], ks: torch.Tensor, params: SamplingTensors
    ) -> tuple[Proposal, torch.Tensor]:
        """Draft for the rows with ``ks > 0`` only, scattered back to the whole batch.

        Returns a :class:`Proposal` over all B rows and ``num_draft`` ``[B]``. A row whose k was 0
        when it joined (speculation off, or capped by a batch policy) starts its drafter here.
        """
        assert self.proposer is not None
        rows = [i for i in range(len(seqs)) if int(ks[i]) > 0]
        for i in rows:
            if not seqs[i].drafting:
                self.proposer.start(seqs[i].slot, seqs[i].tokens)
                seqs[i].drafting = True
        sub = self.proposer.propose(
            [seqs[i].slot for i in rows],
            [seqs[i].tokens for i in rows],
            ks[rows],
            params.select(rows),
            [seqs[i].generator for i in rows],
        )
        sub_num = torch.minimum(sub.num_draft, ks[rows])
        for i in rows:
            seqs[i].cut_by_cost = sub.accept_probs is not None
        if sub.accept_probs is not None:
            sub_num = self._worth_verifying([seqs[i] for i in rows], sub.accept_probs, sub_num, len(seqs))
        if len(rows) == len(seqs):
            return sub, sub_num
        index = torch.tensor(rows)
        tokens = torch.zeros(len(seqs), sub.tokens.shape[1], dtype=torch.int64)
        tokens[index] = sub.tokens
        probs = None
        if sub.probs is not None:
            probs = sub.probs.new_zeros(len(seqs), *sub.probs.shape[1:])
            probs[index] = sub.probs
        num_draft = torch.zeros(len(seqs), dtype=torch.int64)
        num_draft[index] = sub_num
        return Proposal(tokens=tokens, probs=probs, num_draft=num_draft), num_draft

    def _worth_verifying(
        self, seqs: list[SequenceState], accept_probs: torch.Tensor, num_draft: torch.Tensor, batch: int
    ) -> torch.Tensor:
        """Cut each row's draft (``accept_probs`` ``[n, k]``, ``num_draft`` ``[n]``) to the length
        with the most expected tokens per unit of this target's measured step cost; 0 where no draft
        pays for its verification.

        A sampled request with a seed is cut by the prior cost curve instead: measured times differ
        from run to run, and a different draft length consumes its random numbers differently, so
        only a cut that does not depend on the clock lets the seed reproduce the response.
        """
        widest = int(num_draft.max()) if len(num_draft) else 0
        if widest == 0:
            return num_draft
        curves: dict[bool, list[float]] = {}  # built once per step, and only the ones a row needs
        out = num_draft.clone()
        for row, seq in enumerate(seqs):
            n = int(num_draft[row])
            if n:
                fixed = seq.config.seed is not None and not seq.config.sampling.greedy
                if fixed not in curves:
                    width = widest + 1
                    curves[fixed] = prior_ratios(width) if fixed else self.costs.ratios(width, batch)
                out[row] = best_draft_length(accept_probs[row, :n].tolist(), curves[fixed])
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
        if self.decode is not None:
            seq.text = self.decode(self._visible(seq))
            if seq.config.stop:
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
        seq.text = seq.text[:cut]
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
