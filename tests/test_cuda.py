"""Models on a GPU: the fast path and the generic path run their forwards on CUDA, hand logits back on
the CPU, and speculative greedy output still equals plain greedy output there.

Every test but the device-resolution ones is skipped where torch sees no GPU (CI has none); they were
run on a lent H200 (see benchmarks/SESSIONS.md, "On a GPU").
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_greedy import repetitive_prompt
from transformers import GPT2Config, GPT2LMHeadModel

import verispec
from verispec.config import ConfigError
from verispec.models.fast_llama import FastLlama
from verispec.models.hf import HFModel
from verispec.models.loading import resolve_device, wrap

HAVE_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA GPU here")


def _prompt(n: int = 24, seed: int = 0) -> list[int]:
    return repetitive_prompt(n, seed).tolist()


def test_auto_device_follows_torch():
    assert resolve_device("auto").type == ("cuda" if HAVE_CUDA else "cpu")
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.skipif(HAVE_CUDA, reason="checks the error shown where there is no GPU")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        resolve_device("cuda")


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("tpu-ish")


@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_fast_path_on_cuda_matches_cpu(dtype):
    model = tiny_llama(vocab_size=64, seed=0, layers=2, hidden=64, dtype=torch.float32)
    cpu = FastLlama.from_hf(model, dtype=dtype, use_kernel=False)
    gpu = FastLlama.from_hf(model.to("cuda"), dtype=dtype)
    assert gpu.device.type == "cuda"
    ids = torch.tensor([_prompt(20)])
    for m in (cpu, gpu):
        m.reset(1)
    a = cpu.forward(ids[:, :15])
    b = gpu.forward(ids[:, :15])
    assert b.device.type == "cpu" and b.shape == a.shape == (1, 15, 64)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    a = cpu.forward(ids[:, 15:], logits="last")
    b = gpu.forward(ids[:, 15:], logits="last")
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_plain_on_cuda(drafter, k):
    target = tiny_llama(vocab_size=64, seed=0, layers=2, hidden=64, dtype=torch.float32).to("cuda")
    draft = tiny_llama(vocab_size=64, seed=1, layers=1, hidden=64, dtype=torch.float32).to("cuda")
    kv = verispec.api.as_kvmodel(target)
    assert isinstance(kv, FastLlama) and kv.device.type == "cuda"
    prompt = _prompt()
    plain = verispec.speculative_generate(target, None, prompt, max_new_tokens=40, temperature=0)
    chosen = draft if drafter == "draft-model" else verispec.PromptLookup()
    spec = verispec.speculative_generate(
        target, chosen, prompt, max_new_tokens=40, temperature=0, num_speculative_tokens=k
    )
    assert spec.token_ids == plain.token_ids
    assert spec.stats.draft_tokens > 0


@requires_cuda
def test_batch_and_sampling_on_cuda():
    target = tiny_llama(vocab_size=64, seed=0, layers=2, hidden=64, dtype=torch.float32).to("cuda")
    draft = tiny_llama(vocab_size=64, seed=1, layers=1, hidden=64, dtype=torch.float32).to("cuda")
    prompts = [_prompt(24, 0), _prompt(13, 1)]
    batch = verispec.speculative_generate(
        target, draft, prompts, max_new_tokens=20, temperature=0, num_speculative_tokens=3
    )
    for prompt, got in zip(prompts, batch):
        alone = verispec.speculative_generate(target, None, prompt, max_new_tokens=20, temperature=0)
        assert got.token_ids == alone.token_ids
    runs = [
        verispec.speculative_generate(
            target, draft, prompts[0], max_new_tokens=30, temperature=0.8, num_speculative_tokens=4, seed=7
        ).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 30


@requires_cuda
def test_generic_path_on_cuda():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    target = GPT2LMHeadModel(cfg).eval().to("cuda")
    kv = wrap(target)
    assert isinstance(kv, HFModel) and kv.device.type == "cuda"
    prompt = _prompt()
    plain = verispec.speculative_generate(kv, None, prompt, max_new_tokens=30, temperature=0)
    spec = verispec.speculative_generate(
        kv, verispec.PromptLookup(), prompt, max_new_tokens=30, temperature=0, num_speculative_tokens=4
    )
    assert spec.token_ids == plain.token_ids
