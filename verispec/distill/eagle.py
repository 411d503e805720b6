"""EAGLE-style drafting from the target's own features (Li et al., 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty").

A standalone draft must guess what the target knows; an EAGLE head reads it. Let ``h_t`` be the
target's final residual stream (before its final norm) at position ``t``: the feature from which
the target predicted ``x_{t+1}``. The draft's input at position ``t`` is the pair
``fc([embed(x_{t+1}); h_t])``; one Llama decoder layer with its own KV cache (RoPE positions) turns
it into the draft's feature ``f_t``, trained to regress ``h_{t+1}``, and ``head(norm(f_t))`` scores
``x_{t+2}``. Past the last committed token the target's features do not exist yet, so draft token
``j + 1`` pairs the draft's own feature with the token it just drafted (feature autoregression).
The head covers a frequent-token subset: draft probabilities outside it are exactly zero, which keeps
rejection sampling lossless.

The draft is a :class:`~verispec.distill.model.DraftLM` with ``cfg.features`` set, run by the same
:class:`~verispec.distill.model.DraftKV`. :class:`EagleProposer` is an ordinary
:class:`~verispec.proposers.Proposer`: it holds the target and reads the features the target's own
forwards recorded (``FastLlama.record_hidden`` / ``hidden_by_row``), so the engine never knows which
drafter it holds.

Cache bookkeeping, per slot: the draft's cache holds the pairs of positions ``0 .. agreed - 1``. The
target's cache holds the committed tokens but the pending last one (``base.py``), so after a step with
``N`` committed tokens the target has recorded features up to position ``N - 2`` and the pairs
``agreed .. N - 2`` are fed in one call; the last one's output predicts the token after the pending
one. ``start`` and ``observe`` only keep the target's features (of the prompt, of steps another
drafter drafted); the next ``propose`` feeds every pending pair in one call, so every proposal has
a fresh feature and a row that never drafts never pays for the draft's forwards.

Training (:func:`eagle_loss`): teacher forcing on the target's features (soft cross-entropy against
the target's top-32 distribution, plus smooth-L1 feature regression), and a second step unrolled
on the draft's own features with the attention pattern it has at inference (HASS, Zhang et al.,
2024), since every draft token after the first is made that way.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.config import ConfigError
from verispec.costs import EXTRA_COST_WEIGHT, DraftTimes, StepCosts, costs_for
from verispec.distill.model import DraftKV, DraftLM
from verispec.models.threads import torch_threads
from verispec.proposers import Proposal, _empty, draw, expected_acceptance
from verispec.sampling import SamplingTensors, is_seeded

STOP_REACH = 0.05
"""A row stops drafting once the product of the head's probabilities of its drafted tokens falls below
this: the next token would add less than 0.05 expected tokens, about what a draft token costs on the
kernel (0.04-0.07 target steps, benchmarks/DRAFTS.md). With the target's measured step costs (the
proposer's ``costs``) the bar is higher where drafting and verifying one more token cost more than
that (:meth:`EagleProposer.stop_reaches`), except in seeded sampled requests, whose draft lengths may
not depend on the clock."""

ALTERNATIVES = 3
"""Greedy drafts carry the head's next 3 candidates at each position besides its own choice; the
engine verifies those worth their cost beside the chain (a tree, :func:`verispec.costs.best_tree`)."""


class EagleProposer:
    """Drafts with an EAGLE head (a :class:`DraftKV` whose model has ``cfg.features``) over ``target``'s
    recorded last hidden states. ``target`` must record them (the fast Llama path:
    :class:`~verispec.models.fast_llama.FastLlama`); constructing the proposer turns recording on.

    Each proposal carries the head's own probability of each drafted token as its chance of
    acceptance (``Proposal.accept_probs``; EAGLE-2, Li et al., 2024, found draft confidence to track
    acceptance): the engine cuts the draft to the length worth verifying at the target's measured
    cost, and drafting stops early where the running product of these probabilities falls below
    :data:`STOP_REACH`. On Spec-Bench questions 6-8 of each category (greedy, k = 4, 2234 drafted
    tokens whose predecessors were accepted), tokens the head gave 0.1-0.2 were accepted 17% of the
    time, 0.3-0.4 44%, 0.5-0.6 64%, 0.7-0.8 77%, 0.9-1.0 91%. Sampled drafts carry the mean of that
    probability over the head's distribution instead (:func:`~verispec.proposers.expected_acceptance`):
    a sampled token must be verified or not whatever it turned out to be, or the output would not
    follow the target's law."""

    def __init__(self, target, draft: DraftKV, max_batch_size: int = 1, costs: StepCosts | None = None):
        if not (hasattr(target, "record_hidden") and hasattr(target, "hidden_by_row")):
            raise ConfigError(
                f"an EAGLE draft reads the target's hidden states, which {type(target).__name__} does not "
                "record; load the target on the fast Llama path (backend 'fast' or 'auto')"
            )
        if not draft.model.cfg.features:
            raise ConfigError("this draft does not read target features; use DraftModelProposer")
        self.target = target
        self.draft = draft
        self.stop_reach = STOP_REACH
        self.costs = costs if costs is not None else costs_for(target)
        """The target's measured step costs (the engine's, :func:`~verispec.costs.costs_for`)."""
        self._token_times = DraftTimes()
        """The recent drafting loops, seconds per drafted position."""
        self.alternatives = ALTERNATIVES
        """Greedy: candidates besides its own offered at each draft position (0: a plain chain)."""
        target.record_hidden = True
        self._agreed: dict[int, int] = {}
        """Pairs held in the draft's cache per slot (positions ``0 .. agreed - 1``)."""
        self._feature: dict[int, torch.Tensor] = {}
        """Per slot, the draft's output ``[hidden]`` at position ``agreed - 1``."""
        self._stash: dict[int, list[tuple[int, torch.Tensor]]] = {}
        """Per slot, target features ``(first position, [n, hidden])`` of committed positions kept
        by :meth:`observe` and not fed yet."""
        self._batch = 0
        self._ensure(max_batch_size)

    def _ensure(self, slots: int) -> None:
        if slots > self._batch:
            self.draft.reset(slots)
            self._batch = slots
            self._agreed, self._feature, self._stash = {}, {}, {}

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        """Keep the prefill's recorded features of the prompt; the first proposal feeds its pairs
        ``(h_t, x_{t+1})`` (a row that never drafts, under :class:`~verispec.lookup_first.LookupFirst`,
        never pays for them)."""
        self._ensure(slot + 1)
        self.draft.truncate(torch.zeros(1, dtype=torch.int64), rows=[slot])
        self._agreed[slot] = 0
        self._feature.pop(slot, None)
        self._stash.pop(slot, None)
        self.observe([slot], [list(tokens)])

    def propose(
        self,
        slots: list[int],
        committed: list[list[int]],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        """Catch up on the newly committed pairs, then draft ``max(num_tokens)`` tokens per row.

        A draft on the kernel picks its thread count from measured call times (``DraftKV``); in
        torch it runs on one thread (see :func:`~verispec.models.threads.torch_threads`) but for a
        prompt's worth of pairs, a prefill, where all threads pay.
        """
        batch = len(slots)
        k = int(num_tokens.max()) if batch else 0
        if k == 0:
            return _empty(batch)
        pending = sum(len(toks) - 1 - self._agreed.get(slot, 0) for slot, toks in zip(slots, committed))
        one_thread = nullcontext if self.draft.uses_kernel else functools.partial(torch_threads, 1)
        with one_thread() if pending <= 32 else nullcontext():
            for slot, toks in zip(slots, committed):
                if slot not in self._agreed:  # the proposer was resized under this row: start it again
                    self._ensure(slot + 1)
                    self._agreed[slot] = 0
                self._feed(slot, toks, len(toks) - 1)
        context = max(len(toks) for toks in committed)
        with one_thread():
            return self._draft_tokens(slots, num_tokens, params, generators, k, context)

    def stop_reaches(self, k: int, batch: int = 1, context: int = 0) -> list[float]:
        """``[s_0, .., s_{k-1}]``: a row stops after its draft token i where the head's chance of
        reaching the next one falls below ``s_i``. That token would add at most that many expected
        tokens, for its drafting (the head's measured seconds per token over the target's one-token
        step) and its verification (the measured cost of one more token in the target's call); at
        least :attr:`stop_reach`, which alone holds until both are measured."""
        per_token = self._token_times.in_steps(self.costs, batch, context)
        if per_token is None:
            return [self.stop_reach] * k
        curve = self.costs.ratios(k + 2, batch, context)  # curve[L]: verifying L draft tokens
        return [
            max(self.stop_reach, per_token + EXTRA_COST_WEIGHT * (curve[i + 2] - curve[i + 1]))
            for i in range(k)
        ]

    def observe(self, slots: list[int], committed: list[list[int]]) -> None:
        """Keep the target's features of the rows' newly committed positions (a step in which another
        drafter proposed for them): the next proposal feeds them all in one draft forward, so steps
        this head does not draft for cost it nothing, and it still reads the target's features."""
        for slot, toks in zip(slots, committed):
            start, hidden = self.target.hidden_by_row.get(slot, (0, None))
            valid = len(toks) - 1 - start  # positions start .. len - 2 held committed inputs
            if hidden is not None and valid > 0:
                self._stash.setdefault(slot, []).append((start, hidden[:valid]))

    def _draft_tokens(
        self,
        slots: list[int],
        num_tokens: torch.Tensor,
        params: SamplingTensors,
        generators,
        k: int,
        context: int = 0,
    ) -> Proposal:
        """Up to ``num_tokens`` (``[B]``, max ``k``) tokens per caught-up row, by feature autoregression."""
        batch = len(slots)
        # A row with no pair yet (a one-token prompt before its first target step) drafts nothing.
        ready = torch.tensor([s in self._feature for s in slots])
        num_draft = torch.where(ready, num_tokens, torch.zeros_like(num_tokens))
        if not bool(ready.any()):
            return _empty(batch)
        feats = torch.stack(
            [self._feature.get(s, torch.zeros(self.draft.model.cfg.hidden_size)) for s in slots]
        )  # [B, hidden]
        tokens = torch.zeros(batch, k, dtype=torch.int64)
        accept = torch.ones(batch, k)
        # Greedy: the head's next candidates at each position, leaves of a tree the engine may verify.
        spare = self.alternatives if params.all_greedy else 0
        alts = torch.full((batch, k, spare), -1, dtype=torch.int64)
        alt_probs = torch.zeros(batch, k, spare)
        reach = torch.ones(batch)  # the chance, by the head's own estimate, that drafting got this far
        probs_out: list[torch.Tensor] = []
        steps = 0
        seeded = not params.all_greedy and any(is_seeded(g) for g in generators)
        stops = [self.stop_reach] * k if seeded else self.stop_reaches(k, batch, context)
        start = time.perf_counter()
        vocab_ids = self.draft.model.vocab_ids
        for i in range(int(num_draft.max())):
            if params.all_greedy:
                # Over the head's own tokens only (the rest have probability 0): its top candidates,
                # the first drafted, the others offered as alternatives.
                dist = torch.softmax(self.draft.head_scores(feats), dim=-1)  # [B, draft_vocab]
                top_p, top_i = dist.topk(spare + 1, dim=-1)  # [B, spare + 1]
                top_t = top_i if vocab_ids is None else vocab_ids[top_i]
                tok = top_t[:, 0]
                accept[:, i] = top_p[:, 0]
                if spare:
                    alts[:, i] = top_t[:, 1:]
                    alt_probs[:, i] = top_p[:, 1:]
            else:
                logits = self.draft.logits(feats)  # [B, V]
                tok, probs = draw(logits, params, generators)
                assert probs is not None
                probs_out.append(probs)
                # Not the drawn token's own probability: see expected_acceptance.
                accept[:, i] = expected_acceptance(probs).cpu()
            tokens[:, i] = tok.cpu()
            reach = reach * accept[:, i]
            # A row stops where its next token would be reached too rarely to pay for drafting it.
            num_draft = torch.where(reach < stops[i], num_draft.clamp(max=i + 1), num_draft)
            steps = i + 1
            if steps >= int(num_draft.max()):
                break
            # Feature autoregression: the draft's feature stands in for the target's not yet computed one.
            self.draft.forward(tok[:, None], rows=slots, logits="none", features=feats[:, None])
            feats = self.draft.last_features[:, -1]  # [B, hidden]
        self._token_times.record(time.perf_counter() - start, steps)
        tokens = tokens[:, :steps]
        num_draft = num_draft.clamp(max=steps)
        probs = torch.stack(probs_out, dim=1) if probs_out else None  # [B, steps, V]
        return Proposal(
            tokens=tokens,
            probs=probs,
            num_draft=num_draft,
            accept_probs=accept[:, :steps],
            alternatives=alts[:, :steps] if spare else None,
            alternative_probs=alt_probs[:, :steps] if spare else None,
        )

    def _feed(self, slot: int, tokens: list[int], upto: int) -> None:
        """Roll the slot back to its agreed pairs and feed pairs ``agreed .. upto - 1``
        (``(h_t, tokens[t + 1])``), with the target's recorded features: those :meth:`observe` kept
        and the target's last forward, all in one draft forward.

        Positions none of them covers (a step in which nobody observed for this row) are fed one at
        a time with the draft's own feature, as when drafting: any draft distribution keeps
        verification exact, so this only costs acceptance.
        """
        agreed = self._agreed[slot]
        self.draft.truncate([agreed], rows=[slot])
        chunks = self._stash.pop(slot, [])
        if upto <= agreed:
            return
        latest = self.target.hidden_by_row.get(slot)
        if latest is not None:
            chunks.append(latest)
        width = self.draft.model.cfg.hidden_size
        feats = torch.empty(upto - agreed, width)  # the target's feature at each position agreed .. upto-1
        have = torch.zeros(upto - agreed, dtype=torch.bool)
        for start, hidden in chunks:  # later chunks overwrite earlier ones (a re-verified position)
            lo, hi = max(start, agreed), min(start + len(hidden), upto)
            if lo < hi:
                feats[lo - agreed : hi - agreed] = hidden[lo - start : hi - start]
                have[lo - agreed : hi - agreed] = True
        missing = torch.nonzero(~have).flatten()
        first = agreed + (int(missing[-1]) + 1 if len(missing) else 0)  # positions first.. all covered
        for t in range(agreed, first):  # uncovered positions, rare
            feat = self._feature.get(slot, torch.zeros(width))
            self.draft.forward(
                torch.tensor([[tokens[t + 1]]]), rows=[slot], logits="none", features=feat[None, None]
            )
            self._feature[slot] = self.draft.last_features[0, -1]
        if first < upto:
            ids = torch.tensor([tokens[first + 1 : upto + 1]])  # [1, n]
            self.draft.forward(ids, rows=[slot], logits="none", features=feats[first - agreed :][None])
            self._feature[slot] = self.draft.last_features[0, -1]
        self._agreed[slot] = upto


# ------------------------------------------------------------------------------------------ training


@torch.inference_mode()
def extract_features(target, corpus: Sequence[dict], out: str | Path, *, per_shard: int = 100) -> Path:
    """Store the target's last hidden states (float16 ``[T, hidden]`` per sequence, prompt and answer
    in one prefill) as ``out/features_*.pt`` shards of ``per_shard`` sequences, in corpus order.

    Shards already written are kept, so an interrupted run resumes.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target.record_hidden = True
    t0 = time.time()
    for c0 in range(0, len(corpus), per_shard):
        path = out / f"features_{c0 // per_shard:05d}.pt"
        if path.is_file():
            continue
        shard = []
        for seq in corpus[c0 : c0 + per_shard]:
            target.reset(1)
            target.forward(torch.as_tensor(seq["ids"])[None], rows=[0], logits="none")
            shard.append(target.last_hidden[0].to(torch.float16).clone())
        tmp = path.with_suffix(".tmp")
        torch.save(shard, tmp)
        tmp.replace(path)
        print(f"features: {c0 + len(shard)}/{len(corpus)} sequences, {time.time() - t0:.0f} s", flush=True)
    return out


def read_features(folder: str | Path) -> list[torch.Tensor]:
    """All ``[T, hidden]`` float16 feature tensors of a folder written by :func:`extract_features`."""
    feats: list[torch.Tensor] = []
    for shard in sorted(Path(folder).glob("features_*.pt")):
        feats.extend(torch.load(shard))
    return feats


def batch_features(features: Sequence[torch.Tensor], index: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length, hidden]`` float32 features of the corpus sequences ``index`` ``[B]``, zero-padded,
    on the features' device."""
    first = features[int(index[0])]
    out = torch.zeros(len(index), length, first.shape[-1], device=first.device)
    for b, i in enumerate(index.tolist()):
        n = min(length, features[i].shape[0])
        out[b, :n] = features[i][:n].float()
    return out


def unrolled_forward(
    model: DraftLM, ids: torch.Tensor, feats: torch.Tensor, unroll: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced draft features, and one step of feature autoregression.

    Args:
        ids: ``[B, T]`` tokens; feats: ``[B, T, hidden]`` the target's features at the same positions.

    Returns:
        ``f1`` ``[B, T - 1, hidden]``: position ``t`` from the pair ``(h_t, x_{t+1})``; and with
        ``unroll``, ``f2`` ``[B, T - 2, hidden]``: position ``t + 1`` from ``(f1_t, x_{t+2})``, whose
        query sees the teacher-forced keys of positions ``0 .. t`` and its own, exactly as the second
        draft token does at inference.
    """
    b, t = ids.shape
    groups = model.cfg.num_heads // model.cfg.num_kv_heads
    n1 = t - 1
    x1 = model.inputs(ids[:, 1:], feats[:, :-1])  # [B, T-1, hidden]
    dev = ids.device
    cos, sin = model._rope(torch.arange(n1, device=dev).expand(b, n1))
    kv = []
    for layer in model.layers:
        q, k, v = model._qkv(layer, x1, cos, sin)  # [B, H, T-1, D], [B, H_kv, T-1, D]
        kv.append((k, v))
        attn = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
        )
        x1 = model._finish(layer, x1, attn)
    if not unroll or t < 3:
        return x1, None
    n2 = t - 2
    x2 = model.inputs(ids[:, 2:], x1[:, :-1])  # [B, T-2, hidden]: positions 1 .. T-2
    cos, sin = model._rope((torch.arange(n2, device=dev) + 1).expand(b, n2))
    # Query i (position i + 1) sees teacher-forced keys 0..i and its own unrolled key.
    causal = torch.ones(n2, n2, dtype=torch.bool, device=dev).tril()
    mask = torch.cat([causal, torch.eye(n2, dtype=torch.bool, device=dev)], dim=1)
    for layer, (k1, v1) in zip(model.layers, kv):
        q, k, v = model._qkv(layer, x2, cos, sin)
        keys = torch.cat([k1[:, :, :n2], k], dim=2).repeat_interleave(groups, 1)  # [B, H, 2(T-2), D]
        vals = torch.cat([v1[:, :, :n2], v], dim=2).repeat_interleave(groups, 1)
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        x2 = model._finish(layer, x2, attn)
    return x1, x2


def eagle_loss(
    model: DraftLM,
    ids: torch.Tensor,
    feats: torch.Tensor,
    lab: torch.Tensor,
    prob: torch.Tensor,
    *,
    reg_weight: float = 1.0,
    unroll: bool = True,
    noise: float = 0.0,
) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy (target's top-K labels) + ``reg_weight`` x smooth-L1 feature regression,
    summed over the teacher-forced step and the unrolled one; and the first step's top-1 agreement.

    ``ids`` ``[B, T]``, ``feats`` ``[B, T, hidden]``, ``lab``/``prob`` ``[B, T, K]`` as built by
    :func:`verispec.distill.train.make_batches` (label at ``t`` = the target's distribution of
    ``ids[t + 1]``). Features are compared in units of their RMS, so the weight does not depend on
    the target's scale. ``noise`` adds Gaussian noise of that relative size to the input features.
    """
    scale = feats.pow(2).mean().sqrt().clamp(min=1e-6)
    noisy = feats + noise * scale * torch.randn_like(feats) if noise > 0 else feats
    f1, f2 = unrolled_forward(model, ids, noisy, unroll=unroll)
    total = ids.new_zeros((), dtype=torch.float32)
    agree = 0.0
    for step, f in enumerate((f1, f2)):
        if f is None:
            continue
        shift = step + 1  # f at position t predicts ids[t + 1 + shift]: label at t + shift
        lab_s, prob_s, target = lab[:, shift:], prob[:, shift:], feats[:, shift:]
        has = prob_s.sum(-1) > 0  # [B, T - shift]
        if not bool(has.any()):
            continue
        mine = f[has]  # [N, hidden]
        logp = torch.log_softmax(model.scores(mine), dim=-1)  # [N, draft_vocab]
        ce = -(logp.gather(-1, lab_s[has]) * prob_s[has]).sum(-1).mean()
        reg = F.smooth_l1_loss(mine / scale, target[has] / scale)
        total = total + ce + reg_weight * reg
        if step == 0:
            with torch.no_grad():
                top = prob_s[has][:, 0] > 0
                agree = (logp.argmax(-1) == lab_s[has][:, 0])[top].float().mean().item()
    return total, agree
