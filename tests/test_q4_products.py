"""Exact 4-bit blocks against int16 activations, in integers (the kernel's ``q4_linear``).

A prototype of an int4 weight format (session 41): a Q4_1 block is ``d * q + m``; each input row
is quantised to int16 as for int8 weights, each block's ``sum q a`` and ``sum a`` are exact
integers, and each output is one float32 chain over its row's blocks. These tests check the
integer sums against an exact float64 reference, that no output depends on the other rows of a
call, and the layout's edge cases. They run where the build has AVX-512 VNNI.
"""

from __future__ import annotations

import pytest
import torch

from verispec.models import fast_llama
from verispec.models.fast_llama import _q4_blocks

KERNEL = fast_llama._load_kernel()
VNNI = KERNEL is not None and bool(KERNEL.vnni_tiles_ready())
requires_vnni = pytest.mark.skipif(not VNNI, reason="no AVX-512 VNNI in this build")


def _q4_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 ``[n, k]`` matrix made of Q4_1 blocks as GGUF writes them (float16 ``d`` and ``m``,
    every block holding codes 0 and 15, so ``_q4_blocks`` finds them)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    codes[..., 3], codes[..., 17] = 0, 15
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    return (d[..., None] * codes.float() + m[..., None]).reshape(n, k)


def _exact(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[M, N]``: the products the kernel sums, exactly, and the sum of their terms'
    magnitudes (what bounds the float32 chain's rounding). Each row of ``x`` quantised as the
    kernel does (``a = round_half_even(x * (32767 / max |x|))`` in float32, scale ``max |x| / 32767``),
    then ``xs * sum_b (d_b * sum q a + m_b * sum a)`` over the blocks of ``w``'s rows."""
    q, dm = _q4_blocks(w)
    n, nb = q.shape[:2]
    codes = torch.cat([q & 15, q >> 4], dim=-1).long()  # [N, B, 32]: code i in byte i & 15's nibble
    amax = x.abs().amax(dim=1, keepdim=True)  # [M, 1]
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    a = (x * inv).round().long().view(x.shape[0], nb, 32)  # [M, B, 32]
    xs = (amax / 32767.0).double()  # [M, 1]
    s = torch.einsum("mbk,nbk->mnb", a.double(), codes.double())  # [M, N, B], exact integers
    d, mins = dm[None, :, :, 0].double(), dm[None, :, :, 1].double()  # [1, N, B]
    sums = a.sum(-1).double()[:, None, :]  # [M, 1, B]
    total = (s * d + sums * mins).sum(-1)
    size = torch.einsum("mbk,nbk->mnb", a.abs().double(), codes.double()) * d.abs()
    size = (size + a.abs().sum(-1).double()[:, None, :] * mins.abs()).sum(-1)
    return xs * total, xs * size


@requires_vnni
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 96), (64, 576), (96, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 12])
def test_q4_products_are_the_exact_integer_sums(n: int, k: int, m: int) -> None:
    """Against the float64 reference, to float32 rounding of the per-block chain: one wrong code or
    scale would be off by a weight step times an activation. Shapes cover one tile, groups of 4
    tiles with one left over (80 rows), passes of 1-5 input rows and their remainders."""
    w = _q4_matrix(n, k, seed=n + k)
    q, dm = _q4_blocks(w)
    packed = KERNEL.q4_pack(q, dm)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = KERNEL.q4_linear(x, packed, n)
    want, size = _exact(x, w)
    roundings = 2 * (k // 32) + 1  # two fmas per block, the scale
    assert ((y.double() - want).abs() <= roundings * 2.0**-24 * size).all()
    assert float((y.double() - want).abs().max()) < 1e-3 * float(want.abs().max())
    torch.testing.assert_close(y, x @ w.T, rtol=0, atol=2e-4 * float((x @ w.T).abs().max()))
    bias = torch.randn(n)
    with_bias = KERNEL.q4_linear(x, packed, n, bias)  # the scale and the bias in one fma
    torch.testing.assert_close(with_bias, y + bias, rtol=0, atol=4 * 2.0**-24 * float((y + bias).abs().max()))


@requires_vnni
def test_q4_products_do_not_depend_on_the_other_rows_of_a_call() -> None:
    """Each row alone, bitwise the same as among 13 (passes of 5, 5 and 3 rows), and a zero row
    gives zeros."""
    w = _q4_matrix(64, 192, seed=4)
    packed = KERNEL.q4_pack(*_q4_blocks(w))
    x = torch.randn(13, 192, generator=torch.Generator().manual_seed(9))
    x[6] = 0.0
    together = KERNEL.q4_linear(x, packed, 64)
    alone = torch.cat([KERNEL.q4_linear(x[i : i + 1].contiguous(), packed, 64) for i in range(13)])
    assert torch.equal(together, alone)
    assert torch.equal(together[6], torch.zeros(64))


@requires_vnni
def test_q4_products_on_the_default_models_shapes_beat_int8_weights_on_accuracy() -> None:
    """What the format is for: the same int16 activations, the weights exact instead of rounded to
    int8 per row. On a matrix of SmolLM2's MLP shape the error against float32 products is a small
    fraction of the int8 weights' error (measured: 4e-5 against 2-5e-2 of the largest output)."""
    w = _q4_matrix(1536, 576, seed=7)
    packed = KERNEL.q4_pack(*_q4_blocks(w))
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    ref = x @ w.T
    q4_err = (KERNEL.q4_linear(x, packed, 1536) - ref).abs().max()
    codes, scale = fast_llama._quantize_rows(w)
    int8_err = (x @ (codes.float() * scale[:, None]).T - ref).abs().max()
    assert q4_err < int8_err / 20


@requires_vnni
def test_q4_layout_errors_are_clear() -> None:
    w = _q4_matrix(32, 64, seed=1)
    q, dm = _q4_blocks(w)
    packed = KERNEL.q4_pack(q, dm)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        KERNEL.q4_pack(q[:8].contiguous(), dm[:8].contiguous())
    with pytest.raises(RuntimeError, match="q4_pack's output for \\[32, 64\\]"):
        KERNEL.q4_linear(torch.randn(2, 64), packed[:-1].contiguous(), 32)
    with pytest.raises(RuntimeError, match="columns in 32s"):
        KERNEL.q4_linear(torch.randn(2, 48), packed, 32)
    # The layout holds d and m as float16, as GGUF does: a scale that is not one is refused.
    with pytest.raises(RuntimeError, match="is not a float16 value"):
        KERNEL.q4_pack(q, dm + 1e-6)
    q8, d8 = fast_llama._q8_blocks(_q8_matrix(32, 64, seed=2))
    with pytest.raises(RuntimeError, match="is not a float16 value"):
        KERNEL.q8_pack(q8, d8 * (1 + 2.0**-20))


def _q8_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 ``[n, k]`` matrix made of Q8_0 blocks (float16 ``d``, codes -127..127, each block
    reaching 127 or -127 so that ``_q8_blocks`` finds ``d``)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k // 32, 32), generator=gen)
    codes[..., 5] = 127
    d = (torch.rand(n, k // 32, generator=gen) * 1e-3 + 1e-4).half().float()
    return (d[..., None] * codes.float()).reshape(n, k)


@requires_vnni
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 96), (64, 576)])
@pytest.mark.parametrize("m", [1, 2, 5, 7])
def test_q8_products_are_the_integer_sums(n: int, k: int, m: int) -> None:
    """Exact 8-bit blocks (int4's head) the same way: against float64 sums of the same int16
    activations and codes, to float32 rounding (each block's sum may exceed 2^24 and round once)."""
    w = _q8_matrix(n, k, seed=n + k + m)
    q, d = fast_llama._q8_blocks(w)
    packed = KERNEL.q8_pack(q, d)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = KERNEL.q4_linear(x, packed, n, q8=True)
    amax = x.abs().amax(dim=1, keepdim=True)
    a = (x * (torch.tensor(32767.0) / amax)).round().double()  # [M, K]
    xs = (amax / 32767.0).double()
    blocks = torch.einsum("mbk,nbk->mnb", a.view(m, -1, 32), q.double())  # [M, N, B]
    want = xs * (blocks * d.double()[None]).sum(-1)
    magnitudes = torch.einsum("mbk,nbk->mnb", a.abs().view(m, -1, 32), q.abs().double())
    size = xs * (magnitudes * d.double()[None]).sum(-1)
    assert ((y.double() - want).abs() <= (3 * (k // 32) + 1) * 2.0**-24 * size).all()
    alone = torch.cat([KERNEL.q4_linear(x[i : i + 1].contiguous(), packed, n, q8=True) for i in range(m)])
    assert torch.equal(alone, y)


def _blocks8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as the kernel's 8-bit activation blocks (w4a8): per 32 columns ``da = max |x| /
    127`` and ``a = round_half_even(x * (127 / max |x|))`` in float32 (a zero block: 0 and 0), and
    ``sa = da * sum a`` rounded to float32. Returns ``a`` ``[M, B, 32]`` float64, ``da`` and ``sa``
    ``[M, B]`` float32."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1)  # [M, B]
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    a = (blocks * inv[..., None]).round()
    da = torch.where(amax > 0, amax / 127.0, torch.zeros_like(amax))
    return a.double(), da, (da.double() * a.sum(-1).double()).float()


@requires_vnni
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 96), (64, 576), (96, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 9, 17])
def test_q4_products_with_8bit_activations_are_the_integer_sums(n: int, k: int, m: int) -> None:
    """w4a8: 8-bit blocks of activations against 4-bit blocks of weights. Against float64 sums of
    the same codes, to float32 rounding of each output's chain ((d * da) * S, then m * sa, per
    block); passes of 1-8 input rows and their remainders, 1-4 tiles at a time. The products are
    much further from float32's than int4's int16 activations, and each row's outputs do not depend
    on the others of a call."""
    w = _q4_matrix(n, k, seed=n + k + 1)
    q, dm = _q4_blocks(w)
    packed = KERNEL.q4_pack(q, dm)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
    y = KERNEL.q4_linear(x, packed, n, a8=True)
    a, da, sa = _blocks8(x)
    codes = torch.cat([q & 15, q >> 4], dim=-1).double()  # [N, B, 32]
    s = torch.einsum("mbk,nbk->mnb", a, codes)  # [M, N, B], exact integers
    dd = (dm[None, :, :, 0] * da[:, None, :]).double()  # [M, N, B]: d * da, rounded as the kernel does
    mins = dm[None, :, :, 1].double()
    want = (dd * s + mins * sa.double()[:, None, :]).sum(-1)
    size = (
        dd.abs() * torch.einsum("mbk,nbk->mnb", a.abs(), codes) + (mins * sa.double()[:, None, :]).abs()
    ).sum(-1)
    assert ((y.double() - want).abs() <= 2 * (k // 32) * 2.0**-24 * size).all()
    ref = x @ w.T
    a16_err = (KERNEL.q4_linear(x, packed, n) - ref).abs().max()
    assert a16_err * 10 < (y - ref).abs().max() < 2e-2 * ref.abs().max()
    alone = torch.cat([KERNEL.q4_linear(x[i : i + 1].contiguous(), packed, n, a8=True) for i in range(m)])
    assert torch.equal(alone, y)
    bias = torch.randn(n)
    torch.testing.assert_close(KERNEL.q4_linear(x, packed, n, bias, a8=True), y + bias, rtol=0, atol=0)


@requires_vnni
@pytest.mark.parametrize("m", [1, 5, 9])
def test_q8_products_with_8bit_activations_are_the_integer_sums(m: int) -> None:
    """The head's 8-bit blocks against 8-bit activation blocks (offset by 128 and taken back out
    with each block's code sum): the float64 sums to float32 rounding; a zero block adds nothing."""
    n, k = 80, 96
    w = _q8_matrix(n, k, seed=m + 3)
    q, d = fast_llama._q8_blocks(w)
    packed = KERNEL.q8_pack(q, d)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 32:64] = 0.0
    y = KERNEL.q4_linear(x, packed, n, q8=True, a8=True)
    a, da, _ = _blocks8(x)
    s = torch.einsum("mbk,nbk->mnb", a, q.double())  # [M, N, B]
    dd = (d[None] * da[:, None, :]).double()
    want = (dd * s).sum(-1)
    size = (dd.abs() * torch.einsum("mbk,nbk->mnb", a.abs(), q.abs().double())).sum(-1)
    assert ((y.double() - want).abs() <= 2 * (k // 32) * 2.0**-24 * size).all()
    alone = torch.cat(
        [KERNEL.q4_linear(x[i : i + 1].contiguous(), packed, n, q8=True, a8=True) for i in range(m)]
    )
    assert torch.equal(alone, y)
