"""Speculative rejection sampling (Leviathan et al., 2023; Chen et al., 2023), as a pure function.

Output, per row: the **accepted** draft tokens, then one more token that is either **recovered**
(sampled from the normalised residual ``max(0, target_probs - draft_probs)`` at the first rejection)
or the **bonus** (sampled from the target at the position after the last draft, when every draft
token was accepted). Slots after that are padded with -1.

Draft token ``i`` is accepted with probability ``min(1, target_probs[i] / draft_probs[i])``; this makes
every emitted token distributed exactly as the target's (transformed) distribution. A drafter that
gives no probabilities (n-gram lookup) is a point mass: ``draft_probs[i] = 1`` at its token.
Greedy rows arrive as one-hot distributions, for which the rule is exact argmax matching.

**Randomness by position.** Each uniform belongs to one position of a request's output, drawn from
a counter-based stream keyed by the request's seed (:func:`position_uniforms`), not taken in turn
from a generator. At a point-mass position the rule is carried out with the position's token
uniform ``u``: the target's own token there, ``y = inverse_cdf(target_probs[i], u)``, is computed,
the draft token is accepted when it equals ``y``, and otherwise ``y`` is the recovered token. That
is the same rule, not an approximation: ``P(y = draft) = target_probs[i][draft] = min(1,
target_probs[i][draft] / 1)``, and ``y`` given ``y != draft`` follows ``target_probs[i]`` without
the draft token, renormalised, which is the residual ``max(0, target_probs[i] - draft_probs[i])``
of a point mass. So every emitted token is ``inverse_cdf(target_probs at its position, its uniform)``,
exactly what plain sampled decoding emits with the same seed: with a point-mass drafter (prompt
lookup, the n-gram table) a seeded response is token for token the plain response, whatever was
drafted, however many tokens a step verified and whichever requests shared the batch, given a
target whose logits for a token do not depend on how many tokens its forward holds (the kernel's).
A drafter that samples its tokens from ``draft_probs`` keeps the classic form, with a second uniform
per position (``accept_uniforms``) for the acceptance test; its responses follow the target's law
but not the plain response's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verispec.sampling import SamplingTensors, logits_to_probs, sampling_kernel


@dataclass(frozen=True)
class Verdict:
    """What one verification step emits."""

    tokens: torch.Tensor  # [B, k + 1] int64: accepted..., recovered-or-bonus, then -1 padding
    num_accepted: torch.Tensor  # [B] int64: accepted draft tokens per row (emitted = num_accepted + 1)


def uniforms(generators: Sequence[torch.Generator | None], count: int) -> torch.Tensor:
    """``[B, count]`` float64 uniforms in [0, 1), row b drawn from its own generator (a seed
    reproduces a row).

    When no row has a generator, one vectorised draw from the global generator serves all. float64:
    float32 uniforms lie on a grid of 2^-24, which would give each token's sampling probability an
    error of up to 2^-24 (up to 0.3% of total variation over a 49152-token vocabulary); float64's
    grid of 2^-53 makes that negligible.
    """
    if all(g is None for g in generators):
        return torch.rand(len(generators), count, dtype=torch.float64)
    return torch.stack([torch.rand(count, generator=g, dtype=torch.float64) for g in generators])


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment
TOKEN_STREAM = 0
"""The stream of the uniform each output position's token is drawn with."""
ACCEPT_STREAM = 1
"""The stream of the acceptance test of a draft token that was sampled from ``draft_probs``."""


