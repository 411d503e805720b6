"""FastLlama against the Hugging Face reference on tiny random models.

Both paths are tested: the C++ kernel (skipped cleanly when it cannot be compiled) and the torch
fallback. Sizes are chosen to hit the awkward cases: GQA (4 query heads on 2 KV heads), an
intermediate size that is not a multiple of 8 (the kernel's scalar tails), calls that mix rows of
different lengths.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from conftest import check_tree_forward
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from verispec.models.base import KVModel
from verispec.models.fast_llama import (
    FastLlama,
    _linear,
    _pairs_ok,
    _plain_rows,
    _quantize_rows,
    kernel_available,
    prune_kernel_builds,
)

HAVE_KERNEL = kernel_available()
requires_kernel = pytest.mark.skipif(not HAVE_KERNEL, reason="C++ kernel could not be built here")
PATHS = [pytest.param(True, id="kernel", marks=requires_kernel), pytest.param(False, id="torch")]

VOCAB = 300
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=100,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _llama(**extra: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SIZES, "tie_word_embeddings": True, **extra})).eval()


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    return Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=False)).eval()


def _mistral(**extra: object) -> MistralForCausalLM:
    torch.manual_seed(2)
    return MistralForCausalLM(MistralConfig(**{**SIZES, "sliding_window": 64, **extra})).eval()


def _llama3_rope() -> LlamaForCausalLM:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return _llama(rope_parameters=rope)


def _gqa3_head64() -> MistralForCausalLM:
    """SmolLM2's attention shape: head_dim 64 and 3 query heads per key-value head, which the
    kernel scores three queries at a time."""
    return _mistral(head_dim=64, num_attention_heads=6)


MODELS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "mistral": _mistral,
    "llama3-rope": _llama3_rope,
    "gqa3-head64": _gqa3_head64,
}


def _reference(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """HF logits ``[n, T, V]`` for full sequences ``ids`` ``[n, T]``."""
    with torch.no_grad():
        return hf(ids).logits


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("arch", list(MODELS))
def test_prefill_then_decode_matches_hf(arch: str, use_kernel: bool) -> None:
    hf = MODELS[arch]()
    ids = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(3))
    want = _reference(hf, ids)
    fast = FastLlama.from_hf(hf, use_kernel=use_kernel)
    assert fast.uses_kernel == use_kernel
    assert isinstance(fast, KVModel)
    # 20 tokens goes through the long-prefill (torch) path, 12 through the kernel when present.
    pieces, pos = [], 0
    for t in (20, 12, 1, 3, 5, 1, 5, 3, 1, 9):
        pieces.append(fast.forward(ids[:, pos : pos + t]))
        pos += t
    assert fast.lengths.tolist() == [pos]
    _close(torch.cat(pieces, dim=1), want[:, :pos])


@pytest.mark.parametrize("use_kernel", PATHS)
def test_chunked_prefill_matches_hf(use_kernel: bool) -> None:
    hf = _llama()
    ids = torch.randint(0, VOCAB, (1, 70), generator=torch.Generator().manual_seed(4))
    fast = FastLlama.from_hf(hf, use_kernel=use_kernel)
    fast.prefill_chunk = 32  # 70 tokens = 3 chunks
    _close(fast.forward(ids), _reference(hf, ids))
    fast.reset(1)
    _close(fast.forward(ids, logits="last"), _reference(hf, ids)[:, -1])


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("pair", [True, False])
def test_long_prefill_last_logits_match_hf(use_kernel: bool, pair: bool) -> None:
    """A prompt on the torch path with only its last logits wanted: with the kernel, its head
    product runs there (on the paired head, not a row-major copy of it); the logits are HF's."""
    hf = _llama()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(13))
    with patch.object(FastLlama, "pair_weights", pair):
        fast = FastLlama.from_hf(hf, max_batch_size=2, use_kernel=use_kernel)
    fast.kernel_prefill_max = {"float32": 16}  # 40 tokens take the torch path
    _close(fast.forward(ids, logits="last"), _reference(hf, ids)[:, -1])
    _close(fast.forward(ids[:, :1], logits="last"), _reference(hf, torch.cat([ids, ids[:, :1]], 1))[:, -1])


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_short_prefill_in_kernel_pieces_is_bitwise_the_kernel_one_token_at_a_time(dtype: str) -> None:
    """A prompt the kernel takes in pieces of ``kernel_prefill_piece`` tokens gives bitwise the
    logits of feeding it one token at a time."""
    hf = _llama()
    T = 70
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(5))
    fast = FastLlama.from_hf(hf, max_batch_size=2, dtype=dtype, use_kernel=True)
    fast.kernel_prefill_piece = 48  # two pieces of different widths, both wider than a step
    assert fast.kernel_max_tokens < fast.kernel_prefill_piece < T <= fast.kernel_prefill_max[dtype]
    widths: list[int] = []
    kernel_forward = fast._forward_kernel

    def spy(ids: torch.Tensor, *args: object) -> torch.Tensor | None:
        widths.append(ids.shape[1])
        return kernel_forward(ids, *args)

    fast._forward_kernel = spy  # type: ignore[method-assign]
    fast.record_hidden = True
    pieces = fast.forward(ids)
    assert widths == [fast.kernel_prefill_piece, T - fast.kernel_prefill_piece]
    hidden = fast.last_hidden
    assert hidden.shape == (2, T, 64)
    fast.reset(2)
    steps = torch.cat([fast.forward(ids[:, t : t + 1]) for t in range(T)], dim=1)
    assert torch.equal(pieces, steps)
    fast.reset(2)
    last = fast.forward(ids, logits="last")
    assert torch.equal(last, pieces[:, -1])
    if dtype == "float32":
        _close(pieces, _reference(hf, ids))


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_attention_in_wide_items_is_bitwise_one_token_at_a_time(dtype: str, threads: int) -> None:
    """A long call's attention takes its queries in wide items (on AVX-512 CPUs the keys and values
    of each block widened once for groups of up to six queries); a 155-token prompt of SmolLM2's
    attention shape in one call gives bitwise the logits of feeding it one token at a time (items
    of 93 queries: whole groups and a group of three; causal ends inside every 8-key group; a float32
    cache read in place, a float16 one widened)."""
    hf = _mistral(head_dim=64, num_attention_heads=6, max_position_embeddings=256, sliding_window=256)
    T = 155
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(21))
    fast = FastLlama.from_hf(hf, max_batch_size=2, dtype=dtype, use_kernel=True)
    fast.kernel_prefill_max = {dtype: 1024}
    fast.kernel_prefill_piece = 256  # the whole prompt in one call
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = fast.forward(ids)
        fast.reset(2)
        steps = torch.cat([fast.forward(ids[:, t : t + 1]) for t in range(T)], dim=1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, steps)
    if dtype == "float32":
        _close(whole, _reference(hf, ids))


@pytest.mark.parametrize("use_kernel", PATHS)
def test_truncate_then_refeed_gives_fresh_logits(use_kernel: bool) -> None:
    hf = _llama()
    gen = torch.Generator().manual_seed(5)
    prompt, drafts, other = (torch.randint(0, VOCAB, (1, t), generator=gen) for t in (10, 5, 4))
    fast = FastLlama.from_hf(hf, use_kernel=use_kernel)
    fast.forward(prompt, logits="none")
    first = fast.forward(drafts)
    # A rejected draft: roll back, write something else over the same positions, roll back again.
    fast.truncate(torch.tensor([10]))
    assert fast.lengths.tolist() == [10]
    fast.forward(other, logits="none")
    fast.truncate(torch.tensor([10]))
    again = fast.forward(drafts)
    if use_kernel:
        assert torch.equal(first, again)
    _close(again, _reference(hf, torch.cat([prompt, drafts], 1))[:, 10:])
    with pytest.raises(ValueError):
        fast.truncate(torch.tensor([16]))  # can only shorten


