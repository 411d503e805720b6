"""The top-p mask of the shared sampling transform (``verispec.sampling._top_p_mask``), and the
precision of the draws (``verispec.rejection.inverse_cdf``, ``uniforms``).

The mask ranks only the most probable tokens (``torch.topk``, widening until each row's prefix
ends inside the ranked window) instead of sorting the vocabulary. These tests hold it to the
definition, against a float64 sort of the whole vocabulary: a token stays when the mass ranked
before it is below top_p. Decisions may differ only where that mass lies within rounding of top_p.
"""

from __future__ import annotations

import pytest
import torch

from verispec.rejection import inverse_cdf, uniforms
from verispec.sampling import _top_p_mask

V = 49152  # the default model's vocabulary


def _reference(scaled: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, margin)`` for ``scaled [..., V]``: the float64 definition, and per token how far the
    mass ranked before it lies from ``top_p``."""
    probs = torch.softmax(scaled.double(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(ranked, dim=-1) - ranked
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)
    margin = torch.zeros_like(probs).scatter(-1, order, (before - top_p).abs())
    return keep, margin


@pytest.mark.parametrize("scale", [8.0, 2.0, 0.6, 0.05])  # kept: a few, hundreds, thousands, most
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_top_p_keeps_the_definitions_prefix(scale: float, top_p: float) -> None:
    """Rows whose nucleus ends inside the first window (64 tokens), the wider ones, and the whole
    vocabulary: the same tokens as the definition, but within rounding of the cut."""
    scaled = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(int(scale * 100))) * scale
    out = _top_p_mask(scaled, torch.full((2, 1, 1), top_p, dtype=torch.float64))
    got = torch.isfinite(out)
    want, margin = _reference(scaled, top_p)
    clear = margin > 1e-6
    assert torch.equal(got[clear], want[clear])
    assert int((got != want).sum()) <= int((~clear).sum())
    assert torch.equal(out[got], scaled[got])  # kept logits unchanged


def test_top_p_edges() -> None:
    """The most probable token always stays; tied tokens are taken as a prefix of some order; masked
    (-inf) tokens never come back."""
    scaled = torch.randn(1, 1, V, generator=torch.Generator().manual_seed(1))
    tiny = torch.isfinite(_top_p_mask(scaled, torch.full((1, 1, 1), 1e-9)))
    assert int(tiny.sum()) == 1 and bool(tiny[0, 0, int(scaled.argmax())])
    ties = torch.zeros(1, 1, 100)  # each token 1 / 100 of the mass
    assert int(torch.isfinite(_top_p_mask(ties, torch.full((1, 1, 1), 0.505))).sum()) == 51
    masked = scaled.clone()
    masked[..., 10:] = -torch.inf  # what top-k leaves
    got = torch.isfinite(_top_p_mask(masked, torch.full((1, 1, 1), 0.999999)))
    assert int(got.sum()) == 10 and bool(got[..., :10].all())


def test_draws_resolve_tokens_far_below_float32s_grid() -> None:
    """Uniforms are float64 and the cdf is summed in float64. In float32 the running sum 0.5 + 1e-9
    rounds back to 0.5, leaving the middle token no interval to be drawn in, and a float32 uniform
    could not fall inside it anyway (its grid is 2^-24)."""
    probs = torch.tensor([[0.5, 1e-9, 0.5]])  # float32, as the engine's
    inside = torch.tensor([0.5000000005 / (1 + 1e-9)], dtype=torch.float64)
    assert int(inverse_cdf(probs, inside)[0]) == 1
    assert int(inverse_cdf(probs, torch.tensor([0.4], dtype=torch.float64))[0]) == 0
    assert int(inverse_cdf(probs, torch.tensor([0.6], dtype=torch.float64))[0]) == 2
    assert uniforms([None, torch.Generator().manual_seed(0)], 3).dtype == torch.float64
