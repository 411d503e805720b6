"""int4 and w4a8 weights: a model's own Q4_1 layer blocks multiplied in integers (``--dtype int4``).

int4 keeps a Q4_1 GGUF's layer weights exact (int8 rounds them again per row) and multiplies them
by the same int16 activations as int8 (the kernel's ``linear_q4_tiles``); the embedding and head
are the GGUF's Q8_0 blocks. w4a8 holds the same weights and rounds the activations of its products
to 8 bits per block of 32 instead (half the integer work). These tests build a tiny Llama whose
layer matrices are exact Q4_1 blocks, and check what speculative decoding relies on (no logit
depends on how many tokens share a call), closeness to the float32 model, and the clear errors
where the formats cannot run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import check_tree_forward, tiny_llama
from transformers import LlamaForCausalLM

from verispec.models import fast_llama
from verispec.models.fast_llama import FastLlama

KERNEL = fast_llama._load_kernel()
VNNI = KERNEL is not None and bool(KERNEL.vnni_tiles_ready())
requires_vnni = pytest.mark.skipif(not VNNI, reason="int4 needs the kernel with AVX-512 VNNI")
BF16 = VNNI and fast_llama.bf16_attention_ok(64)
requires_bf16 = pytest.mark.skipif(not BF16, reason="bfloat16 attention needs the kernel with AVX-512 BF16")
VOCAB = 320


def _as_q4_1(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[N, K]`` rounded to Q4_1 blocks as GGUF writes them: per 32 weights the minimum m and
    the step d (both float16), codes ``round((w - m) / d)``, and each weight ``d * q + m`` rounded once
    to float32, as transformers dequantises it."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    m = blocks.amin(-1).half().float()
    d = ((blocks.amax(-1) - m) / 15).half().float().clamp(min=2.0**-14)
    q = ((blocks - m[..., None]) / d[..., None]).round().clamp(0, 15)
    q[..., 0], q[..., 1] = 0, 15  # every block spans its whole range, as GGUF's quantiser leaves it
    return (d[..., None] * q + m[..., None]).reshape(n, k)


def _as_q8_0(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[N, K]`` rounded to Q8_0 blocks as GGUF writes them: per 32 weights a float16 step
    ``d = max |w| / 127`` and codes ``round(w / d)``, each weight ``d * q`` (exact in float32)."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1) / 127).half().float()
    q = (blocks / d[..., None]).round().clamp(-127, 127)
    q[..., 0] = 127  # GGUF's quantiser gives each block's largest magnitude the code 127
    return (d[..., None] * q + 0.0).reshape(n, k)  # + 0.0: integer codes dequantise 0 to +0.0


def _q4_llama(seed: int = 3, tied: bool = True, hidden: int = 64) -> LlamaForCausalLM:
    """A tiny float32 Llama made as a Q4_1 GGUF is: layer matrices of exact Q4_1 blocks (rows in
    16s, columns in 32s), the embedding and output head of exact Q8_0 blocks (one tensor if tied).
    Its 4 heads have head dimension ``hidden / 4`` (64 at 256: the grouped and bfloat16 attention)."""
    hf = tiny_llama(VOCAB, seed=seed, hidden=hidden, dtype=torch.float32)
    with torch.no_grad():
        for blk in hf.model.layers:
            for proj in (*(getattr(blk.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                         blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj):  # fmt: skip
                proj.weight.copy_(_as_q4_1(proj.weight))
        hf.model.embed_tokens.weight.copy_(_as_q8_0(hf.model.embed_tokens.weight))
        hf.lm_head.weight.copy_(_as_q8_0(hf.lm_head.weight))
    if tied:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf


@requires_vnni
@pytest.mark.parametrize("dtype", ["int4", "w4a8"])
@pytest.mark.parametrize("hidden, cache", [(64, ""), (256, ""), (256, "bfloat16")])
def test_int4_logits_do_not_depend_on_how_many_tokens_share_a_call(
    dtype: str, hidden: int, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt whole, in kernel pieces, and one token at a time; decoding steps of 1, 5 and 9
    tokens (and a row alone against two rows): every logit bitwise the same. Head dimension 16 and
    64 (the grouped attention), and 64 over a bfloat16 cache (`attention_bf16`)."""
    if cache == "bfloat16" and not BF16:
        pytest.skip("bfloat16 attention needs the kernel with AVX-512 BF16")
    monkeypatch.setenv("VERISPEC_KV_CACHE", cache)
    hf = _q4_llama(hidden=hidden)
    ids = torch.randint(0, VOCAB, (2, 90), generator=torch.Generator().manual_seed(1))
    fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2)
    assert fast.uses_kernel and fast.dtype == dtype
    assert fast.kv_dtype == (torch.bfloat16 if cache else torch.float16)
    whole = fast.forward(ids)
    fast.reset(2)
    fast.kernel_prefill_piece = 32
    pieces = fast.forward(ids)
    fast.reset(2)
    steps = []
    for widths in ((1,) * 60, (5,) * 6, (9, 9, 9, 3)):
        fast.reset(2)
        pos, out = 0, []
        for t in widths:
            out.append(fast.forward(ids[:, pos : pos + t]))
            pos += t
        steps.append(torch.cat(out, dim=1))
    assert torch.equal(whole, pieces)
    for got in steps:
        assert torch.equal(got, whole[:, : got.shape[1]])
    fast.reset(2)
    alone = fast.forward(ids[1:, :30], rows=[1])
    assert torch.equal(alone, whole[1:, :30])