@pytest.mark.parametrize("use_kernel", PATHS)
def test_ragged_rows_and_row_subsets(use_kernel: bool) -> None:
    hf = _qwen2()
    gen = torch.Generator().manual_seed(6)
    seq = torch.randint(0, VOCAB, (2, 30), generator=gen)
    want = _reference(hf, seq)
    fast = FastLlama.from_hf(hf, max_batch_size=2, use_kernel=use_kernel)
    fast.forward(seq[1:, :12], rows=[1], logits="none")
    _close(fast.forward(seq[:1, :7], rows=[0]), want[:1, :7])
    assert fast.lengths.tolist() == [7, 12]
    # Only row 1 advances; row 0's cache is untouched.
    _close(fast.forward(seq[1:, 12:15], rows=[1]), want[1:, 12:15])
    assert fast.lengths.tolist() == [7, 15]
    # Both rows in one call, each at its own positions (7.. and 15..), rows listed out of order.
    both = fast.forward(torch.stack([seq[1, 15:18], seq[0, 7:10]]), rows=[1, 0])
    _close(both[0], want[1, 15:18])
    _close(both[1], want[0, 7:10])
    last = fast.forward(torch.stack([seq[0, 10:12], seq[1, 18:20]]), logits="last")
    _close(last, torch.stack([want[0, 11], want[1, 19]]))
    with pytest.raises(ValueError):
        fast.forward(seq[:1, :1], rows=[2])


@pytest.mark.parametrize("use_kernel", PATHS)
def test_logits_last_and_none(use_kernel: bool) -> None:
    hf = _llama()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    fast = FastLlama.from_hf(hf, max_batch_size=2, use_kernel=use_kernel)
    every = fast.forward(ids)
    assert every.shape == (2, 6, VOCAB)
    fast.reset(2)
    last = fast.forward(ids, logits="last")
    assert last.shape == (2, VOCAB)
    if use_kernel:
        assert torch.equal(last, every[:, -1])
    _close(last, every[:, -1])
    fast.reset(2)
    assert fast.forward(ids, logits="none") is None
    assert fast.lengths.tolist() == [6, 6]


@pytest.mark.parametrize("use_kernel", PATHS)
def test_record_hidden_gives_hf_last_hidden_states(use_kernel: bool) -> None:
    hf = _llama()
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(8))
    fast = FastLlama.from_hf(hf, max_batch_size=2, use_kernel=use_kernel)
    fast.forward(ids[:, :20], logits="none")
    assert fast.last_hidden is None  # off by default
    fast.record_hidden = True
    fast.truncate(torch.tensor([0, 0]))
    fast.forward(ids[:, :20], logits="none")  # prefill (torch path)
    first = fast.last_hidden
    fast.forward(ids[:, 20:23], logits="last")  # short call (kernel when available)
    second = fast.last_hidden
    assert first.shape == (2, 20, 64) and second.shape == (2, 3, 64)
    fast.forward(ids[1:, 23:24], rows=[1], logits="none")  # row 0 keeps its last record
    assert fast.hidden_by_row[0][0] == 20 and torch.equal(fast.hidden_by_row[0][1], second[0])
    assert fast.hidden_by_row[1][0] == 23 and fast.hidden_by_row[1][1].shape == (1, 64)
    with torch.no_grad():
        want = hf(ids[:, :23], output_hidden_states=True).hidden_states[-1]  # after the final norm
    got = hf.model.norm(torch.cat([first, second], dim=1))
    _close(got, want)


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("shape", ["small", "wide", "head64"])
def test_kernel_logits_are_bitwise_independent_of_tokens_per_call(dtype: str, shape: str) -> None:
    """Plain greedy (T=1 steps) and verification (T=5 steps) must see identical logits.

    "wide": head_dim 76 (a 64-column block, an 8-column block and a scalar tail in every attention
    sum) after a context of 150 (several 64-key blocks, keys scored 8, 4 and 1 at a time).
    "head64": SmolLM2's head_dim 64 and 3 query heads per key-value head, which AVX-512 CPUs score
    and sum over in groups of queries (every group size, and keys left over beyond a group's
    common range)."""
    long = {"max_position_embeddings": 256, "sliding_window": 256}
    hf = {
        "small": lambda: _mistral(),
        "wide": lambda: _mistral(head_dim=76, **long),
        "head64": lambda: _mistral(head_dim=64, num_attention_heads=6, **long),
    }[shape]()
    start = 5 if shape == "small" else 150
    ids = torch.randint(0, VOCAB, (2, start + 20), generator=torch.Generator().manual_seed(8))
    fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2, use_kernel=True)
    fast.forward(ids[:, :start], logits="none")
    one_at_a_time = torch.cat([fast.forward(ids[:, t : t + 1]) for t in range(start, start + 20)], dim=1)
    if dtype == "float32":  # the arithmetic reordered for speed is still attention
        _close(one_at_a_time, _reference(hf, ids)[:, start:])
    for steps in ((5, 5, 5, 5), (3, 1, 16), (2, 7, 11)):
        fast.reset(2)
        fast.forward(ids[:, :start], logits="none")
        pieces, pos = [], start
        for t in steps:
            pieces.append(fast.forward(ids[:, pos : pos + t]))
            pos += t
        assert torch.equal(torch.cat(pieces, dim=1), one_at_a_time), steps
    # Nor does it depend on which other rows share the call.
    fast.reset(2)
    fast.forward(ids[:, :start], logits="none")
    alone = torch.cat(
        [fast.forward(ids[1:, t : t + 4], rows=[1]) for t in range(start, start + 20, 4)], dim=1
    )
    assert torch.equal(alone, one_at_a_time[1:])


@requires_kernel
def test_forced_fallback_by_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _llama()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(9))
    monkeypatch.setenv("VERISPEC_NO_KERNEL", "1")
    fallback = FastLlama.from_hf(hf)
    monkeypatch.delenv("VERISPEC_NO_KERNEL")
    kernel = FastLlama.from_hf(hf)
    assert not fallback.uses_kernel and kernel.uses_kernel
    _close(fallback.forward(ids), kernel.forward(ids))


@pytest.mark.parametrize("use_kernel", PATHS)
def test_bfloat16_weights_match_a_bf16_rounded_reference(
    use_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VERISPEC_KV_CACHE", "float32")  # the weights' arithmetic alone
    hf = _qwen2()
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(10))
    fast = FastLlama.from_hf(hf, dtype="bfloat16", use_kernel=use_kernel)
    got = torch.cat([fast.forward(ids[:, :8]), fast.forward(ids[:, 8:])], dim=1)
    # The kernel keeps norms and biases in float32, so round only the matrices.
    rounded = _qwen2()
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.bfloat16().float())
    _close(got, _reference(rounded, ids))


