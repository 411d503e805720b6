"""Float32 weights read as their exact blocks (GGUF's Q4_1 and Q8_0 layouts).

Every layer matrix of a Q4_1 GGUF model, once transformers dequantises it to float32, is made of
blocks of 32 weights ``d * q + m``, and a Q8_0 embedding (the tied output head) of blocks ``d * q``.
FastLlama finds those blocks at load and its kernel reads them (6 and 9 bits per weight) instead of
the float32 rows for calls of a few tokens; the outputs must stay bitwise the float32 kernel's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM

from verispec.models import schedule
from verispec.models.fast_llama import (
    _LAYER_MATRICES,
    FastLlama,
    _group_blocks,
    _q4_blocks,
    _q8_blocks,
    kernel_available,
)

requires_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")


def _through(w: torch.Tensor, kind: GGMLQuantizationType) -> torch.Tensor:
    """``w`` [N, K] through a GGUF format and back: float32 with its exact block structure."""
    raw = quantize(w.detach().float().numpy(), kind)
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, kind))).reshape(w.shape)


def _q4_1(w: torch.Tensor) -> torch.Tensor:
    return _through(w, GGMLQuantizationType.Q4_1)


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    return _through(w, GGMLQuantizationType.Q8_0)


def _unpack(q: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The float32 matrix that blocks ``q`` [N, K/32, 16], ``dm`` [N, K/32, 2] stand for."""
    codes = torch.cat([q & 15, q >> 4], dim=-1).float()  # [N, K/32, 32]
    w = dm[..., :1] * codes + dm[..., 1:]
    return w.reshape(q.shape[0], -1)


def test_blocks_rebuild_a_q4_1_matrix_bitwise() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 96) * 0.05
    w[1, :32] = 0.25  # a constant block: step 0
    w[2, 32:64] = torch.linspace(-3.0, 1.0, 32)  # a wide block
    exact = _q4_1(w)
    blocks = _q4_blocks(exact)
    assert blocks is not None
    q, dm = blocks
    assert q.dtype == torch.uint8 and q.shape == (6, 3, 16)
    assert dm.dtype == torch.float32 and dm.shape == (6, 3, 2)
    assert torch.equal(_unpack(q, dm), exact)
    # d and m are float16 values, as GGUF stores them
    assert torch.equal(dm.half().float(), dm)


def test_no_blocks_where_a_matrix_has_none() -> None:
    torch.manual_seed(1)
    w = torch.randn(4, 64)
    assert _q4_blocks(w) is None  # plain float32 weights
    exact = _q4_1(w)
    bent = exact.clone()
    bent[3, 40] = torch.nextafter(bent[3, 40], torch.tensor(10.0))  # one weight off by one ulp
    assert _q4_blocks(bent) is None
    assert _q4_blocks(torch.cat([exact, exact[:, :16]], dim=1)) is None  # K not a multiple of 32
    assert _q4_blocks(_q4_1(torch.randn(3, 64))) is None  # odd rows: the kernel reads pairs
    assert _q4_blocks(exact.double()) is None
    signed = torch.zeros(2, 32)
    signed[0, 5] = -0.0  # equal to 0.0, but not the same bits: no block rebuilds it
    assert _q4_blocks(signed) is None and _q8_blocks(signed) is None
    assert _q4_blocks(torch.zeros(2, 32)) is not None and _q8_blocks(torch.zeros(2, 32)) is not None


def test_8bit_blocks_rebuild_a_q8_0_matrix_bitwise() -> None:
    torch.manual_seed(2)
    w = torch.randn(4, 64) * 0.1
    w[0, :32] = 0.0  # an all-zero block: d = 0
    exact = _q8_0(w)
    blocks = _q8_blocks(exact)
    assert blocks is not None
    q, d = blocks
    assert q.dtype == torch.int8 and q.shape == (4, 2, 32) and d.shape == (4, 2)
    assert torch.equal((d[..., None] * q.float()).reshape(4, 64), exact)
    assert _q8_blocks(w) is None
    bent = exact.clone()
    bent[2, 5] = torch.nextafter(bent[2, 5], torch.tensor(10.0))
    assert _q8_blocks(bent) is None