@requires_vnni
@pytest.mark.parametrize("tied", [True, False])
def test_int4_stays_close_to_float32_and_its_layers_are_exact(tied: bool) -> None:
    """Against the float32 model, int4's logits differ only by the int16 activations and the float16
    cache: its layers, head and (tied) embedding are the model's own blocks. int8's weights are
    rounded again, and its logits are much further off. It holds the layers as 4-bit blocks only:
    5 bits a weight (GGUF's Q4_1 blocks: codes, float16 d and m)."""
    hf = _q4_llama(seed=5, tied=tied)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = FastLlama.from_hf(hf, dtype="float32", use_kernel=True).forward(ids)
    int4 = FastLlama.from_hf(hf, dtype="int4")
    int8 = FastLlama.from_hf(hf, dtype="int8", use_kernel=True)
    err4 = (int4.forward(ids) - ref).abs().max()
    err8 = (int8.forward(ids) - ref).abs().max()
    assert int4._w["head_q8i"] is not None and (tied or int4._w["embed_q8i"] is not None)
    assert err4 < 2e-3 * ref.abs().max()
    assert err4 < err8 / 10
    layer = int4._w["layers"][0]
    assert layer["wgu"] is None and layer["wgu_q4i"].numel() == 256 * 64 * 5 // 8


def _int8_tensors(fast: FastLlama) -> list[str]:
    """Where ``fast`` holds int8 rows among its weight tensors (its ``_w``)."""
    w = fast._w
    named = [(k, v) for k, v in w.items() if k != "layers"]
    named += [(f"layers.{i}.{k}", v) for i, layer in enumerate(w["layers"]) for k, v in layer.items()]
    return [k for k, v in named if isinstance(v, torch.Tensor) and v.dtype == torch.int8]


@requires_vnni
@pytest.mark.parametrize("tied", [True, False])
def test_int4_holds_q8_0_heads_as_blocks_only(tied: bool) -> None:
    """A head and embedding made of exact Q8_0 blocks are held only as those blocks: no int8 rows
    beside them (before, 28 MB on the default model that no call read). A head that is not Q8_0
    stays int8 rows, beside the embedding's blocks, and the kernel still reads each token's logits
    bitwise the same however many tokens share a call."""
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    for dtype in ("int4", "w4a8"):
        fast = FastLlama.from_hf(_q4_llama(seed=5, tied=tied), dtype=dtype)
        assert fast._w["head"] is None and fast._w["embed"] is None
        assert _int8_tensors(fast) == []
    hf = _q4_llama(seed=5, tied=False)
    with torch.no_grad():
        hf.lm_head.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(4))  # not Q8_0
    fast = FastLlama.from_hf(hf, dtype="int4")
    assert fast._w["head_q8i"] is None and fast._w["embed_q8i"] is not None
    assert sorted(_int8_tensors(fast)) == ["embed", "head"]
    whole = fast.forward(ids)
    fast.reset(1)
    steps = torch.cat([fast.forward(ids[:, t : t + 5]) for t in range(0, 40, 5)], dim=1)
    assert torch.equal(steps, whole)
    ref = FastLlama.from_hf(hf, dtype="float32", use_kernel=True).forward(ids)
    assert (whole - ref).abs().max() < 0.05 * ref.abs().max()


