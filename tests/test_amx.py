"""int8 products on AMX tiles (the kernel's ``linear_amx``): bitwise the VNNI tiles' outputs.

The int16 activations split exactly into a signed high byte and an unsigned low byte, and the
integer sums are exact either way, so turning the tiles on must change no bit of any logit. These
tests run where the CPU and the OS allow AMX (Intel Xeon since Sapphire Rapids) and skip elsewhere,
except the one that checks the clear error a machine without AMX gives.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from transformers import LlamaForCausalLM

from verispec.models import fast_llama, schedule
from verispec.models.fast_llama import FastLlama

KERNEL = fast_llama._load_kernel()
AMX = KERNEL is not None and bool(getattr(KERNEL, "amx_ready", lambda: False)())
requires_kernel = pytest.mark.skipif(KERNEL is None, reason="C++ kernel could not be built here")
requires_amx = pytest.mark.skipif(not AMX, reason="no AMX int8 tiles on this machine or build")


def _llama() -> LlamaForCausalLM:
    """A random Llama whose matrices all fit whole tiles (rows % 16 == 0, columns % 64 == 0)."""
    return tiny_llama(320, seed=3, hidden=64, dtype=torch.float32)


def _same_bits_either_way(model: FastLlama, switch, seed: int) -> None:
    """``switch(on, rows)`` turns a model's tiles on or off and sets from how many rows a call reads
    them; every logit of a prompt and of decoding and verification widths, and every greedy argmax,
    must be the same with the tiles on from 1 row, off, and on from 4 rows (narrower calls on the
    pair tiles, wider on the tiles)."""
    ids = torch.randint(0, 320, (1, 60), generator=torch.Generator().manual_seed(seed))
    outs: list[list[torch.Tensor]] = [[], [], []]
    for (on, rows), out in zip(((True, 1), (False, 1), (True, 4)), outs, strict=True):
        switch(on, rows)
        model.reset(1)
        out.append(model.forward(ids[:, :20]))
        pos = 20
        for t in (1, 2, 5, 9, 17):
            out.append(model.forward(ids[:, pos : pos + t]))
            model.truncate([pos])
            out.append(model.forward(ids[:, pos : pos + t], logits="argmax"))
            pos += t
    for a, b, c in zip(*outs, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def _pairs(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[N, K]`` int8 pair-interleaved as the kernel holds it: ``[N / 2][K / 16][2][16]``."""
    n, k = w.shape
    return w.view(n // 2, 2, k // 16, 16).permute(0, 2, 1, 3).contiguous().view(n, k)


@requires_amx
@pytest.mark.parametrize(("n", "k"), [(48, 64), (960, 576), (64, 1536)])
def test_amx_products_are_bitwise_the_vnni_tiles(n: int, k: int) -> None:
    """``linear(..., amx=True)`` against the VNNI tiles: an odd and an even count of weight tiles,
    1-40 input rows (one pass, several, a last short one), zero rows, bias, both weight layouts."""
    kernel = KERNEL.FastLlamaKernel(64, 4, 2, 16, 128, 1e-5)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) * 0.01
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 5, 9, 16, 17, 40):
        x = torch.randn(m, k, generator=gen) * 3
        x[0] = 0.0  # an all-zero row quantises with scale 0
        x[-1, : k // 2] *= 1e4  # a wide range within one row
        if m >= 5:
            x[1, 7] = float("nan")  # rows with a NaN or an inf quantise to zero too
            x[2, k - 1] = float("inf")
        for b in (None, bias):
            want = KERNEL.FastLlamaKernel.linear(kernel, x, w, b, scale, paired=False)
            got = kernel.linear(x, w, b, scale, paired=False, amx=True)
            assert torch.equal(got, want), (m, b is None)
            assert torch.equal(kernel.linear(x, _pairs(w), b, scale, paired=True, amx=True), want)


@requires_amx
def test_int8_model_on_amx_tiles_gives_the_same_bits() -> None:
    """An int8 FastLlama on this machine holds its matrices also as tiles and multiplies there; with
    the tiles turned off (the same weights, the VNNI tiles) every logit of a prompt and of decoding
    and verification widths, and every greedy argmax, is the same."""
    model = FastLlama.from_hf(_llama(), dtype="int8")
    kernel = model._kernel
    assert kernel is not None and kernel.amx()
    per_layer = (128 + 64 + 256) * 64 + 64 * 128  # wqkv, wo, wgu, wdown: int8, one byte each
    assert kernel.tile_bytes() == 2 * per_layer + 320 * 64  # and the head; not the embedding's rows

    def switch(on: bool, rows: int) -> None:
        kernel.set_amx(on)
        kernel.set_amx_rows(rows)

    _same_bits_either_way(model, switch, seed=8)


@requires_amx
def test_amx_rows_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default only calls wider than any greedy step read the tiles; ``VERISPEC_AMX_ROWS`` sets
    the width; 0 is a clear error."""
    from verispec.config import ConfigError

    assert FastLlama.from_hf(_llama(), dtype="int8").amx_rows == schedule.STEP_WIDTHS + 1
    monkeypatch.setenv("VERISPEC_AMX_ROWS", "3")
    model = FastLlama.from_hf(_llama(), dtype="int8")
    assert model.amx_rows == 3 and model._kernel.amx_rows() == 3
    monkeypatch.setenv("VERISPEC_AMX_ROWS", "0")
    with pytest.raises(ConfigError, match="VERISPEC_AMX_ROWS"):
        schedule.apply_amx(model)


@requires_amx
def test_amx_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``VERISPEC_AMX=0`` keeps int8 on the VNNI tiles, with no second copy of the weights."""
    monkeypatch.setenv("VERISPEC_AMX", "0")
    assert not fast_llama.amx_enabled()
    model = FastLlama.from_hf(_llama(), dtype="int8")
    assert not model._kernel.amx() and model._kernel.tile_bytes() == 0
    monkeypatch.delenv("VERISPEC_AMX")
    on = FastLlama.from_hf(_llama(), dtype="int8")
    assert on.weight_bytes() == model.weight_bytes() + on._kernel.tile_bytes()
    assert on.read_bytes() == model.read_bytes()  # a step reads the tiles instead of the matrices


@requires_kernel
def test_asking_for_amx_without_it_is_a_clear_error() -> None:
    """Where the build or the OS has no AMX, asking for the tiles raises; float weights never take
    them."""
    kernel = KERNEL.FastLlamaKernel(64, 4, 2, 16, 128, 1e-5)
    x, w = torch.randn(2, 64), torch.randn(16, 64)
    with pytest.raises(RuntimeError, match="int8"):
        kernel.linear(x, w, None, None, paired=False, amx=True)
    if not AMX:
        assert not fast_llama.amx_enabled()
        with pytest.raises(RuntimeError, match="no AMX"):
            kernel.set_amx(True)


def test_a_compiler_without_amx_still_builds_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the build with the AMX flags fails, the kernel is built once more without them; a
    failure without them is raised as it was."""
    calls: list[list[str]] = []

    def compile_kernel(flags):
        calls.append(list(flags))
        if "-mamx-int8" in flags:
            raise RuntimeError("unrecognized command-line option '-mamx-int8'")
        return "module", "build"

    monkeypatch.setattr(fast_llama, "compile_kernel", compile_kernel)
    flags = ["-O3", "-mavx2", *fast_llama.AMX_FLAGS]
    assert fast_llama._compile_with_fallback(flags) == ("module", "build")
    assert calls == [flags, ["-O3", "-mavx2"]]

    def broken(flags):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fast_llama, "compile_kernel", broken)
    with pytest.raises(RuntimeError, match="no compiler"):
        fast_llama._compile_with_fallback(["-O3", "-mavx2"])


VNNI_TILES = KERNEL is not None and bool(getattr(KERNEL, "vnni_tiles_ready", lambda: False)())
requires_vnni_tiles = pytest.mark.skipif(not VNNI_TILES, reason="no AVX-512 VNNI in this build")


@requires_vnni_tiles
@pytest.mark.parametrize(("n", "k"), [(48, 64), (80, 576), (960, 576), (32, 1536)])
def test_vnni_tile_products_are_bitwise_the_pair_tiles(n: int, k: int) -> None:
    """``linear(..., vnni_tiles=True)`` (the tiles' layout with ``vpdpbusd``, the high bytes offset
    by 128) against the pair tiles: groups of 3, 2 and 1 tiles (n = 48, 80, 960, 32), 1-40 input
    rows (passes of 4 and a shorter last one), zero, NaN and inf rows, weights down to -128, bias,
    both weight layouts."""
    kernel = KERNEL.FastLlamaKernel(64, 4, 2, 16, 128, 1e-5)
    gen = torch.Generator().manual_seed(n + k + 1)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    w[0] = -128  # the largest magnitude the correction 128 * sum(w) can meet
    scale = torch.rand(n, generator=gen) * 0.01
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 4, 5, 7, 9, 17, 40):
        x = torch.randn(m, k, generator=gen) * 3
        x[0] = 0.0
        x[-1, : k // 2] *= 1e4
        x[-1, 0] = -x[-1].abs().max()  # q = -32767 at a weight of -128
        if m >= 5:
            x[1, 7] = float("nan")
            x[2, k - 1] = float("inf")
        for b in (None, bias):
            want = kernel.linear(x, w, b, scale, paired=False)
            got = kernel.linear(x, w, b, scale, paired=False, vnni_tiles=True)
            assert torch.equal(got, want), (m, b is None)
            assert torch.equal(kernel.linear(x, _pairs(w), b, scale, paired=True, vnni_tiles=True), want)


@requires_vnni_tiles
def test_int8_model_on_vnni_tiles_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has VNNI and no AMX, an int8 FastLlama also holds its layers' matrices as tiles
    (not the head's) and multiplies its wide calls there; with the tiles off (the pair tiles) every
    logit and greedy argmax of a prompt, decoding and verification widths is the same.
    ``VERISPEC_VNNI_TILES=0`` keeps no second copy."""
    if AMX:
        pytest.skip("this machine's int8 tiles run on AMX")
    model = FastLlama.from_hf(_llama(), dtype="int8")
    kernel = model._kernel
    assert kernel is not None and kernel.vnni_tiles() and not kernel.amx()
    assert model.amx_rows == kernel.amx_rows() == schedule.VNNI_ROWS  # prompts, not 10-15-row calls
    per_layer = (128 + 64 + 256) * 64 + 64 * 128  # wqkv, wo, wgu, wdown: int8, one byte each
    rows = 128 + 64 + 256 + 64  # and an int32 sum per weight row
    assert kernel.tile_bytes() == 2 * (per_layer + 4 * rows)

    def switch(on: bool, width: int) -> None:
        kernel.set_vnni_tiles(on)
        kernel.set_amx_rows(width)

    _same_bits_either_way(model, switch, seed=9)
    monkeypatch.setenv("VERISPEC_VNNI_TILES", "0")
    off = FastLlama.from_hf(_llama(), dtype="int8")
    assert not off._kernel.vnni_tiles() and off._kernel.tile_bytes() == 0
    assert model.weight_bytes() == off.weight_bytes() + kernel.tile_bytes()


@requires_kernel
def test_asking_for_vnni_tiles_without_vnni_is_a_clear_error() -> None:
    """Float weights never take the tiles; a build without VNNI refuses them."""
    kernel = KERNEL.FastLlamaKernel(64, 4, 2, 16, 128, 1e-5)
    x, w = torch.randn(2, 64), torch.randn(16, 64)
    with pytest.raises(RuntimeError, match="int8"):
        kernel.linear(x, w, None, None, paired=False, vnni_tiles=True)
    if not VNNI_TILES:
        with pytest.raises(RuntimeError, match="VNNI"):
            kernel.set_vnni_tiles(True)