def test_blocks_are_grouped_eight_rows_at_a_time_codes_then_scales() -> None:
    """The kernel's ``Grouped`` layout: for each group of 8 rows (the last may hold fewer) and block,
    the group's codes, then its scales' bytes."""
    n, nb = 12, 3  # one full group and a group of 4
    codes = torch.arange(n * nb * 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, nb, 2)
    scales = torch.arange(n * nb, dtype=torch.float32).view(n, nb) + 0.5
    flat = _group_blocks(codes, scales)
    assert flat.dtype == torch.uint8 and flat.numel() == n * nb * (2 + 4)

    def at(offset: int, rows: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s codes and scale in the group-block starting at ``offset``."""
        block = flat[offset : offset + rows * 6]
        scale = block[2 * rows + 4 * row : 2 * rows + 4 * row + 4]
        return block[2 * row : 2 * row + 2], scale.view(torch.float32)

    for r in range(n):
        g, rows = r // 8, 8 if r < 8 else 4
        for b in range(nb):
            offset = g * 8 * nb * 6 + b * rows * 6
            got_codes, got_scale = at(offset, rows, r % 8)
            assert torch.equal(got_codes, codes[r, b]) and got_scale.item() == scales[r, b].item()


def _q4_llama() -> LlamaForCausalLM:
    """A tiny Llama whose layer matrices all have Q4_1 blocks and whose tied embedding (its head)
    has Q8_0 blocks, as SmolLM2's GGUF (GQA, head_dim 32)."""
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for lin in (*_attn(layer), layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.copy_(_q4_1(lin.weight))
        hf.model.embed_tokens.weight.copy_(_q8_0(hf.model.embed_tokens.weight))
    return hf


def _attn(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


@requires_kernel
@pytest.mark.parametrize("rows", [6, 16])  # 16: every call reads the blocks, in passes of up to 12
def test_kernel_reading_blocks_is_bitwise_the_float32_kernel(
    monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    hf = _q4_llama()
    monkeypatch.setattr(FastLlama, "q4_rows", rows)
    blocks = FastLlama.from_hf(hf, dtype="float32", max_batch_size=2)
    assert all(layer.get(k + "_q4") is not None for layer in blocks._w["layers"] for k in _LAYER_MATRICES)
    assert blocks._w.get("head_q8") is not None and blocks.has_blocks
    monkeypatch.setattr(FastLlama, "q4_weights", False)
    dense = FastLlama.from_hf(hf, dtype="float32", max_batch_size=2)
    assert all(layer.get(k + "_q4") is None for layer in dense._w["layers"] for k in _LAYER_MATRICES)
    assert dense._w.get("head_q8") is None and not dense.has_blocks
    assert blocks.read_bytes() < dense.read_bytes()
    assert blocks.read_bytes(blocks=False) == dense.read_bytes()
    assert blocks.read_bytes(greedy=True) < dense.read_bytes(greedy=True)
    assert blocks.weight_bytes() > dense.weight_bytes()  # the float32 matrices stay for long calls

    ids = torch.randint(0, 300, (2, 90), generator=torch.Generator().manual_seed(4))
    for fast in (blocks, dense):
        fast.reset(2)
    assert torch.equal(blocks.forward(ids[:, :20]), dense.forward(ids[:, :20]))  # a prompt
    pos = 20
    for t in (1, 2, 3, 4, 5, 6, 7, 9, 13):  # decoding and verification widths
        # both rows (2t rows in each matrix product), then row 1 alone (t: odd widths too); the
        # whole head's logits (sampling), then greedy (the head's screen)
        for rows in ([0, 1], [1]):
            for logits in ("all", "argmax"):
                span = ids[rows, pos : pos + t]
                got = blocks.forward(span, rows=rows, logits=logits)
                assert torch.equal(got, dense.forward(span, rows=rows, logits=logits)), (t, rows, logits)
                blocks.truncate([pos, pos])
                dense.truncate([pos, pos])
        for fast in (blocks, dense):
            fast.forward(ids[:, pos : pos + t], logits="none")
        pos += t
    assert pos < ids.shape[1]
    # one row alone, the other untouched
    assert torch.equal(blocks.forward(ids[1:, pos:], rows=[1]), dense.forward(ids[1:, pos:], rows=[1]))
    # and the logits still are the model's
    got = blocks.forward(ids[:1, pos:], rows=[0])
    torch.testing.assert_close(got, _reference_tail(hf, ids[:1], pos), rtol=1e-4, atol=2e-5)


def _reference_tail(hf: torch.nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits[:, start:]


@requires_kernel
def test_int8_and_torch_path_take_no_blocks() -> None:
    hf = _q4_llama()
    for fast in (
        FastLlama.from_hf(hf, dtype="int8"),
        FastLlama.from_hf(hf, dtype="float32", use_kernel=False),
    ):
        assert all(layer.get(k + "_q4") is None for layer in fast._w["layers"] for k in _LAYER_MATRICES)


@requires_kernel
def test_timing_the_blocks_leaves_the_model_as_it_was() -> None:
    """``schedule.measure_blocks`` (run once per machine on models of real size) times calls with
    and without the blocks, then hands the model back empty, with its own limits."""
    model = FastLlama.from_hf(_q4_llama(), dtype="float32", max_batch_size=2)
    times = schedule.measure_blocks(model, widths=(2, 5), rounds=1, context=16)
    assert set(times) == {"blocks", "rows"} and all(len(times[p][t]) == 1 for p in times for t in (2, 5))
    assert model._batch == 2 and model.lengths.tolist() == [0, 0]
    assert 1 <= schedule.blocks_crossing(times) <= 5
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(5))
    fresh = FastLlama.from_hf(_q4_llama(), dtype="float32")
    assert torch.equal(model.forward(ids, rows=[0]), fresh.forward(ids))


class _KernelSpy:
    """A kernel object that records the limits it is given and passes everything on."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.block_rows: list[tuple[int, int]] = []

    def set_block_rows(self, layers: int, head: int) -> None:
        self.block_rows.append((layers, head))
        self.kernel.set_block_rows(layers, head)

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernel, name)


@requires_kernel
def test_timing_the_schedules_times_greedy_steps_that_read_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``schedule.measure`` times the steps greedy decoding makes, as they run: the greedy call, with
    the model's blocks still read (the schedules differ there in the head screen's int8 pass), and
    hands the model back empty, on the default schedule."""
    model = FastLlama.from_hf(_q4_llama(), dtype="float32", max_batch_size=2)
    spy = _KernelSpy(model._kernel)
    model._kernel = spy
    steps: list[int] = []
    greedy = model.forward_greedy

    def counted(lines: list[list[int]], rows: list[int]) -> list[list[int]]:
        steps.append(len(lines[0]))
        return greedy(lines, rows)

    monkeypatch.setattr(model, "forward_greedy", counted)
    times = schedule.measure(model, rounds=2, context=16)
    assert set(times) == set(schedule.SCHEDULES) and all(len(v) == 2 for v in times.values())
    assert sorted(steps) == [1] * 6 + [5] * 6  # 3 rounds (one warm-up) x 2 schedules, 1 and 5 tokens
    assert spy.block_rows == []  # the blocks were never turned off
    assert tuple(spy.get_schedule()) == schedule.SCHEDULES[schedule.DEFAULT]
    assert model._batch == 2 and model.lengths.tolist() == [0, 0]


@pytest.mark.slow
@requires_kernel
def test_a_build_without_avx512_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX-512 CPU the tests above run the 512-bit tiles (the blocks', int8's). A CPU without
    AVX-512 runs the 256-bit ones, which must give the same logits: a second build of the kernel
    without the AVX-512 flags (about a minute, once per machine), the same model and calls."""
    from verispec.models import fast_llama

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this CPU already runs the 256-bit tiles in the tests above")
    wide = fast_llama._load_kernel()
    narrow, _ = fast_llama.compile_kernel(fast_llama.KERNEL_BASE_FLAGS)
    hf = _q4_llama()
    monkeypatch.setattr(FastLlama, "q4_rows", 16)
    monkeypatch.setattr(FastLlama, "head_q8_rows", 16)
    ids = torch.randint(0, 300, (1, 60), generator=torch.Generator().manual_seed(6))
    for dtype in ("float32", "int8"):
        models = []
        for module in (wide, narrow):
            monkeypatch.setattr(fast_llama, "_kernel_module", module)
            models.append(FastLlama.from_hf(hf, dtype=dtype))
        monkeypatch.setattr(fast_llama, "_kernel_module", wide)
        assert models[0]._kernel is not None and models[1]._kernel is not None
        assert type(models[0]._kernel) is not type(models[1]._kernel)  # two builds
        outs = [[m.forward(ids[:, :20])] for m in models]  # a prompt
        pos = 20
        for t in (1, 2, 5, 9, 13):  # decoding and verification widths
            for m, out in zip(models, outs, strict=True):
                out.append(m.forward(ids[:, pos : pos + t]))
                m.truncate([pos])
                out.append(m.forward(ids[:, pos : pos + t], logits="argmax"))
            pos += t
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), dtype