@requires_vnni
@pytest.mark.parametrize("hidden, cache", [(64, ""), (256, ""), (256, "bfloat16")])
def test_w4a8_folded_jobs_give_the_same_logits(
    hidden: int, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """w4a8's products take 8-bit blocks quantised by the jobs that write their inputs, the qkv
    product's threads write their own heads (head dimension 64; a float16 or bfloat16 cache) and
    the gate/up product's compute SwiGLU over their columns (``set_fuse``). Against the separate
    jobs, on one, two and three threads, in a team or not: a prompt, steps of 1, 2 and 5 tokens,
    every logit bitwise the same."""
    if cache == "bfloat16" and not BF16:
        pytest.skip("bfloat16 attention needs the kernel with AVX-512 BF16")
    monkeypatch.setenv("VERISPEC_KV_CACHE", cache)
    hf = _q4_llama(hidden=hidden)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    fast = FastLlama.from_hf(hf, dtype="w4a8", max_batch_size=2)
    before = torch.get_num_threads()
    got = {}
    try:
        for fuse in (False, True):
            fast._kernel.set_fuse(fuse)
            for team in (False, True):
                fast._kernel.set_team(team)
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    fast.reset(2)
                    pieces = [fast.forward(ids[:, :40])]
                    pieces += [fast.forward(ids[:, t : t + w]) for t, w in ((40, 1), (41, 2), (43, 5))]
                    got[fuse, team, threads] = torch.cat(pieces, dim=1)
    finally:
        torch.set_num_threads(before)
        fast._kernel.set_fuse(True)
        fast._kernel.set_team(True)
    first = got[False, False, 1]
    assert all(torch.equal(first, g) for g in got.values())


def _under_toggle(
    fast: FastLlama, toggle: Callable[[bool], None], run: Callable[[bool], torch.Tensor]
) -> dict[tuple[bool, int], torch.Tensor]:
    """``run(on)`` with ``toggle(on)`` off, then on, each on one, two and three threads after a reset
    of two rows: ``{(on, threads): its logits}``. The toggle is left on, the thread count as it was."""
    before = torch.get_num_threads()
    got = {}
    try:
        for on in (False, True):
            toggle(on)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                fast.reset(2)
                got[on, threads] = run(on)
    finally:
        torch.set_num_threads(before)
        toggle(True)
    return got


def _steps_equal_under_toggle(dtype: str, toggle: str, seed: int, steps: tuple[tuple[int, int], ...]) -> None:
    """A two-row prompt of 40 tokens, then steps of ``(start, width)``, with the kernel's ``toggle``
    off and on, on one, two and three threads (``_under_toggle``): every logit bitwise the same."""
    hf = _q4_llama(hidden=256)
    end = max(t + w for t, w in steps)
    ids = torch.randint(0, VOCAB, (2, end), generator=torch.Generator().manual_seed(seed))
    fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2)

    def run(_: bool) -> torch.Tensor:
        pieces = [fast.forward(ids[:, :40])]
        pieces += [fast.forward(ids[:, t : t + w]) for t, w in steps]
        return torch.cat(pieces, dim=1)

    got = _under_toggle(fast, getattr(fast._kernel, toggle), run)
    first = got[False, 1]
    assert all(torch.equal(first, g) for g in got.values())


