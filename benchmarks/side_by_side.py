"""What the side-by-side scripts (``q4_ab.py``, ``kv_ab.py``) share: one greedy or seeded request
on a target with or without a drafter, and each prompt's configurations run in an order rotated
per prompt and round, each keeping its fastest round."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from verispec.api import GenerationResult, speculative_generate


def generate(target, drafter, ids: list[int], max_new_tokens: int, k: int, temperature: float = 0.0):
    """``speculative_generate`` with ``k`` draft tokens a step where ``drafter`` is not None (plain
    decoding where it is), seed 0 when sampling."""
    return speculative_generate(
        target,
        drafter,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=0 if temperature > 0 else None,
        num_speculative_tokens=k if drafter is not None else 0,
    )


def fastest_rounds(
    configs: Sequence[str],
    run: Callable[[list[int], str], GenerationResult],
    ids: list[int],
    index: int,
    repeats: int,
) -> dict[str, GenerationResult]:
    """Each configuration's fastest of ``repeats`` runs on prompt ``ids`` (the ``index``-th), the
    configurations taken in an order rotated by prompt and round so that none is always first."""
    best: dict[str, GenerationResult] = {}
    for r in range(repeats):
        shift = (index + r) % len(configs)
        for config in [*configs[shift:], *configs[:shift]]:
            result = run(ids, config)
            if config not in best or result.stats.seconds < best[config].stats.seconds:
                best[config] = result
    return best