def _mix64(x: int) -> int:
    """SplitMix64's output function, a bijection of 64-bit integers."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniforms(keys: Sequence[int], starts: Sequence[int], count: int, stream: int) -> torch.Tensor:
    """``[B, count]`` float64 uniforms in [0, 1): row b's are those of its output positions
    ``starts[b] .. starts[b] + count - 1`` in ``stream``, for the request keyed ``keys[b]`` (its seed).

    A value depends only on (key, stream, position), never on how many were drawn before or beside
    it: SplitMix64 (Steele, Lea and Flood, 2014) started at a state hashed from the key and the
    stream, its output number ``position``. 53 random bits per value (float64's grid, as
    :func:`uniforms`). On Python ints: a step needs a few values per row (7 us for one row of 5,
    against 20 us through numpy's fixed costs).
    """
    rows = []
    for key, start in zip(keys, starts):
        state = _mix64((int(key) ^ (stream * 0xD1B54A32D192ED03)) & _MASK64)
        rows.append(
            [
                (_mix64((state + pos * _GAMMA) & _MASK64) >> 11) * 2.0**-53
                for pos in range(start + 1, start + count + 1)
            ]
        )
    return torch.tensor(rows, dtype=torch.float64).view(len(rows), count)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
    token_uniforms: torch.Tensor,
    accept_uniforms: torch.Tensor | None = None,
) -> Verdict:
    """Accept or reject each row's draft tokens and sample the one token that follows.

    Args:
        draft_tokens: ``[B, k]`` int64 proposed tokens (values past ``num_draft`` are ignored).
        draft_probs: ``[B, k, V]`` the distributions the draft tokens were sampled from, after the
            shared sampling transform; None for point-mass drafters.
        target_probs: ``[B, k + 1, V]`` target distributions at each draft position and the one after.
        num_draft: ``[B]`` int64, how many of the k slots hold real drafts in each row (0 = none).
        token_uniforms: ``[B, k + 1]`` float64, each position's uniform for the token emitted there
            (:data:`TOKEN_STREAM`).
        accept_uniforms: ``[B, k]`` float64, each position's uniform for testing a draft token drawn
            from ``draft_probs`` (:data:`ACCEPT_STREAM`); needed only with ``draft_probs``.

    Returns:
        A :class:`Verdict`. Where a position's draft distribution is a point mass (``draft_probs``
        None, or 1 at the draft token), the token emitted there is the target's own draw from the
        position's token uniform (module docstring).
    """

    def at(rows: list[int], i: int) -> torch.Tensor:  # [R, V]
        return _take(target_probs[:, i], rows)

    return _walk(draft_tokens, draft_probs, at, num_draft, token_uniforms, accept_uniforms)


def rejection_sample_logits(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingTensors,
    num_draft: torch.Tensor,
    token_uniforms: torch.Tensor,
    accept_uniforms: torch.Tensor | None = None,
) -> Verdict:
    """:func:`rejection_sample` of ``logits_to_probs(target_logits, params)`` (``target_logits``
    ``[B, k + 1, V]``, ``params`` the B rows' settings), with each row's distribution at a position
    made only when the walk gets there: a step whose first draft token is rejected transforms one
    position of the row, not k + 1 (the transform is a row's own arithmetic, so the verdict is the
    same token for token)."""
    every = list(range(target_logits.shape[0]))

    def at(rows: list[int], i: int) -> torch.Tensor:  # [R, V]
        if rows == every:
            return logits_to_probs(target_logits[:, i], params)
        return logits_to_probs(_take(target_logits[:, i], rows), params.select(rows))

    return _walk(draft_tokens, draft_probs, at, num_draft, token_uniforms, accept_uniforms)


def _take(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``values[rows]`` (``[B, V]`` -> ``[R, V]``); one row as a view, not a copy of its vocabulary."""
    if len(rows) == 1:
        return values[rows[0] : rows[0] + 1]
    return values[torch.tensor(rows)]


def _walk(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_at: Callable[[list[int], int], torch.Tensor],
    num_draft: torch.Tensor,
    token_uniforms: torch.Tensor,
    accept_uniforms: torch.Tensor | None,
) -> Verdict:
    """The verdict, with ``target_at(rows, i)`` the target's distributions ``[R, V]`` of ``rows`` at
    position ``i``. Each row walks its drafts until one is rejected or none is left, all rows a
    position at a time: the distributions the walks reach at a position are asked for in one call,
    and the target's own tokens there (at point masses, and the bonus) drawn in one more."""
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    rand = token_uniforms.tolist()  # [B][k + 1]
    safe_tokens = draft_tokens.clamp_min(0)
    drafts, limits = safe_tokens.tolist(), num_draft.tolist()
    point = [[True] * k for _ in range(batch)]  # [B][k]
    draft_at_draft: list[list[float]] = []  # [B][k]
    tested: list[list[float]] = []  # [B][k]: uniforms of the acceptance tests
    if draft_probs is not None and k:
        at_draft = draft_probs.gather(-1, safe_tokens[..., None])[..., 0]  # [B, k]
        point = (at_draft == 1.0).tolist()
        if not all(all(row[:n]) for row, n in zip(point, limits)):
            if accept_uniforms is None:
                raise ValueError("drafts sampled from draft_probs need accept_uniforms")
            draft_at_draft, tested = at_draft.tolist(), accept_uniforms.tolist()

    accepted, last = [0] * batch, [-1] * batch
    walking = list(range(batch))
    for i in range(k + 1):
        if not walking:
            break
        probs = target_at(walking, i)  # [R, V], row r of walking[r]
        drawing = [r for r, b in enumerate(walking) if i == limits[b] or point[b][i]]
        # Per row b of the walk: the target's own token here, or its probability of b's sampled draft.
        own: dict[int, int] = {}
        if drawing:
            u = torch.tensor([rand[walking[r]][i] for r in drawing], dtype=torch.float64)
            own = dict(zip((walking[r] for r in drawing), inverse_cdf(_take(probs, drawing), u).tolist()))
        sampled = [r for r, b in enumerate(walking) if i < limits[b] and not point[b][i]]
        target_at_draft: dict[int, float] = {}
        if sampled:
            chosen = torch.tensor([drafts[walking[r]][i] for r in sampled])
            found = probs[torch.tensor(sampled), chosen].tolist()
            target_at_draft = dict(zip((walking[r] for r in sampled), found))
        still, rejected = [], []
        for r, b in enumerate(walking):
            if i < limits[b]:
                if point[b][i]:
                    ok = own[b] == drafts[b][i]
                else:  # u < p_target / p_draft, written without division; strict so that 0 never accepts
                    ok = tested[b][i] * draft_at_draft[b][i] < target_at_draft[b]
                if ok:
                    still.append(b)
                    continue
            accepted[b] = i
            if b in own:
                last[b] = own[b]  # the bonus, or the target's token where a point mass missed
            else:
                rejected.append(r)
        if rejected:  # rejected sampled draft tokens: the recovered tokens from the normalised residual
            assert draft_probs is not None
            rows = [walking[r] for r in rejected]
            final = probs[torch.tensor(rejected)]  # [R, V]
            residual = (final - draft_probs[torch.tensor(rows), i].to(final.dtype)).clamp_min(0)
            mass = residual.sum(dim=-1, keepdim=True)
            # A rejection is impossible when the residual has no mass; keep the target (guards 0/0).
            residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(final.dtype).tiny), final)
            u = torch.tensor([rand[b][i] for b in rows], dtype=torch.float64)
            for b, token in zip(rows, inverse_cdf(residual, u).tolist()):
                last[b] = token
        walking = still
    tokens = torch.full((batch, k + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.tensor(accepted, dtype=torch.int64, device=device)  # [B]
    keep = torch.arange(k, device=device)[None, :] < num_accepted[:, None]  # [B, k]
    tokens[:, :k] = torch.where(keep, draft_tokens, tokens[:, :k])
    tokens.scatter_(1, num_accepted[:, None], torch.tensor(last, device=device)[:, None])
    return Verdict(tokens=tokens, num_accepted=num_accepted)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample ``[B]`` tokens from ``probs [B, V]`` (need not be normalised) with uniforms ``u [B]``.

    Zero-probability tokens are never chosen (``right=True`` needs the cdf to strictly exceed u).
    The cdf is summed in float64: in float32, a token after most of the mass could lose up to
    half an ulp of the running sum (2^-25), and one below that vanish.
    """
    kernel = sampling_kernel(probs)
    if kernel is not None:
        return kernel.draw_rows(probs.contiguous(), u.double().contiguous())
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (u.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp(max=probs.shape[-1] - 1)


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor
) -> Verdict:
    """:func:`rejection_sample` for rows that are all greedy, without building distributions.

    With one-hot target and draft distributions the rule reduces to: accept while the draft token is
    the target's argmax; the recovered or bonus token is the argmax at the first mismatch. This gives
    the same :class:`Verdict` as :func:`rejection_sample` on one-hot inputs (tested), at a fraction of
    the cost per step.

    Args:
        draft_tokens: ``[B, k]`` int64.
        target_logits: ``[B, k + 1, V]``.
        num_draft: ``[B]`` int64 real drafts per row.
    """
    return _accept_chain(draft_tokens, argmax_last(target_logits).to(draft_tokens.device), num_draft)


def argmax_last(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` -> ``[...]`` int64: the index of each row's largest value (the first on ties;
    NaN counts as largest), as ``torch.argmax``. On the CPU it is numpy's: 7-10x faster than torch's
    here (one 49152-wide row 4 us against 46, five rows 19 against 134), once per decoding step."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def greedy_tokens(model, lines: list[list[int]], rows: list[int]) -> list[list[int]]:
    """Feed ``lines`` (``[n][T]`` token ids, one line per row in ``rows``) to ``model`` and return the
    index of the largest logit at every position, ``[n][T]`` (the first on ties; NaN counts as
    largest): the model's own ``forward_greedy`` where it has one (FastLlama's kernel does it in one
    call on Python ints), else ``forward(..., logits="argmax")`` and :func:`argmax_last`."""
    own = getattr(model, "forward_greedy", None)
    return own(lines, rows) if own is not None else forward_argmax(model, lines, rows)


def forward_argmax(model, lines: list[list[int]], rows: list[int]) -> list[list[int]]:
    """:func:`greedy_tokens` through the model's ``forward(..., logits="argmax")`` and
    :func:`argmax_last`: for models without a ``forward_greedy``, and for the calls theirs leaves to
    ``forward``."""
    logits = model.forward(torch.tensor(lines, dtype=torch.int64), rows=rows, logits="argmax")
    return argmax_last(logits).tolist()


def greedy_accept(
    drafts: list[list[int]], best: list[list[int]], limits: list[int]
) -> tuple[list[list[int]], list[int]]:
    """:func:`greedy_verify` on Python ints: per row, the emitted tokens (the drafts that equal the
    target's argmax ``best[row]`` (``k + 1`` tokens), then the target's token where they stop) and
    how many drafts were accepted; only the first ``limits[row]`` drafts count."""
    emitted, counts = [], []
    for drafted, want, limit in zip(drafts, best, limits):
        n, stop = 0, min(limit, len(drafted))
        while n < stop and drafted[n] == want[n]:
            n += 1
        emitted.append(drafted[:n] + [want[n]])
        counts.append(n)
    return emitted, counts


def _accept_chain(draft_tokens: torch.Tensor, best: torch.Tensor, num_draft: torch.Tensor) -> Verdict:
    """:func:`greedy_verify` given the target's argmax tokens ``best`` ``[B, k + 1]``.

    On Python ints (:func:`greedy_accept`): the tensors hold a few ints per row, and right after a
    forward that streamed the weights through every cache level each small torch or numpy
    operation costs about 10 us. The verdict is on ``draft_tokens``' device.
    """
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    if k == 0:  # a plain step: the target's argmax, nothing to compare
        zeros = torch.zeros(batch, dtype=torch.int64, device=device)
        return Verdict(tokens=best.to(device), num_accepted=zeros)
    emitted, counts = greedy_accept(draft_tokens.tolist(), best.tolist(), num_draft.tolist())
    rows = [row + [-1] * (k + 1 - len(row)) for row in emitted]
    return Verdict(
        tokens=torch.tensor(rows, dtype=torch.int64, device=device),
        num_accepted=torch.tensor(counts, dtype=torch.int64, device=device),
    )


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """A :class:`Verdict` of :func:`greedy_verify_tree`; ``tokens`` is ``[B, k + 2]``."""

    alternative: torch.Tensor  # [B] int64: the accepted alternative's index, -1 where none


def greedy_verify_tree(
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    alternative_tokens: torch.Tensor,
    alternative_positions: torch.Tensor,
    target_logits: torch.Tensor,
) -> TreeVerdict:
    """:func:`greedy_verify` for a chain of drafts with alternatives verified beside it (a tree).

    An alternative at position i is another candidate for draft token i, scored by the target after
    the pending token and draft tokens 0..i-1 (a leaf of the tree). Where the chain first misses,
    at position ``num_accepted`` (or where it ends), the target's token there is emitted as always;
    when an alternative at that position is that token, it is accepted too, and the token after it
    is the target's argmax at the alternative. Every emitted token is the target's greedy token.

    Args:
        draft_tokens: ``[B, k]`` int64, the chain.
        num_draft: ``[B]`` int64 real chain tokens per row.
        alternative_tokens: ``[B, A]`` int64.
        alternative_positions: ``[B, A]`` int64 chain position of each alternative, -1 for padding.
        target_logits: ``[B, 1 + k + A, V]``: after the pending token, each chain token, each
            alternative.
    """
    batch, k = draft_tokens.shape
    best = argmax_last(target_logits).to(draft_tokens.device)  # [B, 1 + k + A]
    chain = _accept_chain(draft_tokens, best[:, : k + 1], num_draft)
    accepted = chain.num_accepted  # [B]
    target_token = best.gather(1, accepted[:, None])  # [B, 1]: the target's token at the miss
    hits = (alternative_positions == accepted[:, None]) & (alternative_tokens == target_token)  # [B, A]
    hit = hits.any(dim=1)  # [B]
    first = hits.to(torch.int64).argmax(dim=1)  # [B] the first hit (0 where none)
    after = best[:, 1 + k :].gather(1, first[:, None])[:, 0]  # [B] target's token after it
    tokens = torch.full((batch, k + 2), -1, dtype=torch.int64, device=draft_tokens.device)
    tokens[:, : k + 1] = chain.tokens
    tokens.scatter_(1, (accepted + 1)[:, None], torch.where(hit, after, -1)[:, None])
    return TreeVerdict(
        tokens=tokens,
        num_accepted=accepted + hit.to(torch.int64),
        alternative=torch.where(hit, first, -1),
    )
