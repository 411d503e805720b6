"""The top-p mask of the shared sampling transform (``verispec.sampling._top_p_mask``), the
precision of the draws (``verispec.rejection.inverse_cdf``, ``uniforms``), and the C++ kernel's
one-pass transform and draws that replace both for float32 tensors.

The mask ranks only the most probable tokens (``torch.topk``, widening until each row's prefix
ends inside the ranked window) instead of sorting the vocabulary. These tests hold it to the
definition, against a float64 sort of the whole vocabulary: a token stays when the mass ranked
before it is below top_p. Decisions may differ only where that mass lies within rounding of top_p.
"""

from __future__ import annotations

import pytest
import torch

from verispec.models import fast_llama
from verispec.models.fast_llama import kernel_available
from verispec.rejection import inverse_cdf, uniforms
from verispec.sampling import SamplingTensors, _top_p_mask, logits_to_probs, sampling_kernel

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


# The C++ kernel's one-pass transform and draws (``sampling_probs``, ``draw_rows``), which
# ``logits_to_probs`` and ``inverse_cdf`` take for float32 tensors once a fast model has loaded the
# kernel. They are held to the same float64 definition as the torch path.

requires_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")


def _transform_reference(
    logits: torch.Tensor, t: float, k: int, p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, margin)`` of ``logits [R, V]`` in float64: the float32 division by the temperature
    (as both paths divide), top-k (ties at the k-th value stay), top-p over a stable sort (equal
    probabilities by index), softmax; per token, how far the mass ranked before it lies from top_p."""
    scaled = (logits / torch.tensor(t, dtype=torch.float32)).double()
    if 0 < k < scaled.shape[-1]:
        kth = torch.topk(scaled, k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    margin = torch.ones_like(scaled)
    if p < 1:
        keep, margin = _reference(scaled, p)
        scaled = scaled.masked_fill(~keep, -torch.inf)
    return torch.softmax(scaled, dim=-1), margin


def _kernel_probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """The kernel's ``sampling_probs`` of ``logits [R, V]`` with one setting for every row, ``[R, V]``."""
    rows = logits.shape[0]
    f64 = torch.float64
    return fast_llama._load_kernel().sampling_probs(
        logits.contiguous(),
        torch.full((rows,), t, dtype=f64),
        torch.full((rows,), k),
        torch.full((rows,), p, dtype=f64),
    )


@requires_kernel
@pytest.mark.parametrize(
    ("scale", "temperature", "top_k", "top_p", "ties"),
    [
        (3.0, 0.7, 0, 1.0, False),
        (3.0, 0.7, 50, 1.0, False),
        (3.0, 0.7, 0, 0.9, False),  # a nucleus of thousands
        (3.0, 0.7, 50, 0.9, False),
        (8.0, 1.0, 0, 0.5, False),  # a few tokens
        (0.05, 1.0, 0, 0.95, False),  # most of the vocabulary
        (2.0, 0.05, 0, 1.0, False),  # most probabilities below float32's range
        (2.0, 1.0, 40, 0.8, True),  # equal logits at the top-k and top-p cuts
        (0.0, 1.0, 0, 0.505, True),  # all equal: the first half by index
        (3.0, 1.0, 0, 1e-9, False),  # only the most probable
    ],
)
def test_kernel_transform_keeps_the_definition(scale, temperature, top_k, top_p, ties) -> None:
    """The same tokens as the float64 definition (but within rounding of the top-p cut), their
    probabilities within 1e-6 in total variation, 0 everywhere else."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(int(scale * 10) + top_k)) * scale
    if ties:
        logits = logits.round()
    rows = logits.shape[0]
    got = _kernel_probs(logits, temperature, top_k, top_p).double()
    want, margin = _transform_reference(logits, temperature, top_k, top_p)
    clear = margin > 1e-6
    assert not bool(((got > 0) & (want == 0))[clear].any())  # nothing dropped comes back
    assert not bool(((got == 0) & (want > 1e-37))[clear].any())  # nothing kept is lost (but below 2^-126)
    if bool(clear.all()):
        assert float((got - want).abs().sum(dim=-1).max()) < 2e-6
    assert torch.allclose(got.sum(dim=-1), torch.ones(rows, dtype=torch.float64), atol=1e-5)


@requires_kernel
@pytest.mark.parametrize(("top_k", "top_p"), [(1, 1.0), (2000, 0.9), (7, 0.6), (0, 0.3)])
def test_kernel_transform_on_a_vocabulary_not_a_multiple_of_8(top_k: int, top_p: float) -> None:
    """The scalar tails (V = 1001): top-k of 1 keeps only the largest, a top-k at or above V is off,
    and the tail tokens are scaled, filtered and normalised like the others."""
    logits = torch.randn(4, 1001, generator=torch.Generator().manual_seed(top_k)) * 2
    logits[:, -1] = logits.max() + 1  # the most probable token in the tail
    got = _kernel_probs(logits, 0.9, top_k, top_p).double()
    want, margin = _transform_reference(logits, 0.9, top_k, top_p)
    assert bool((margin > 1e-6).all())
    assert torch.equal(got > 0, want > 0)
    assert float((got - want).abs().sum(dim=-1).max()) < 2e-6
    if top_k == 1:
        assert torch.equal(got[:, -1], torch.ones(4, dtype=torch.float64))


@requires_kernel
def test_kernel_draws_match_the_torch_draws() -> None:
    """``draw_rows`` draws the token the float64 cdf gives for the same uniform, never one of
    probability 0, and the last possible token for a uniform just below 1."""
    kernel = fast_llama._load_kernel()
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(64, 1001, generator=gen) * 4, dim=-1)
    probs[probs < 1e-4] = 0.0  # holes to skip, some at the ends of blocks of 8
    probs[:, -3:] = 0.0
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    got = kernel.draw_rows(probs, u)
    assert int((got != want).sum()) <= 1  # the block sums may round a hair differently
    assert bool((probs.gather(1, got[:, None]) > 0).all())
    top = kernel.draw_rows(probs, torch.full((64,), 1 - 2**-53, dtype=torch.float64))
    last = torch.stack([row.nonzero().max() for row in probs])
    assert torch.equal(top, last)
    assert torch.equal(
        kernel.draw_rows(probs, torch.zeros(64, dtype=torch.float64)), (probs > 0).int().argmax(1)
    )


@requires_kernel
def test_logits_to_probs_takes_the_kernel_for_float32() -> None:
    """With the kernel loaded, float32 logits go through ``sampling_probs`` (greedy rows still one-hot
    on the argmax), float64 ones through torch; both give the same distribution."""
    kernel = fast_llama._load_kernel()
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(9)) * 3  # [B, T, V]
    params = SamplingTensors.of(
        torch.tensor([0.8, 0.0], dtype=torch.float64),
        torch.tensor([0, 0]),
        torch.tensor([0.9, 1.0], dtype=torch.float64),
    )
    assert sampling_kernel(logits) is kernel and sampling_kernel(logits.double()) is None
    got = logits_to_probs(logits, params)
    assert torch.equal(got[0], _kernel_probs(logits[0], 0.8, 0, 0.9))
    assert torch.equal(got[1], torch.nn.functional.one_hot(logits[1].argmax(-1), V).float())
    torch_path = logits_to_probs(logits.double(), params)
    assert float((torch_path[0] - got[0].double()).abs().sum(-1).max()) < 1e-5
