"""Speculative decoding from scratch, as readable as possible: documentation and a test oracle.

This follows the usual tutorial version (Leviathan et al., 2023, Algorithm 1) with its common bugs
fixed:

- the residual after a rejection is ``max(0, p_target - p_draft)`` normalised, not the target itself;
- the acceptance test compares against ``p_target / p_draft`` of the *drafted* token, not the argmax;
- after k accepts, one bonus token is sampled from the target at the next position;
- the output never exceeds ``max_new_tokens``.

Models only need ``.logits(ids: [seq] int64) -> [seq, vocab]``; nothing is cached, everything is
recomputed, and sampling is at temperature 1. The engine in :mod:`verispec.engine` is the fast,
batched, cached version of exactly this.
"""

from __future__ import annotations

import torch


def speculative_decode(
    target_model,
    draft_model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 128,
    k: int = 4,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``input_ids`` (``[T]`` or ``[1, T]``) by up to ``max_new_tokens`` tokens.

    Returns the whole sequence, prompt included, in the input's shape convention.
    """
    batched = input_ids.dim() == 2
    seq = input_ids[0] if batched else input_ids
    seq = seq.clone()
    goal = seq.shape[0] + max_new_tokens

    while seq.shape[0] < goal:
        # 1. The draft proposes k tokens, one at a time, remembering its distributions.
        draft_seq = seq
        draft_probs = []
        for _ in range(k):
            probs = torch.softmax(draft_model.logits(draft_seq)[-1].double(), dim=-1)  # [V]
            token = torch.multinomial(probs, 1, generator=generator)
            draft_probs.append(probs)
            draft_seq = torch.cat([draft_seq, token])
        drafted = draft_seq[seq.shape[0] :]  # [k]

        # 2. The target scores all k positions (and the one after) in one pass.
        target_logits = target_model.logits(draft_seq)[seq.shape[0] - 1 :]  # [k + 1, V]
        target_probs = torch.softmax(target_logits.double(), dim=-1)

        # 3. Accept each draft token with probability min(1, p_target / p_draft).
        accepted = 0
        next_token = None
        for i in range(k):
            token = drafted[i]
            p_target = target_probs[i, token]
            p_draft = draft_probs[i][token]
            if torch.rand(1, generator=generator, dtype=torch.float64) * p_draft < p_target:
                accepted += 1
                continue
            # 4. First rejection: sample from the normalised residual max(0, p_target - p_draft).
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
            next_token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            break
        if next_token is None:
            # 5. All k accepted: one bonus token from the target's next distribution.
            next_token = torch.multinomial(target_probs[k], 1, generator=generator)

        seq = torch.cat([seq, drafted[:accepted], next_token])

    seq = seq[:goal]
    return seq[None] if batched else seq