@requires_vnni
@pytest.mark.parametrize("dtype", ["int4", "w4a8"])
def test_streaming_stores_give_the_same_logits(dtype: str) -> None:
    """Steps of up to 8 tokens write what the other thread reads next (the wo and down products'
    outputs, the 8-bit blocks quantised ahead) with non-temporal stores (``set_stream``). Against
    ordinary stores, on one, two and three threads: a prompt, steps of 1, 2, 5 and 9 tokens (9: past
    the streaming calls), every logit bitwise the same."""
    _steps_equal_under_toggle(dtype, "set_stream", 6, ((40, 1), (41, 2), (43, 5), (48, 9)))


@requires_vnni
@pytest.mark.parametrize("dtype", ["int4", "w4a8", "int8"])
def test_products_own_rows_give_the_same_logits(dtype: str) -> None:
    """In calls of up to 8 tokens the products' threads each form every input row themselves
    (``set_own_rows``): w4a8's qkv and gate/up products normalise and quantise x with no norm job
    before them, int4's and int8's four products quantise their own rows. Against the jobs, on one,
    two and three threads: a prompt, steps of 1, 2, 5, 8 and 9 tokens (9: past the own rows), every
    logit bitwise the same."""
    _steps_equal_under_toggle(dtype, "set_own_rows", 9, ((40, 1), (41, 2), (43, 5), (48, 8), (56, 9)))


@requires_vnni
@pytest.mark.parametrize("dtype", ["int4", "w4a8", "int8"])
def test_prompts_by_rows_give_the_same_logits(dtype: str) -> None:
    """int4 and w4a8 calls of at least 32 tokens (int8: 64) on two threads run their layers by
    rows, each thread its own rows through every product (``set_rows``, ``layers_by_rows``).
    Against the products split by columns, on one, two and three threads: a two-row prompt (80
    tokens in the call), a piece of 33 tokens and one of 31 (below the threshold) in one row, then
    steps of 1 and 5 tokens, every logit bitwise the same; and calls did run by rows (only where
    it is on)."""
    hf = _q4_llama(hidden=256)
    ids = torch.randint(0, VOCAB, (2, 110), generator=torch.Generator().manual_seed(8))
    fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2)
    by_rows = {False: 0, True: 0}

    def run(rows: bool) -> torch.Tensor:
        calls = fast._kernel.rows_calls()
        pieces = [fast.forward(ids[:, :40])]
        for t, w in ((40, 33), (73, 31), (104, 1), (105, 5)):
            pieces.append(fast.forward(ids[:1, t : t + w], rows=[0]))
        by_rows[rows] += fast._kernel.rows_calls() - calls
        return torch.cat([p[:1] for p in pieces], dim=1)

    got = _under_toggle(fast, fast._kernel.set_rows, run)
    assert by_rows[False] == 0 and by_rows[True] >= (1 if dtype == "int8" else 2)
    first = got[False, 1]
    assert all(torch.equal(first, g) for g in got.values())


@requires_vnni
def test_w4a8_rounds_only_the_activations() -> None:
    """w4a8 holds int4's weights (the same layout) and rounds its products' activations to 8 bits
    per block: its logits are further from float32's than int4's, by about what 8-bit activations
    cost (on this tiny model as much as int8's rounded weights; on the default model less, by
    ``benchmarks/format_agreement.py``)."""
    hf = _q4_llama(seed=5)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = FastLlama.from_hf(hf, dtype="float32", use_kernel=True).forward(ids)
    errors = {}
    for dtype in ("int4", "w4a8", "int8"):
        errors[dtype] = float(
            (FastLlama.from_hf(hf, dtype=dtype, use_kernel=True).forward(ids) - ref).abs().max()
        )
    assert errors["int4"] * 5 < errors["w4a8"] < 2 * errors["int8"]
    w4a8 = FastLlama.from_hf(hf, dtype="w4a8")
    assert w4a8._w["layers"][0]["wgu"] is None and w4a8._w["head_q8i"] is not None


