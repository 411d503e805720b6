"""Greedy speculative output equals plain greedy output, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FreeCosts, tiny_llama

import verispec
import verispec.engine
from verispec.api import as_kvmodel

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture(autouse=True)
def free_verification(monkeypatch):
    """Exactness must hold whatever is drafted; make every engine here draft whatever its drafter
    proposes (as if verification cost nothing), so that the drafting these tests assert on does not
    depend on how fast this machine happens to run a tiny model while other jobs compete."""
    monkeypatch.setattr(verispec.engine, "costs_for", lambda target: FreeCosts())


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_llama(vocab_size=64, seed=0, layers=2, hidden=32)
    draft = tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32)
    return target, draft


def repetitive_prompt(n: int = 24, seed: int = 0) -> torch.Tensor:
    """A prompt with repeats, so prompt lookup finds matches (and mismatches)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 64, (8,), generator=g)
    return torch.cat([base, torch.randint(0, 64, (4,), generator=g), base[:5], base])[:n]


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup", "self"])
def test_tiny_float64_greedy_equals_plain(tiny_pair, k, drafter):
    target, draft = tiny_pair
    prompt = repetitive_prompt()
    plain = verispec.speculative_generate(target, None, prompt, max_new_tokens=40, temperature=0)
    hf = target.generate(prompt[None], max_new_tokens=40, do_sample=False, min_new_tokens=40)
    assert plain.token_ids == hf[0, len(prompt) :].tolist()
    chosen = {"draft-model": draft, "prompt-lookup": verispec.PromptLookup(), "self": target}[drafter]
    spec = verispec.speculative_generate(
        target, chosen, prompt, max_new_tokens=40, temperature=0, num_speculative_tokens=k
    )
    assert spec.token_ids == plain.token_ids
    assert spec.stats.draft_tokens > 0
    assert len(spec.stats.accepted_per_position) <= k
    if drafter == "self":
        assert spec.stats.acceptance_rate == 1.0


def test_batch_greedy_equals_rows_alone(tiny_pair):
    """Rows of different lengths in one batch give what each gives alone (ragged caches)."""
    target, draft = tiny_pair
    prompts = [repetitive_prompt(24, 0).tolist(), repetitive_prompt(13, 1).tolist()]
    batch = verispec.speculative_generate(
        target, draft, prompts, max_new_tokens=20, temperature=0, num_speculative_tokens=3
    )
    for prompt, got in zip(prompts, batch):
        alone = verispec.speculative_generate(target, None, prompt, max_new_tokens=20, temperature=0)
        assert got.token_ids == alone.token_ids


def test_lookup_lists_in_a_batch_with_rows_that_do_not_draft(tiny_pair):
    """Greedy steps take prompt lookup's drafts as lists (``propose_rows``, never ``propose``), also
    when only some rows of the batch draft; every row gives what it gives alone."""
    from verispec.config import GenerationConfig, SamplingConfig
    from verispec.engine import Engine

    target, _ = tiny_pair
    calls = {"rows": 0, "tensors": 0}

    class Spy(verispec.PromptLookup):
        def propose_rows(self, slots, committed, wants):
            calls["rows"] += 1
            found = super().propose_rows(slots, committed, wants)
            assert len(found) == len(slots) and all(len(t) <= w for (t, _), w in zip(found, wants))
            return found

        def propose(self, *args, **kwargs):
            calls["tensors"] += 1
            return super().propose(*args, **kwargs)

    engine = Engine(as_kvmodel(target), Spy())
    prompts = [repetitive_prompt(24, s).tolist() for s in range(3)]
    seqs = [
        engine.new_sequence(
            p,
            GenerationConfig(
                max_new_tokens=20, num_speculative_tokens=k, sampling=SamplingConfig(temperature=0)
            ),
        )
        for p, k in zip(prompts, (3, 0, 5))
    ]
    for _ in engine.run(seqs):
        pass
    assert calls["rows"] > 0 and calls["tensors"] == 0
    assert sum(s.stats.draft_tokens for s in seqs) > 0 and seqs[1].stats.draft_tokens == 0
    for prompt, seq in zip(prompts, seqs):
        alone = verispec.speculative_generate(target, None, prompt, max_new_tokens=20, temperature=0)
        assert seq.output_ids == alone.token_ids


