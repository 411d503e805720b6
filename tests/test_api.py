"""The Python API on a model with a real tokenizer: stop strings, statistics, config validation."""

from __future__ import annotations

import pytest

import verispec
from verispec.api import stream_generate
from verispec.config import ConfigError, GenerationConfig, SamplingConfig


@pytest.fixture(scope="module")
def tiny(tiny_model_folder):
    return verispec.load_model(str(tiny_model_folder))


def test_loaded_model_carries_tokenizer(tiny):
    assert tiny.tokenizer is not None and tiny.vocab_size == 49152
    assert tiny.eos_token_ids


def test_stop_string_cuts_text_and_tokens(tiny):
    ids = tiny.tokenizer("Once upon a time").input_ids
    plain = verispec.speculative_generate(tiny, None, ids, max_new_tokens=30, temperature=0, ignore_eos=True)
    assert len(plain.text) > 10
    stop = plain.text[6:9]
    cut = plain.text.find(stop)
    out = verispec.speculative_generate(
        tiny, verispec.PromptLookup(), ids, max_new_tokens=30, temperature=0, stop=[stop], ignore_eos=True
    )
    assert out.text == plain.text[:cut]
    assert out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(plain.token_ids)


def test_text_is_decoded_when_read_not_at_every_step(tiny, monkeypatch):
    """Without stop strings nothing needs the text during generation: it is decoded once, when
    read, and equals the decoded tokens; streaming readers get each step's text."""
    calls = []
    decode = tiny.tokenizer.decode

    def counting(ids, **kwargs):
        calls.append(len(ids))
        return decode(ids, **kwargs)

    monkeypatch.setattr(tiny.tokenizer, "decode", counting)
    ids = tiny.tokenizer("Once upon a time").input_ids
    out = verispec.speculative_generate(tiny, None, ids, max_new_tokens=30, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 30 and len(calls) == 1
    assert out.text == decode(out.token_ids, skip_special_tokens=True)
    config = GenerationConfig(max_new_tokens=5, sampling=SamplingConfig(temperature=0), ignore_eos=True)
    texts = [ev.seq.text for events in stream_generate(tiny, None, [ids], config) for ev in events]
    assert len(texts) == 5 and all(texts[-1].startswith(t) for t in texts)
    assert texts[-1] == decode(out.token_ids[:5], skip_special_tokens=True)


def test_stats_are_consistent(tiny):
    ids = tiny.tokenizer("a b c a b c a b").input_ids
    out = verispec.speculative_generate(
        tiny, tiny, ids, max_new_tokens=20, temperature=0, num_speculative_tokens=3, ignore_eos=True
    )
    s = out.stats
    assert s.new_tokens == len(out.token_ids) == 20
    assert s.accepted_tokens <= s.draft_tokens
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert s.mean_accepted_length == pytest.approx(s.new_tokens / s.target_calls)
    assert s.tokens_per_second > 0 and s.seconds >= s.prefill_seconds
    assert len(out.from_draft) == 20 and sum(out.from_draft) == s.accepted_tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_k": -1},
    ],
)
def test_sampling_config_rejects(kwargs):
    with pytest.raises(ConfigError):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"num_speculative_tokens": -1}, {"stop": ("",)}])
def test_generation_config_rejects(kwargs):
    with pytest.raises(ConfigError):
        GenerationConfig(**kwargs)


def test_empty_and_too_long_prompts(tiny):
    with pytest.raises(ConfigError, match="empty"):
        verispec.speculative_generate(tiny, None, [], max_new_tokens=3)
    with pytest.raises(ConfigError, match="context"):
        verispec.speculative_generate(tiny, None, [1] * (tiny.max_length + 5), max_new_tokens=3)