@requires_bf16
@pytest.mark.parametrize("dtype", ["int4", "w4a8"])
def test_bfloat16_attention_stays_close_and_moves_tree_nodes(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``VERISPEC_KV_CACHE=bfloat16`` int4 and w4a8 attend in bfloat16 products: their logits
    stay closer to float32's than int8's (int4's move further than over the float16 cache: about
    0.3% of the largest logit against 0.02%; w4a8's stay near 0.8-1%); a tree call scores each node as at
    its chain position, bitwise, and keeping an alternative moves its key and value through the
    cache's layouts (`move_positions`) so that decoding goes on as if it had been fed in a chain."""
    hf = _q4_llama(seed=5, hidden=256)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (1, 100), generator=gen)
    ref = FastLlama.from_hf(hf, dtype="float32", use_kernel=True).forward(ids)
    monkeypatch.setenv("VERISPEC_KV_CACHE", "float16")
    err16 = float((FastLlama.from_hf(hf, dtype=dtype).forward(ids) - ref).abs().max())
    err8 = float((FastLlama.from_hf(hf, dtype="int8", use_kernel=True).forward(ids) - ref).abs().max())
    monkeypatch.setenv("VERISPEC_KV_CACHE", "bfloat16")
    fast = FastLlama.from_hf(hf, dtype=dtype, max_batch_size=2)
    assert fast.kv_dtype == torch.bfloat16
    fast.reset(1)
    err = float((fast.forward(ids) - ref).abs().max())
    assert fast.k_cache[0].dtype == torch.bfloat16 and fast.k_cache[0].shape[2] % 32 == 0
    assert err < err8 and (dtype == "w4a8" or err16 < err)

    # An odd length: the chain's pairs of positions straddle a pair and a block of keys.
    prompt = torch.randint(0, VOCAB, (2, 45), generator=gen)
    check_tree_forward(fast, prompt, gen, VOCAB, _bitwise)


def _bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got, want)


def test_bfloat16_cache_only_for_int4_and_w4a8(monkeypatch: pytest.MonkeyPatch) -> None:
    """``VERISPEC_KV_CACHE=bfloat16`` is for int4 and w4a8 on a kernel with AVX-512 BF16 and head
    dimension 64: other formats keep their own cache (a run of several formats can set it once),
    int4 and w4a8 where it cannot run get a clear error, and an unknown value names the choices."""
    monkeypatch.setenv("VERISPEC_KV_CACHE", "bfloat16")
    assert fast_llama._kv_dtype("int8", True) == torch.float16
    assert fast_llama._kv_dtype("float32", True) == torch.float32
    assert fast_llama._kv_dtype("bfloat16", False) == torch.float32
    with pytest.raises(ValueError, match="needs the kernel built with AVX-512 BF16 and head dimension 64"):
        fast_llama._kv_dtype("w4a8", True, head_dim=32)
    if BF16:
        assert fast_llama._kv_dtype("int4", True) == torch.bfloat16
    monkeypatch.setenv("VERISPEC_KV_CACHE", "half")
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fast_llama._kv_dtype("w4a8", True)


@requires_vnni
@pytest.mark.parametrize("dtype", ["int4", "w4a8"])
def test_int4_greedy_speculation_is_plain_greedy(dtype: str) -> None:
    """Prompt lookup over int4 (w4a8) weights gives exactly plain greedy decoding's tokens."""
    from verispec.api import speculative_generate
    from verispec.proposers import PromptLookup

    hf = _q4_llama(seed=7)
    fast = FastLlama.from_hf(hf, dtype=dtype)
    prompt = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([prompt, prompt[:, :12]], dim=1)  # something to look up
    kw = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    plain = speculative_generate(fast, None, prompt, **kw)
    spec = speculative_generate(fast, PromptLookup(), prompt, num_speculative_tokens=4, **kw)
    assert len(plain.token_ids) == 30
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens > 0


@requires_vnni
@pytest.mark.parametrize("dtype", ["int4", "w4a8"])
def test_int4_refuses_a_model_without_q4_blocks_and_the_torch_path(dtype: str) -> None:
    hf = tiny_llama(VOCAB, seed=3, hidden=64, dtype=torch.float32)  # random weights: no blocks
    with pytest.raises(ValueError, match="exact Q4_1 blocks"):
        FastLlama.from_hf(hf, dtype=dtype)
    with pytest.raises(ValueError, match=f"{dtype} weights run on the C\\+\\+ kernel only"):
        FastLlama.from_hf(_q4_llama(), dtype=dtype, use_kernel=False)