def test_adaptive_greedy_equals_plain(tiny_pair):
    target, draft = tiny_pair
    prompt = repetitive_prompt()
    plain = verispec.speculative_generate(target, None, prompt, max_new_tokens=30, temperature=0)
    for chosen in (draft, verispec.PromptLookup()):
        spec = verispec.speculative_generate(
            target, chosen, prompt, max_new_tokens=30, temperature=0, num_speculative_tokens=4, adaptive=True
        )
        assert spec.token_ids == plain.token_ids


def test_never_more_tokens_than_asked(tiny_pair):
    target, _ = tiny_pair
    prompt = repetitive_prompt()
    for n in (1, 2, 5, 9):
        out = verispec.speculative_generate(
            target, target, prompt, max_new_tokens=n, temperature=0, num_speculative_tokens=8
        )
        assert len(out.token_ids) == n
        assert out.finish_reason == "length"


def test_stops_at_eos(tiny_pair):
    target, _ = tiny_pair
    prompt = repetitive_prompt()
    plain = verispec.speculative_generate(target, None, prompt, max_new_tokens=30, temperature=0)
    eos = plain.token_ids[5]
    kv = as_kvmodel(target)
    kv.eos_token_ids = [eos]
    try:
        out = verispec.speculative_generate(target, target, prompt, max_new_tokens=30, temperature=0)
    finally:
        kv.eos_token_ids = []
    first = plain.token_ids.index(eos)
    assert out.token_ids == plain.token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_transformers_drop_in(tiny_pair):
    """verispec.generate takes model.generate's arguments and returns the same ids."""
    target, draft = tiny_pair
    prompt = repetitive_prompt()[None]
    expected = target.generate(prompt, max_new_tokens=15, do_sample=False, min_new_tokens=15)
    got = verispec.generate(
        target, input_ids=prompt, assistant_model=draft, max_new_tokens=15, do_sample=False
    )
    assert torch.equal(got, expected)
    got = verispec.generate(
        target, input_ids=prompt, prompt_lookup_num_tokens=5, max_new_tokens=15, do_sample=False
    )
    assert torch.equal(got, expected)


def spec_bench_prompts(n_per_category: int = 1, categories=("summarization", "coding", "qa")) -> list[str]:
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    out = []
    for cat in categories:
        out += [r["turns"][0] for r in rows if r["category"] == cat][:n_per_category]
    return out


@pytest.mark.slow
@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="Spec-Bench file not present")
def test_default_model_greedy_equals_plain(default_model, tiny_model_folder):
    """On the real default model and real prompts, with a draft model, prompt lookup and lookup with
    the shipped n-gram table, and k in {1, 4, 8}."""
    from verispec.models.loading import load_model
    from verispec.tokenizers import encode_prompt

    small_draft = load_model(str(tiny_model_folder))  # same tokenizer, random weights: many rejections
    table = verispec.NgramLookup.for_target(default_model)
    for text in spec_bench_prompts():
        ids = encode_prompt(default_model.tokenizer, text, chat=True)
        plain = verispec.speculative_generate(default_model, None, ids, max_new_tokens=32, temperature=0)
        for k in (1, 4, 8):
            for drafter in (small_draft, verispec.PromptLookup(), table):
                spec = verispec.speculative_generate(
                    default_model, drafter, ids, max_new_tokens=32, temperature=0, num_speculative_tokens=k
                )
                assert spec.token_ids == plain.token_ids, (k, type(drafter).__name__, text[:40])
    assert table.table_drafts > 0  # the table drafted, and was checked, somewhere