@requires_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_float16_cache_for_int8_and_bfloat16_on_the_kernel(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 and bfloat16 formats cache keys and values in float16 on the kernel (half the bytes);
    the kernel and the torch path store the same rounded values and read them alike, whichever path
    wrote them; float32 weights and the torch path keep a float32 cache; the override is checked."""
    monkeypatch.delenv("VERISPEC_KV_CACHE", raising=False)
    hf = _mistral(head_dim=64, num_attention_heads=6, max_position_embeddings=256, sliding_window=256)
    ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(13))
    assert FastLlama.from_hf(hf, use_kernel=True).kv_dtype == torch.float32
    assert FastLlama.from_hf(hf, dtype=dtype, use_kernel=False).kv_dtype == torch.float32
    fast = FastLlama.from_hf(hf, dtype=dtype, use_kernel=True)
    assert fast.kv_dtype == torch.float16
    fast.kernel_prefill_max = {dtype: 8}  # the prompt on the torch path, then the kernel
    fast.prefill_compute = None  # float32 products: only the cache's dtype differs below
    fast.reset(1)
    got = torch.cat(
        [fast.forward(ids[:, :100]), fast.forward(ids[:, 100:105]), fast.forward(ids[:, 105:])], 1
    )
    assert fast.k_cache[0].dtype == torch.float16
    monkeypatch.setenv("VERISPEC_KV_CACHE", "float16")
    torch_path = FastLlama.from_hf(hf, dtype=dtype, use_kernel=False)
    assert torch_path.kv_dtype == torch.float16
    torch_path.prefill_compute = None
    torch_path.reset(1)
    want = torch.cat([torch_path.forward(ids[:, :100]), torch_path.forward(ids[:, 100:])], 1)
    _close(got, want)
    monkeypatch.setenv("VERISPEC_KV_CACHE", "float32")
    wide = FastLlama.from_hf(hf, dtype=dtype, use_kernel=True)
    wide.kernel_prefill_max = {dtype: 8}
    wide.prefill_compute = None
    wide.reset(1)
    exact = torch.cat([wide.forward(ids[:, :100]), wide.forward(ids[:, 100:])], 1)
    assert wide.cache_bytes() == 2 * fast.cache_bytes()
    # float16 keys and values move the logits, by little.
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, exact, rtol=0, atol=5e-4)
    monkeypatch.setenv("VERISPEC_KV_CACHE", "bf16")
    with pytest.raises(ValueError, match="VERISPEC_KV_CACHE"):
        FastLlama.from_hf(hf, dtype=dtype)


def _matrices(hf: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weight matrices (a tied embedding/head once); norms and biases are 1-D."""
    return [p for p in hf.parameters() if p.dim() == 2]


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_weights_match_a_dequantised_reference(
    arch: str, use_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 computes the model whose matrices are ``q * scale``; tied (llama) and biased (qwen2)."""
    monkeypatch.setenv("VERISPEC_KV_CACHE", "float32")  # the weights' arithmetic alone
    hf = MODELS[arch]()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(11))
    fast = FastLlama.from_hf(hf, dtype="int8", use_kernel=use_kernel)
    # 20 tokens on the torch path, then short calls (kernel when present).
    got = torch.cat([fast.forward(ids[:, :20]), fast.forward(ids[:, 20:32]), fast.forward(ids[:, 32:])], 1)
    dequantised = MODELS[arch]()
    with torch.no_grad():
        for p in _matrices(dequantised):
            q, scale = _quantize_rows(p.float())
            assert q.dtype == torch.int8 and int(q.abs().max()) == 127
            p.copy_(q.float() * scale[:, None])
    _close(got, _reference(dequantised, ids))
    # The quantisation is not a no-op: the float32 model's logits differ.
    assert not torch.allclose(got, _reference(hf, ids), rtol=1e-4, atol=2e-5)
    # One byte per matrix element plus a float32 scale per row; everything else as in float32; and
    # on a CPU with AMX, the kernel's tile copies of the matrices that fit whole tiles.
    mats = _matrices(hf)
    elements, rows = sum(p.numel() for p in mats), sum(p.shape[0] for p in mats)
    float32 = FastLlama.from_hf(hf, use_kernel=False).weight_bytes()
    tiles = fast._kernel.tile_bytes() if fast._kernel is not None else 0
    assert fast.weight_bytes() == float32 - 4 * elements + elements + 4 * rows + tiles


def test_int8_quantisation_round_trip() -> None:
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(12))
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, scale = _quantize_rows(w)
    assert q.shape == w.shape and scale.shape == (6,) and scale[3] == 0 and not q[3].any()
    # Round to nearest: every weight within half a step of its row.
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all())
    with pytest.raises(ValueError):
        FastLlama.from_hf(_llama(), dtype="int4")


def test_supports_and_limits() -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert not FastLlama.supports(gpt2)
    assert not FastLlama.supports(
        _llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    )
    assert FastLlama.supports(_llama())
    fast = FastLlama.from_hf(_llama(), max_length=16)
    assert fast.max_length == 16 and fast.vocab_size == VOCAB
    assert FastLlama.from_hf(_mistral()).max_length == 64  # capped at the sliding window
    fast.forward(torch.zeros(1, 10, dtype=torch.int64), logits="none")
    with pytest.raises(ValueError):
        fast.forward(torch.zeros(1, 7, dtype=torch.int64))
    fast.reset(3)  # grows the caches
    assert fast.lengths.tolist() == [0, 0, 0]
    assert fast.forward(torch.zeros(3, 2, dtype=torch.int64)).shape == (3, 2, VOCAB)
    for bad in ([3], [-1], [0, 3], [1, 1]):  # out of range (one row or several), duplicates
        with pytest.raises(ValueError):
            fast.forward(torch.zeros(len(bad), 1, dtype=torch.int64), rows=bad)
    assert fast.lengths.tolist() == [2, 2, 2]
    fast.truncate(torch.tensor([1]), rows=[2])
    assert fast.lengths.tolist() == [2, 2, 1]


@pytest.mark.slow
def test_int8_default_model_keeps_top1_of_float32(default_model) -> None:
    """On real text the int8 model's argmax is float32's at >= 94% of positions (506/529)."""
    from verispec.models.loading import wrap
    from verispec.tokenizers import encode_prompt

    questions = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
    if not questions.is_file():
        pytest.skip("Spec-Bench file not present")
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    texts = [r["turns"][0] for r in rows[::20][:8]]
    int8 = wrap(default_model.hf_model, default_model.tokenizer, dtype="int8")
    same = total = 0
    for text in texts:
        ids = torch.as_tensor(encode_prompt(default_model.tokenizer, text, chat=True))[None, :160]
        default_model.reset(1)
        int8.reset(1)
        want, got = default_model.forward(ids)[0], int8.forward(ids)[0]  # [T, V]
        same += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += ids.shape[1]
    assert total > 500 and same / total >= 0.94, f"{same}/{total} positions agree"


@pytest.mark.slow
def test_the_default_model_prices_drafts_from_a_curve_measured_on_this_machine(default_model) -> None:
    """A fresh process starts from the step costs measured once on this machine, not from 5% a token."""
    from verispec.costs import costs_for
    from verispec.models.schedule import STEP_WIDTHS

    if getattr(default_model, "_kernel", None) is None:
        pytest.skip("the C++ kernel is not built here")
    curve = default_model.step_cost_prior
    assert curve is not None and len(curve) == STEP_WIDTHS and curve[0] == 1.0
    assert all(v >= 1.0 for v in curve) and curve[-1] > curve[0]
    assert costs_for(default_model).prior == curve


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_long_prefill_in_bfloat16_products_stays_close_and_decode_is_untouched(
    dtype: str, use_kernel: bool
) -> None:
    """bfloat16 and int8 formats may run long prefills' matrix products in bfloat16: close to the
    float32 products, not equal (so they really ran), and calls up to ``kernel_prefill_max`` tokens
    keep float32 products (bitwise the same as with the option off)."""
    hf = _qwen2()
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(12))
    runs = {}
    for compute in (None, torch.bfloat16):
        fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2, use_kernel=use_kernel)
        fast.kernel_prefill_max = {dtype: 16}  # 40 tokens count as a long prefill here
        fast.prefill_compute = compute
        prefill = fast.forward(ids[:, :40])
        decode = torch.cat([fast.forward(ids[:, t : t + 4]) for t in range(40, 48, 4)], dim=1)
        short = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2, use_kernel=use_kernel)
        short.prefill_compute = compute
        runs[compute] = (prefill, decode, short.forward(ids[:, :16]))
    (p32, d32, s32), (p16, d16, s16) = runs[None], runs[torch.bfloat16]
    assert not torch.equal(p16, p32)
    torch.testing.assert_close(p16, p32, rtol=0.05, atol=0.02)
    torch.testing.assert_close(d16, d32, rtol=0.05, atol=0.02)  # decoding after either prefill
    assert torch.equal(s16, s32)  # a short call is not a long prefill


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_long_prefill_attention_runs_in_the_products_dtype(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``prefill_compute`` set, a long prefill's attention takes bfloat16 inputs; without it,
    float32. Either way the model's outputs are float32."""
    seen: list[torch.dtype] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(q.dtype)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    for compute in (None, torch.bfloat16):
        fast = FastLlama.from_hf(_qwen2(), dtype=dtype, use_kernel=False)
        fast.kernel_prefill_max = {dtype: 16}
        fast.prefill_compute = compute
        seen.clear()
        assert fast.forward(ids).dtype == torch.float32
        assert seen and set(seen) == {compute or torch.float32}


def test_linear_takes_inputs_already_in_the_compute_dtype() -> None:
    """``_linear`` of a bfloat16 input (attention's output in a bfloat16 prefill) is float32 and
    equals the product of the widened weights, then the scale, then the bias."""
    gen = torch.Generator().manual_seed(4)
    q, scale = _quantize_rows(torch.randn(24, 32, generator=gen))
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    bias = torch.randn(24, generator=gen)
    got = _linear(x, q, bias, scale, torch.bfloat16)
    want = torch.nn.functional.linear(x, q.to(torch.bfloat16)).float() * scale + bias
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    plain = _linear(x, q.to(torch.bfloat16), compute=torch.bfloat16)  # bfloat16 weights, no scale
    assert plain.dtype == torch.float32
    assert torch.equal(plain, torch.nn.functional.linear(x, q.to(torch.bfloat16)).float())


def test_float32_weights_keep_float32_prefill() -> None:
    """float32 stays exact w.r.t. the HF model: its prefills never round to bfloat16."""
    assert FastLlama.from_hf(_llama()).prefill_compute is None


def _swiglu_reference(gu: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``silu(g) * u`` of ``gu`` ``[M, 2I]`` times ``scale``, in float64: ``[M, I]``."""
    y = gu.double() * (1.0 if scale is None else scale.double())
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@requires_kernel
@pytest.mark.parametrize("width", [16, 100])  # 100: the scalar tail of I % 8 columns
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_swiglu_is_the_activation_in_one_pass(width: int, scaled: bool) -> None:
    """The kernel's ``swiglu`` of ``[M, 2I]`` products: ``silu(gate * s) * (up * s)`` in float32,
    within float32 rounding of the exact value, and in bfloat16 that value rounded as torch rounds
    (at most one bfloat16 step off, where exp's last bits moved it across a rounding boundary)."""
    from verispec.models.fast_llama import _load_kernel

    kernel = _load_kernel()
    gen = torch.Generator().manual_seed(width)
    gu = torch.randn(37, 2 * width, generator=gen) * 4
    scale = torch.rand(2 * width, generator=gen) + 0.5 if scaled else None
    exact = _swiglu_reference(gu, scale)
    got32 = kernel.swiglu(gu, scale)
    assert got32.dtype == torch.float32 and got32.shape == (37, width)
    torch.testing.assert_close(got32.double(), exact, rtol=2e-6, atol=1e-6)
    gu16 = gu.to(torch.bfloat16)
    got16 = kernel.swiglu(gu16, scale)
    want16 = _swiglu_reference(gu16, scale).float().to(torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    steps = (got16.view(torch.int16).int() - want16.view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.01


@requires_kernel
def test_kernel_swiglu_rounds_to_bfloat16_as_torch_does() -> None:
    """Where silu(g) is g itself in float32 (g >= 100: exp(-g) vanishes beside 1), the output is
    the float32 product g * u, exact for bfloat16 inputs: its rounding to bfloat16 must be torch's
    bit for bit (to nearest, ties to even, which random 16-bit products hit), and NaN stays NaN."""
    from verispec.models.fast_llama import _load_kernel

    kernel = _load_kernel()
    gen = torch.Generator().manual_seed(5)
    gate = (torch.rand(64, 40, generator=gen) * 1000 + 100).to(torch.bfloat16)
    up = torch.randn(64, 40, generator=gen).to(torch.bfloat16)
    got = kernel.swiglu(torch.cat([gate, up], dim=1))
    want = (gate.float() * up.float()).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    nan = torch.tensor([[float("nan")] * 8 + [1.0] * 8], dtype=torch.bfloat16)
    assert bool(kernel.swiglu(nan).isnan().all())


@requires_kernel
@pytest.mark.parametrize("hidden", [64, 100])  # 100: the scalar tail of H % 8 columns
def test_kernel_rmsnorm_bf16_is_the_norm_rounded_once(hidden: int) -> None:
    """The kernel's ``rmsnorm_bf16``: HF's RMSNorm in float32, rounded to bfloat16 as torch rounds
    (at most one bfloat16 step from the eager norm's rounding, where the sums' order moved a value
    across a rounding boundary), never a second rounding."""
    from verispec.models.fast_llama import _load_kernel, _rms_norm

    kernel = _load_kernel()
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(53, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    got = kernel.rmsnorm_bf16(x, weight, 1e-5)
    want = _rms_norm(x, weight, 1e-5).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.01


@requires_kernel
@pytest.mark.parametrize("hidden", [64, 100])
def test_kernel_rmsnorm_f32_is_the_norm(hidden: int) -> None:
    """The kernel's ``rmsnorm_f32``: HF's RMSNorm in float32 in one pass, within float32 rounding of
    the eager norm (the sum of squares is taken in another order)."""
    from verispec.models.fast_llama import _load_kernel, _rms_norm

    kernel = _load_kernel()
    gen = torch.Generator().manual_seed(hidden + 1)
    x = torch.randn(53, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    got = kernel.rmsnorm_f32(x, weight, 1e-5)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, _rms_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)


@requires_kernel
@pytest.mark.parametrize("rows", [1, 130, 700])
def test_kernel_linear_rows_is_the_product_split_by_rows(rows: int) -> None:
    """The kernel's ``linear_rows``: ``x @ w.T`` with x's rows split over the threads, each block its
    own product; float32 within float32 rounding, bfloat16 within one rounding of the output."""
    from verispec.models.fast_llama import _load_kernel

    kernel = _load_kernel()
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(40, 96, generator=gen)
    torch.testing.assert_close(kernel.linear_rows(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    got = kernel.linear_rows(x.bfloat16(), w.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
    want = x.bfloat16().float() @ w.bfloat16().float().T
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=5e-2)


@requires_kernel
def test_long_bfloat16_products_of_few_columns_split_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_product`` sends bfloat16 products of at least ``ROWS_SPLIT_FROM`` rows and at most
    ``ROWS_SPLIT_MOST_COLUMNS`` columns to ``linear_rows``, and no others."""
    import verispec.models.fast_llama as fl

    module = fl._load_kernel()
    seen: list[tuple[int, int]] = []

    class Spy:
        def linear_rows(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            seen.append((x.shape[0], w.shape[0]))
            return module.linear_rows(x, w)

    monkeypatch.setattr(fl, "_kernel_module", Spy())
    monkeypatch.setattr(fl, "ROWS_SPLIT_FROM", 8)
    monkeypatch.setattr(fl, "ROWS_SPLIT_MOST_COLUMNS", 16)
    x = torch.randn(2, 5, 32)  # 10 rows
    for w, compute in ((torch.randn(16, 32), torch.bfloat16), (torch.randn(17, 32), torch.bfloat16)):
        y = fl._product(x, w, compute)
        assert y.shape == (2, 5, w.shape[0]) and y.dtype == torch.bfloat16
        want = x.bfloat16().float() @ w.bfloat16().float().T
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=5e-2)
    fl._product(x[:, :3], torch.randn(16, 32), torch.bfloat16)  # 6 rows: too few
    fl._product(x, torch.randn(16, 32))  # float32
    assert seen == [(10, 16)]


@requires_kernel
def test_kernel_rope_rows_rotates_the_query_and_key_heads_in_place() -> None:
    """The kernel's ``rope_rows``: HF's rotate-half rotation of each row's first ``heads`` heads at
    its own position of the tables, within float32 rounding; the heads after them untouched."""
    from verispec.models.fast_llama import _load_kernel, _rotate_half

    kernel = _load_kernel()
    gen = torch.Generator().manual_seed(6)
    M, D, heads, rest = 11, 16, 5, 2
    qkv = torch.randn(M, (heads + rest) * D, generator=gen)
    angles = torch.rand(40, D // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)  # [40, D]
    pos = torch.randint(0, 40, (M,), generator=gen)
    heads_view = qkv.view(M, heads + rest, D)
    want = heads_view[:, :heads] * cos[pos, None] + _rotate_half(heads_view[:, :heads]) * sin[pos, None]
    untouched = heads_view[:, heads:].clone()
    kernel.rope_rows(qkv, cos, sin, pos, heads)
    torch.testing.assert_close(heads_view[:, :heads], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(heads_view[:, heads:], untouched)
    with pytest.raises(RuntimeError, match="position"):
        kernel.rope_rows(qkv, cos, sin, torch.full((M,), 40), heads)


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_long_prefill_takes_the_kernels_fused_ops(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prefill on the torch path runs its norms, rotary embeddings and MLP activation through
    the kernel's fused ops (float32 ones for float32 products, bfloat16 for bfloat16 products) and
    stays close to eager torch's result."""
    import verispec.models.fast_llama as fl

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(8))
    fast = FastLlama.from_hf(_qwen2(), dtype=dtype, max_batch_size=2)
    fast.kernel_prefill_max = {dtype: 16}
    compute = None if dtype == "float32" else torch.bfloat16
    fast.prefill_compute = compute
    module = fl._kernel_module
    calls: list[torch.Tensor] = []

    class Spy:
        def __getattr__(self, name: str) -> object:  # the kernel's other functions, unwatched
            return getattr(module, name)

        def swiglu(self, gu: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            calls.append(gu)
            return module.swiglu(gu, scale)

        def rmsnorm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            norms.append(torch.bfloat16)
            return module.rmsnorm_bf16(x, weight, eps)

        def rmsnorm_f32(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            norms.append(torch.float32)
            return module.rmsnorm_f32(x, weight, eps)

        def rope_rows(self, qkv: torch.Tensor, *args: object) -> None:
            ropes.append(qkv)
            module.rope_rows(qkv, *args)

    norms: list[torch.dtype] = []
    ropes: list[torch.Tensor] = []
    monkeypatch.setattr(fl, "_kernel_module", Spy())
    fused = fast.forward(ids)
    want = compute or torch.float32
    assert len(calls) == 2 and all(c.dtype == want and c.shape[0] == 80 for c in calls)
    assert norms == [want] * 4 and len(ropes) == 2  # two norms and one rotation per layer
    monkeypatch.setattr(fl, "_kernel_module", None)  # the eager activation
    fast.reset(2)
    eager = fast.forward(ids)
    tol = 1e-4 if dtype == "float32" else 0.02
    torch.testing.assert_close(fused, eager, rtol=tol, atol=tol)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(6, 32), (10, 48)])
def test_kernel_rows_from_pairs_undoes_the_interleaving(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """The kernel's ``rows_from_pairs`` is the exact inverse of ``_interleave_pairs`` (what
    ``_plain_rows`` reads), and widens int8 to bfloat16 exactly on request; it refuses a matrix
    that cannot be paired and rounding float32."""
    from verispec.models.fast_llama import _interleave_pairs, _load_kernel

    kernel = _load_kernel()
    gen = torch.Generator().manual_seed(9)
    if dtype == torch.int8:
        rows = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    else:
        rows = torch.randn(shape, generator=gen).to(dtype)
    paired = rows.clone()
    _interleave_pairs(paired)
    assert not torch.equal(paired, rows)
    got = kernel.rows_from_pairs(paired)
    assert got.dtype == dtype and torch.equal(got, rows)
    if dtype == torch.int8:
        widened = kernel.rows_from_pairs(paired, to_bf16=True)
        assert widened.dtype == torch.bfloat16 and torch.equal(widened, rows.to(torch.bfloat16))
    else:
        with pytest.raises(RuntimeError, match="pair"):
            kernel.rows_from_pairs(rows[:, :-1].contiguous())  # not whole chunks
    with pytest.raises(RuntimeError, match="pair"):
        kernel.rows_from_pairs(rows[:-1].contiguous())  # an odd number of rows
    buffer = torch.full((shape[0] * shape[1] + 5,), 3, dtype=dtype)  # larger than needed
    into = kernel.rows_from_pairs(paired, into=buffer)
    assert into.data_ptr() == buffer.data_ptr() and torch.equal(into, rows)
    assert torch.equal(buffer[-5:], torch.full((5,), 3, dtype=dtype))  # nothing written past it
    with pytest.raises(RuntimeError, match="into"):
        kernel.rows_from_pairs(paired, into=buffer[:-6])  # too small
    # non-temporal stores where the buffer and rows are aligned to whole chunks, plain copies where
    # not (an offset of one element): the same rows either way, nothing written past them
    for offset in (0, 1):
        base = torch.full((shape[0] * shape[1] + 64,), 3, dtype=dtype)
        start = (-base.data_ptr() // base.element_size()) % 32 + offset
        out = base[start : start + shape[0] * shape[1]]
        streamed = kernel.rows_from_pairs(paired, into=out, stream=True)
        assert streamed.data_ptr() == out.data_ptr() and torch.equal(streamed, rows)
        rest = torch.cat([base[:start], base[start + shape[0] * shape[1] :]])
        assert torch.equal(rest, torch.full_like(rest, 3))
    assert torch.equal(kernel.rows_from_pairs(paired, stream=True), rows)
    if dtype == torch.float32:
        with pytest.raises(RuntimeError, match="float32"):
            kernel.rows_from_pairs(paired, to_bf16=True)


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize("compute", [None, torch.bfloat16])
def test_long_prefill_reads_paired_matrices_through_the_kernel(
    dtype: str, compute: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prefill on paired weights takes each matrix's rows from the kernel's
    ``rows_from_pairs`` (int8 widened there when the products run in bfloat16), and its logits are
    bitwise those of eager torch's row copy."""
    import verispec.models.fast_llama as fl

    if dtype == "float32" and compute is not None:
        pytest.skip("float32 weights keep float32 products")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(10))
    fast = FastLlama.from_hf(_qwen2(), dtype=dtype, max_batch_size=2, use_kernel=True)
    assert fast._w.get("paired")
    fast.kernel_prefill_max = {dtype: 16}
    fast.prefill_compute = compute
    module = fl._kernel_module
    original = module.rows_from_pairs
    widened: list[bool] = []
    buffers: list[int | None] = []

    def spy(
        w: torch.Tensor, to_bf16: bool = False, into: torch.Tensor | None = None, stream: bool = False
    ) -> torch.Tensor:
        widened.append(to_bf16)
        buffers.append(None if into is None else into.data_ptr())
        return original(w, to_bf16=to_bf16, into=into, stream=stream)

    monkeypatch.setattr(module, "rows_from_pairs", spy, raising=False)
    got = fast.forward(ids)
    mats = [lw[m] for lw in fast._w["layers"] for m in ("wqkv", "wo", "wgu", "wdown")]
    pairable = sum(_pairs_ok(w) for w in mats)
    assert pairable and len(widened) == pairable + int(_pairs_ok(fast._w["head"]))
    assert all(widened) == (dtype == "int8" and compute == torch.bfloat16) and any(widened) == all(widened)
    # the layers' copies go into one buffer per shape, kept for the next call; the head's does not
    layer_buffers = buffers[:pairable]
    shapes = {tuple(w.shape) for w in mats if _pairs_ok(w)}
    assert None not in layer_buffers and len(set(layer_buffers)) == len(fast._row_buffers) == len(shapes)
    assert buffers[pairable:] == [None] * (len(buffers) - pairable)
    fast.reset(2)
    again = fast.forward(ids)
    assert torch.equal(again, got) and set(buffers[-pairable - 1 : -1]) == set(layer_buffers)
    monkeypatch.setattr(fl, "_rows_for", lambda w, paired, *rest: fl._as_rows(w, paired))
    fast.reset(2)
    assert torch.equal(fast.forward(ids), got)


def _int16_activation_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The kernel's int8 product: each row of x ``[M, K]`` quantised to int16 with scale
    max |x| / 32767 (ties to even), exact integer dot products with weight ``[N, K]`` int8, then
    both scales (in float64, as the kernel) and the bias; ``[M, N]`` float32."""
    amax = x.abs().amax(-1, keepdim=True)
    # A tensor over a tensor: torch may compute a Python scalar over a tensor as the scalar times
    # the reciprocal, 1 ulp away from the kernel's correctly rounded division.
    inv = torch.full_like(amax, 32767.0) / amax
    q = torch.round(x * torch.where(amax > 0, inv, 0.0))
    y = (q.double() @ weight.double().T) * (amax / 32767.0).double() * scale.double()
    return y.float() + bias


@requires_kernel
@pytest.mark.parametrize("K", [100, 5000])  # a scalar tail; more than one 4096-k integer chunk
def test_int8_kernel_linear_is_exact_integer_products_of_int16_activations(K: int) -> None:
    from verispec.models.fast_llama import _load_kernel

    g = torch.Generator().manual_seed(14)
    x = torch.randn(5, K, generator=g)
    x[1, 7] = 300.0  # an outlier row: its other entries keep few bits in int16
    x[3] = 0.0  # an all-zero row
    q, scale = _quantize_rows(torch.randn(13, K, generator=g))
    bias = torch.randn(13, generator=g)
    got = _load_kernel().FastLlamaKernel(8, 1, 1, 8, 8, 1e-5).linear(x, q, bias, scale)
    want = _int16_activation_linear(x, q, bias, scale)
    assert torch.equal(got, want)
    assert not got[3].sub(bias).any()
    # Not the float32-activation product: the outlier row's rounding shows.
    floats = (x.double() @ q.double().T * scale.double()).float() + bias
    assert not torch.allclose(got[1], floats[1], rtol=1e-6, atol=1e-6)
    others = [0, 2, 3, 4]  # rows without outliers lose almost nothing
    torch.testing.assert_close(got[others], floats[others], rtol=1e-3, atol=1e-3)


@requires_kernel
@pytest.mark.parametrize("K", [96, 4112])  # one integer chunk; two (4096 + 16)
def test_int8_kernel_linear_on_paired_weights_is_the_same_exact_product(K: int) -> None:
    """Pair-interleaved int8 weights meet 2-9 input rows per pass in tiles of two pairs (four weight
    rows, their sums leaving the registers together) and single pairs where a block has only one
    left, from as few rows as the machine's schedule says; every schedule, row count and block
    remainder gives the exact integer product, bitwise."""
    from verispec.models.fast_llama import _interleave_pairs, _load_kernel
    from verispec.models.schedule import SCHEDULES

    kernel = _load_kernel().FastLlamaKernel(8, 1, 1, 8, 8, 1e-5)
    g = torch.Generator().manual_seed(15)
    for n in (6, 14, 20):  # blocks of 8 rows: 6 = a two-pair tile and a pair; 20 = 8 + 8 + 4
        q, scale = _quantize_rows(torch.randn(n, K, generator=g))
        bias = torch.randn(n, generator=g)
        paired = q.clone()
        _interleave_pairs(paired)
        assert not torch.equal(paired, q)
        # Passes of up to 6 rows (7 = 4 + 3, 13 = 6 + 6 + 1), or with AVX-512 VNNI, from 5 rows,
        # 512-bit tiles in passes of up to 9 (10 = 5 + 5, 13 = 7 + 6).
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13):
            x = torch.randn(m, K, generator=g)
            want = _int16_activation_linear(x, q, bias, scale)
            for name, sched in SCHEDULES.items():
                kernel.set_schedule(*sched)
                assert torch.equal(kernel.linear(x, paired, bias, scale, paired=True), want), (n, m, name)
                assert torch.equal(kernel.linear(x, q, bias, scale), want), (n, m, name)


@requires_kernel
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_kernel_linear_sums_the_largest_products_exactly(sign: float) -> None:
    """Every activation at +-32767 and every weight at 127: the integer sums reach the bounds the
    tiles' int32 lanes are flushed for (4096 columns per lane, 1024 per lane where four lanes are
    added in int32 first), at every row count and both weight layouts."""
    from verispec.models.fast_llama import _interleave_pairs, _load_kernel

    kernel = _load_kernel().FastLlamaKernel(8, 1, 1, 8, 8, 1e-5)
    K, n = 8192 + 64, 8
    q, scale = _quantize_rows(torch.ones(n, K))
    assert int(q.min()) == 127
    paired = q.clone()
    _interleave_pairs(paired)
    bias = torch.zeros(n)
    for m in (1, 2, 3, 5, 9):
        x = torch.full((m, K), sign)
        want = _int16_activation_linear(x, q, bias, scale)
        assert torch.equal(kernel.linear(x, paired, bias, scale, paired=True), want), m
        assert torch.equal(kernel.linear(x, q, bias, scale), want), m


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_kernel_linear_on_paired_weights_is_bitwise_the_row_major_one(dtype: torch.dtype) -> None:
    """Pair-interleaved float32 and bfloat16 weights meet 5-6 input rows (or, by the machine's
    schedule, any number) in tiles of two pairs, and float32 ones up to 12 rows in 512-bit tiles
    where the kernel has them (from ``set_wide_float_rows`` rows; 0 turns them off); every output
    element keeps the row-major tile's chain of products, so for any schedule, row count and block
    remainder the product is bitwise the same."""
    from verispec.models.fast_llama import _interleave_pairs, _load_kernel
    from verispec.models.schedule import SCHEDULES

    kernel = _load_kernel().FastLlamaKernel(8, 1, 1, 8, 8, 1e-5)
    g = torch.Generator().manual_seed(16)
    for n in (6, 14, 20):
        w = torch.randn(n, 104, generator=g).to(dtype)
        bias = torch.randn(n, generator=g)
        paired = w.clone()
        _interleave_pairs(paired)
        assert not torch.equal(paired, w)
        # 512-bit passes of up to 12 rows: 13 = 7 + 6, 25 = 12 + 12 + 1
        for m in (1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 16, 25):
            x = torch.randn(m, 104, generator=g)
            want = kernel.linear(x, w, bias, None)
            torch.testing.assert_close(want, x @ w.float().T + bias, rtol=1e-5, atol=1e-5)
            for name, sched in SCHEDULES.items():
                kernel.set_schedule(*sched)
                for wide in (0, 1, 6):
                    kernel.set_wide_float_rows(wide)
                    got = kernel.linear(x, paired, bias, None, paired=True)
                    assert torch.equal(got, want), (n, m, name, wide)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_linear_rows_do_not_depend_on_the_rows_beside_them(dtype: torch.dtype) -> None:
    """Each input row's outputs are bitwise the same whether it is multiplied alone or with others,
    for row-major weights whose K leaves a scalar tail (K % 8 != 0) as well. The tail was once
    `s += x * w`, which the compiler fused into an fma for some tile heights only: a row's outputs
    then differed with 2 or 4 rows in the call from 1 or 3."""
    from verispec.models.fast_llama import _load_kernel

    kernel = _load_kernel().FastLlamaKernel(8, 1, 1, 8, 8, 1e-5)
    g = torch.Generator().manual_seed(17)
    for k in (37, 100, 104):
        w = torch.randn(12, k, generator=g).to(dtype)
        x = torch.randn(9, k, generator=g)
        alone = torch.cat([kernel.linear(x[i : i + 1].contiguous(), w, None, None) for i in range(9)])
        for m in range(2, 10):
            assert torch.equal(kernel.linear(x[:m].contiguous(), w, None, None), alone[:m]), (k, m)


def test_weights_on_huge_pages_where_the_os_allows() -> None:
    """The matrices move into one 2 MB-aligned buffer (Linux with THP) and the model is unchanged."""
    from verispec.models.pages import HUGE_PAGE, huge_page_bytes

    hf = _qwen2()  # untied head: every matrix moves
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(15))
    fast = FastLlama.from_hf(hf, use_kernel=False)
    if huge_page_bytes(HUGE_PAGE) is None:
        pytest.skip("no transparent huge pages here")
    w = fast._w
    mats = [layer[k] for layer in w["layers"] for k in ("wqkv", "wo", "wgu", "wdown")]
    mats += [w["embed"], w["head"]]
    base = mats[0].data_ptr()
    assert base % HUGE_PAGE == 0
    assert all(0 <= t.data_ptr() - base < sum(m.nbytes for m in mats) + 64 * len(mats) for t in mats)
    _close(fast.forward(ids), _reference(hf, ids))


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("shape", ["small", "head64", "head64-int8"])
def test_tree_forward_scores_each_alternative_as_at_its_chain_position(use_kernel: bool, shape: str) -> None:
    """A tree call (pending, chain, then alternatives fed at their chain position's offset) gives
    every node the logits it would have in a chain (bitwise on the kernel), and keep_path moves an
    accepted alternative into place so that decoding goes on as if it had been fed in a chain.
    "head64": head_dim 64 after 70 tokens, the kernel's grouped attention (AVX-512); "head64-int8"
    the same with int8 weights, whose kernel cache is float16 (keep_path moves float16 rows)."""
    long = {"max_position_embeddings": 256, "sliding_window": 256}
    hf = _mistral() if shape == "small" else _mistral(head_dim=64, num_attention_heads=6, **long)
    gen = torch.Generator().manual_seed(9)
    n = 7 if shape == "small" else 70
    prompt = torch.randint(0, VOCAB, (2, n), generator=gen)
    dtype = "int8" if shape.endswith("int8") else "float32"
    fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2, use_kernel=use_kernel)
    fast.record_hidden = True

    def same(got: torch.Tensor, want: torch.Tensor) -> None:  # bitwise on the kernel
        if use_kernel:
            assert torch.equal(got, want)
        else:
            _close(got, want)

    def hidden_moved(fast: FastLlama, n: int) -> None:
        start, hidden = fast.hidden_by_row[0]
        assert start == n and hidden.shape[0] == 3

    check_tree_forward(fast, prompt, gen, VOCAB, same, hidden_moved)
    with pytest.raises(ValueError, match="offsets"):
        fast.forward(prompt[:, :6], offsets=torch.tensor([[0, 2, 2, 3, 1, 2]] * 2))


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_pair_interleaved_weights_give_bitwise_the_row_major_logits(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's pair-interleaved matrices (layers, embedding, head) change where weights sit, not
    the arithmetic: decoding, verification-sized calls and a long prefill (the torch path, which reads
    the matrices as rows again) give bitwise what row-major matrices give."""
    hf = _mistral(head_dim=76, max_position_embeddings=256, sliding_window=256)
    ids = torch.randint(0, VOCAB, (2, 140), generator=torch.Generator().manual_seed(4))

    def run() -> tuple[torch.Tensor, dict]:
        fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2, use_kernel=True)
        fast.kernel_prefill_max = {dtype: 16}  # the 120-token prefill takes the torch path
        out = [fast.forward(ids[:, :120])]
        out += [fast.forward(ids[:, t : t + 5]) for t in (120, 125)]
        out += [fast.forward(ids[:, t : t + 1]) for t in range(130, 140)]
        return torch.cat(out, dim=1), fast._w

    monkeypatch.setattr(FastLlama, "pair_weights", False)
    rows, plain = run()
    monkeypatch.setattr(FastLlama, "pair_weights", True)
    paired, w = run()
    assert w.get("paired") and not plain.get("paired")
    layer = w["layers"][0]
    moved = [key for key in ("wqkv", "wo", "wgu", "wdown") if _pairs_ok(layer[key])]
    assert "wqkv" in moved and "wdown" not in moved  # K = 100 has no whole chunks: left as rows
    for key in moved:
        assert not torch.equal(layer[key], plain["layers"][0][key])
        assert torch.equal(_plain_rows(layer[key]), plain["layers"][0][key])
    for key in ("embed", "head"):  # untied here: both rearranged (a tied one is one tensor)
        assert not torch.equal(w[key], plain[key])
        assert torch.equal(_plain_rows(w[key]), plain[key])
    assert torch.equal(paired, rows)


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_every_kernel_schedule_gives_bitwise_the_same_logits(dtype: str) -> None:
    """The machine's schedule (tiles of one or two weight pairs for few rows, a prefetch on one row)
    changes only the speed: decoding and verification-sized calls give bitwise the same logits."""
    from verispec.models.schedule import DEFAULT, SCHEDULES

    hf = _mistral(head_dim=76, max_position_embeddings=256, sliding_window=256)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    got = {}
    for name, sched in SCHEDULES.items():
        fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2, use_kernel=True)
        assert fast.kernel_schedule == DEFAULT  # a tiny model is never timed
        fast._kernel.set_schedule(*sched)
        assert fast._kernel.get_schedule() == sched
        out = [fast.forward(ids[:, :20])]
        out += [fast.forward(ids[:, t : t + 5]) for t in (20, 25)]
        out += [fast.forward(ids[:, t : t + 1]) for t in range(30, 40)]
        got[name] = torch.cat(out, dim=1)
    first, *rest = got.values()
    assert all(torch.equal(first, other) for other in rest)


@requires_kernel
def test_timing_the_schedules_leaves_the_model_empty_and_on_the_default() -> None:
    from verispec.models.schedule import DEFAULT, SCHEDULES, measure

    fast = FastLlama.from_hf(_llama(), max_batch_size=2, use_kernel=True)
    times = measure(fast, rounds=2, context=8)
    assert set(times) == set(SCHEDULES) and all(len(v) == 2 and min(v) > 0 for v in times.values())
    assert fast._kernel.get_schedule() == SCHEDULES[DEFAULT]
    assert not fast._lengths.any()


def test_old_kernel_builds_are_pruned_and_the_current_one_kept(tmp_path: Path) -> None:
    """Every source version (and checkout) builds its own kernel directory: those unused for
    ``max_age_days`` go, the current one and recently used ones stay, other files are not touched."""
    import os
    import time

    def build(name: str, days_ago: float, marker: bool) -> Path:
        d = tmp_path / f"verispec_fast_llama_{name}"
        d.mkdir()
        (d / "verispec_fast_llama.so").write_bytes(b"x")
        when = time.time() - days_ago * 86400
        if marker:
            (d / "last_used").touch()
            os.utime(d / "last_used", (when, when))
        os.utime(d, (when, when))
        return d

    current = build("current", 90, marker=False)  # built long ago, in use now
    old_marked = build("oldmarked", 45, marker=True)
    old_unmarked = build("oldunmarked", 45, marker=False)
    recent = build("recent", 3, marker=True)
    built_long_ago_used_lately = build("used", 1, marker=True)
    os.utime(built_long_ago_used_lately, (time.time() - 90 * 86400,) * 2)
    converted = tmp_path / "converted"
    converted.mkdir()
    os.utime(converted, (time.time() - 90 * 86400,) * 2)

    removed = prune_kernel_builds(current, max_age_days=30)
    assert sorted(removed) == sorted([old_marked, old_unmarked])
    assert not old_marked.exists() and not old_unmarked.exists()
    assert current.exists() and recent.exists() and built_long_ago_used_lately.exists()
    assert converted.exists()
    assert (current / "last_used").stat().st_mtime > time.time() - 60  # marked as used now


def _screened_pair(hf: torch.nn.Module, **kw: object) -> tuple[FastLlama, FastLlama]:
    """The same model with and without the head screen (kernel, float32)."""
    with patch.object(FastLlama, "screen_head", False):
        plain = FastLlama.from_hf(hf, use_kernel=True, **kw)
    with patch.object(FastLlama, "screen_head", True):
        screened = FastLlama.from_hf(hf, use_kernel=True, **kw)
    assert "head_screen" in screened._w and "head_screen" not in plain._w
    return plain, screened


def _check_screened(want: torch.Tensor, got: torch.Tensor) -> int:
    """``got`` (an "argmax" call) against ``want`` (the whole logits) ``[..., V]``: the same argmax,
    bitwise the same values where not -inf; returns how many entries were ruled out."""
    assert got.shape == want.shape
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], want[kept])
    return int((~kept).sum())


@requires_kernel
@pytest.mark.parametrize("tied", [True, False])
def test_head_screen_gives_the_whole_heads_argmax_and_its_own_logits(tied: bool) -> None:
    """float32 "argmax" calls through the screen: decoding, verification-sized and tree calls, rows
    of different lengths; the argmax and every kept logit are the whole head's, bitwise, and the
    screen rules most of a trained-like head out."""
    hf = _llama(tie_word_embeddings=tied, vocab_size=2048)
    with torch.no_grad():  # a head whose logits spread like a trained model's: a few tokens stand out
        w = hf.get_output_embeddings().weight
        order = torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(3))
        w.mul_(torch.linspace(0.2, 3.0, w.shape[0])[order][:, None])
    plain, screened = _screened_pair(hf, max_batch_size=2)
    ids = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(5))
    ruled_out = 0
    for fast in (plain, screened):
        fast.forward(ids[:, :10], logits="none")
    for t0, width in ((10, 1), (11, 5), (16, 1), (17, 9), (26, 1)):
        want = plain.forward(ids[:, t0 : t0 + width], logits="all")
        ruled_out += _check_screened(want, screened.forward(ids[:, t0 : t0 + width], logits="argmax"))
    offsets = torch.tensor([[0, 1, 2, 1, 2]]).expand(2, -1)  # a tree: alternatives beside the chain
    want = plain.forward(ids[:, 30:35], logits="all", offsets=offsets)
    ruled_out += _check_screened(want, screened.forward(ids[:, 30:35], logits="argmax", offsets=offsets))
    rows, whole = screened.screen_counts()
    assert rows == 2 * (1 + 5 + 1 + 9 + 1 + 5) and whole == 0
    assert ruled_out > rows * 2048 // 2, "the screen kept most of the vocabulary"
    # Other calls never take the screen: "all" is the whole head, bitwise.
    assert torch.equal(plain.forward(ids[:, 35:36]), screened.forward(ids[:, 35:36]))
    assert screened.screen_counts() == (rows, 0)


@requires_kernel
@pytest.mark.parametrize("vocab", [300, 5000])
def test_head_screen_keeps_near_ties_and_falls_back_when_too_many(vocab: int) -> None:
    """Every row of the head within 1e-4 of one row: the int8 screen cannot order them (its rounding
    is larger than their differences), so all must stay candidates and the largest logit, ties
    included (duplicated rows: the first of them), is still the whole head's. Beyond the kernel's
    4096 candidates a row takes the whole head."""
    hf = _llama(tie_word_embeddings=False, vocab_size=vocab)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        w = hf.get_output_embeddings().weight
        base = torch.randn(w.shape[1], generator=gen) * 0.05
        w.copy_(base + 1e-4 * torch.randn(w.shape, generator=gen) * base.abs().max())
        w[vocab // 2 :: 7] = w[vocab // 3]  # exact duplicates of one row
    plain, screened = _screened_pair(hf)
    ids = torch.randint(0, vocab, (1, 30), generator=gen)
    plain.forward(ids[:, :5], logits="none")
    screened.forward(ids[:, :5], logits="none")
    for t in range(5, 30, 5):
        want = plain.forward(ids[:, t : t + 5], logits="all")
        assert _check_screened(want, screened.forward(ids[:, t : t + 5], logits="argmax")) == 0
    rows, whole = screened.screen_counts()
    assert rows == 25 and whole == (25 if vocab > 4096 else 0)


@requires_kernel
def test_head_screen_changes_no_greedy_output_and_counts_its_bytes() -> None:
    """Greedy generation with prompt lookup (chains, verification of several tokens) and plain
    decoding: the same tokens with and without the screen. A greedy step reads the screen instead of
    the float32 head; sampling reads the head."""
    import verispec
    from verispec.proposers import PromptLookup

    hf = _llama(vocab_size=1024)
    plain, screened = _screened_pair(hf)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    outs = []
    for fast in (plain, screened):
        for draft in (None, PromptLookup()):
            result = verispec.speculative_generate(
                fast, draft, prompt, max_new_tokens=24, temperature=0, ignore_eos=True
            )
            outs.append(result.token_ids)
    assert len(outs[0]) == 24 and outs[0] == outs[1] == outs[2] == outs[3]
    counts = screened.screen_counts()
    assert counts[0] >= 24
    sampled = verispec.speculative_generate(screened, None, prompt, max_new_tokens=4, temperature=1, seed=0)
    assert len(sampled.token_ids) == 4 and screened.screen_counts() == counts  # sampling: whole head
    head = screened._w["head"].numel() * 4
    codes = screened._w["head_screen"]["codes"].numel()
    assert screened.weight_bytes() == plain.weight_bytes() + codes + 3 * 4 * 1024
    assert screened.read_bytes(greedy=True) == screened.weight_bytes() - head
    assert screened.read_bytes(greedy=False) == plain.weight_bytes() == plain.read_bytes(greedy=True)


def test_head_screen_in_chunks_of_rows_is_the_whole_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The screen is built a chunk of rows at a time; every code, scale and bound is per row, so
    the chunks (one of them ragged) give bitwise what one pass over the whole head gives."""
    import verispec.models.fast_llama as fl

    head = torch.randn(50, 64, generator=torch.Generator().manual_seed(5))
    head[3] = 0.0  # a zero row: scale 0
    monkeypatch.setattr(fl, "SCREEN_CHUNK_ROWS", 10**6)
    whole = fl._head_screen(head)
    monkeypatch.setattr(fl, "SCREEN_CHUNK_ROWS", 7)
    chunked = fl._head_screen(head)
    assert whole.keys() == chunked.keys()
    for key in whole:
        assert torch.equal(whole[key], chunked[key]), key
        assert chunked[key].shape[0] == 50


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_forward_greedy_is_the_argmax_of_forward(use_kernel: bool, dtype: str) -> None:
    """``forward_greedy`` (the greedy step's call: Python ints in and out, one kernel call) gives
    numpy's argmax of ``forward``'s whole logits at every position and advances the same rows:
    rows out of order, one token and verification-sized lines, and a head with exact duplicate rows
    (ties: the first) and a NaN row (NaN counts as largest)."""
    hf = _llama(tie_word_embeddings=False, vocab_size=1024)
    with torch.no_grad():
        w = hf.get_output_embeddings().weight
        w[700::5] = w[300]  # exact duplicates of row 300: its ties
    ids = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(8))
    ref = FastLlama.from_hf(hf, max_batch_size=2, use_kernel=use_kernel, dtype=dtype)
    fast = FastLlama.from_hf(hf, max_batch_size=2, use_kernel=use_kernel, dtype=dtype)
    for m in (ref, fast):
        m.forward(ids[:1, :9], rows=[0], logits="none")
        m.forward(ids[1:, :4], rows=[1], logits="none")
    starts = [9, 4]
    for width in (1, 5, 1, 3):
        lines = [
            ids[1, starts[1] : starts[1] + width].tolist(),
            ids[0, starts[0] : starts[0] + width].tolist(),
        ]
        want = ref.forward(torch.tensor(lines), rows=[1, 0], logits="all").numpy().argmax(-1).tolist()
        assert fast.forward_greedy(lines, [1, 0]) == want
        assert fast.lengths.tolist() == ref.lengths.tolist() == [starts[0] + width, starts[1] + width]
        starts = [s + width for s in starts]
    # Every row of the head the same: all logits tie, and the argmax is the first.
    with torch.no_grad():
        hf.get_output_embeddings().weight.copy_(hf.get_output_embeddings().weight[300].clone())
    tied = FastLlama.from_hf(hf, use_kernel=use_kernel, dtype=dtype)
    assert tied.forward_greedy([[1, 2, 3]], [0]) == [[0, 0, 0]]
    if dtype == "float32":  # a NaN weight row gives a NaN logit, which numpy's argmax picks
        with torch.no_grad():
            hf.get_output_embeddings().weight[17] = float("nan")
        with patch.object(FastLlama, "screen_head", False):
            nan = FastLlama.from_hf(hf, use_kernel=use_kernel, dtype=dtype)
        assert nan.forward_greedy([[4, 5]], [0]) == [[17, 17]]
    with pytest.raises(ValueError):
        fast.forward_greedy([[1]], [2])
    with pytest.raises(ValueError):
        fast.forward_greedy([[1], [2]], [0, 0])


@requires_kernel
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_kernel_logits_are_bitwise_the_same_on_one_two_and_three_threads(dtype: str) -> None:
    """The kernel runs each forward in one parallel region whose threads spin between its parallel
    calls (``team_drive``; ``set_team(False)``: one OpenMP region per call instead): either way,
    on fewer threads than cores or more (three threads on a 2-core machine wait by yielding), every
    logit is the same, and an error raised inside the region leaves the kernel working."""
    hf = _llama()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    fast = FastLlama.from_hf(hf, max_batch_size=2, dtype=dtype, use_kernel=True)
    before = torch.get_num_threads()
    got = {}
    try:
        for team in (False, True):
            fast._kernel.set_team(team)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                fast.reset(2)
                pieces = [fast.forward(ids[:, :20])]
                pieces += [fast.forward(ids[:, t : t + w]) for t, w in ((20, 1), (21, 2), (23, 5), (28, 12))]
                got[team, threads] = torch.cat(pieces, dim=1)
                n = 3
                slots, pos = torch.zeros(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64) + 40
                bad_rows = torch.tensor([n], dtype=torch.int64)  # raised inside the region
                with pytest.raises(RuntimeError, match="logit row out of range"):
                    fast._kernel.forward(ids[0, :n].contiguous(), slots, pos, bad_rows, None, False)
                fast.truncate(torch.tensor([28, 28]))
                again = fast.forward(ids[:, 28:40])
                assert torch.equal(again, got[team, threads][:, 28:])
    finally:
        torch.set_num_threads(before)
    first = got[False, 1]
    assert all(torch.equal(first, g) for g in got.values())