@pytest.mark.slow
@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="Spec-Bench file not present")
def test_default_model_seeded_sampled_lookup_equals_plain(default_model):
    """Sampling with a seed on the real default model and real prompts, prompt lookup and lookup
    with the shipped n-gram table emit the plain seeded tokens (their drafts are point masses, and
    each position's token is the target's own draw from that position's uniform)."""
    from verispec.tokenizers import encode_prompt

    table = verispec.NgramLookup.for_target(default_model)
    settings = dict(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=4)
    accepted = 0
    for text in spec_bench_prompts():
        ids = encode_prompt(default_model.tokenizer, text, chat=True)
        plain = verispec.speculative_generate(default_model, None, ids, **settings)
        for k in (4, 8):
            for drafter in (verispec.PromptLookup(), table):
                spec = verispec.speculative_generate(
                    default_model, drafter, ids, num_speculative_tokens=k, **settings
                )
                assert spec.token_ids == plain.token_ids, (k, type(drafter).__name__, text[:40])
                accepted += spec.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_fast_path_seeded_sampled_lookup_equals_plain(dtype):
    """The kernel's logits for a token do not depend on how many tokens a call holds, so with a
    seed, sampled prompt lookup emits the plain sampled tokens in every weight format."""
    from verispec.models.fast_llama import kernel_available
    from verispec.models.loading import wrap

    if not kernel_available():
        pytest.skip("bitwise T-independence is the kernel's; the torch fallback is only close")
    target = wrap(tiny_llama(vocab_size=64, seed=0, layers=2, hidden=32, dtype=torch.float32), dtype=dtype)
    assert target.uses_kernel
    prompt = repetitive_prompt()
    settings = dict(max_new_tokens=40, temperature=0.8, top_k=20, seed=3)
    plain = verispec.speculative_generate(target, None, prompt, **settings)
    for k in (1, 5):
        spec = verispec.speculative_generate(
            target, verispec.PromptLookup(), prompt, num_speculative_tokens=k, **settings
        )
        assert spec.token_ids == plain.token_ids, k
        assert spec.stats.draft_tokens > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_fast_path_low_precision_greedy_equals_plain(dtype):
    """With bf16 or int8 weights the fast path's greedy speculative output is its plain output."""
    from verispec.models.fast_llama import kernel_available
    from verispec.models.loading import wrap

    if not kernel_available():
        pytest.skip("bitwise T-independence is the kernel's; the torch fallback is only close")

    target = wrap(tiny_llama(vocab_size=64, seed=0, layers=2, hidden=32, dtype=torch.float32), dtype=dtype)
    draft = wrap(tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, dtype=torch.float32), dtype=dtype)
    assert target.dtype == dtype and target.uses_kernel
    prompt = repetitive_prompt()
    plain = verispec.speculative_generate(target, None, prompt, max_new_tokens=40, temperature=0)
    for chosen in (draft, verispec.PromptLookup()):
        for k in (1, 5):
            spec = verispec.speculative_generate(
                target, chosen, prompt, max_new_tokens=40, temperature=0, num_speculative_tokens=k
            )
            assert spec.token_ids == plain.token_ids, (type(chosen).__name__, k)
            assert spec.stats.draft_tokens > 0


def test_rows_join_without_speculation_and_gain_it_later(tiny_pair):
    """A sequence added with k = 0 starts its drafter lazily when its k rises (server batch policy)."""
    from verispec.api import as_kvmodel, make_proposer
    from verispec.config import GenerationConfig, SamplingConfig
    from verispec.engine import Engine

    target, draft = tiny_pair
    kv = as_kvmodel(target)
    engine = Engine(kv, make_proposer(kv, draft, max_batch_size=2))
    config = GenerationConfig(
        max_new_tokens=12, num_speculative_tokens=3, sampling=SamplingConfig(temperature=0)
    )
    prompts = [repetitive_prompt(20, 0).tolist(), repetitive_prompt(15, 1).tolist()]
    seqs = [engine.new_sequence(p, config) for p in prompts]
    seqs[1].k = 0
    kv.reset(2)
    for slot, seq in enumerate(seqs):
        engine.add(seq, slot)
    engine.step(seqs)
    seqs[1].k = 3  # the policy allows speculation again
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished])
    assert seqs[1].stats.draft_tokens > 0
    for prompt, seq in zip(prompts, seqs):
        alone = verispec.speculative_generate(target, None, prompt, max_new_tokens=12, temperature=0)
        assert seq.output_ids == alone.token_ids
