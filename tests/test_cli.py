"""`verispec generate` end to end through the installed command, and every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def verispec_cmd() -> list[str]:
    exe = shutil.which("verispec")
    return [exe] if exe else [sys.executable, "-m", "verispec.cli"]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*verispec_cmd(), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def other_tokenizer_folder(tmp_path_factory, tiny_model_folder):
    """The tiny model with a tokenizer that has extra tokens: a mismatched draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_folder)
    tok.add_tokens(["<extra_a>", "<extra_b>"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    model.resize_token_embeddings(len(tok))
    out = tmp_path_factory.mktemp("other_tok")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_generate_json_tiny(tiny_model_folder):
    res = run(
        "generate",
        "Tell me a story.",
        "--model",
        str(tiny_model_folder),
        "--prompt-lookup",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert len(out["token_ids"]) <= 12
    stats = out["stats"]
    for key in (
        "new_tokens",
        "seconds",
        "tokens_per_second",
        "target_calls",
        "draft_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "accepted_per_position",
    ):
        assert key in stats
    assert stats["new_tokens"] == len(out["token_ids"])


def test_generate_draft_model_matches_plain(tiny_model_folder):
    base = [
        "generate",
        "Name three colours.",
        "--model",
        str(tiny_model_folder),
        "--max-new-tokens",
        "10",
        "--json",
    ]
    plain = json.loads(run(*base, "-k", "0").stdout)
    spec = json.loads(run(*base, "--draft-model", str(tiny_model_folder), "-k", "3").stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["acceptance_rate"] == 1.0  # the same weights draft: every token accepted
    assert spec["stats"]["draft_tokens"] > 0


def test_generate_streams_text_and_stats(tiny_model_folder):
    res = run(
        "generate",
        "Hi",
        "--model",
        str(tiny_model_folder),
        "--max-new-tokens",
        "8",
        "--color",
        "--draft-model",
        str(tiny_model_folder),
    )
    assert res.returncode == 0, res.stderr
    assert "tokens/s" in res.stderr and "accepted/position" in res.stderr
    assert "\033[32m" in res.stdout  # accepted draft tokens are coloured


BAD = [
    (["generate", ""], "prompt is empty"),
    (["generate", "hi", "-k", "-1"], "num_speculative_tokens"),
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "hi", "--temperature", "-0.5"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--top-k", "-3"], "top_k"),
    (["generate", "hi", "--model", "/no/such/model"], "not found"),
    (["generate", "hi", "--model", "missing.gguf"], "no such GGUF"),
    (["generate", "hi", "--draft-model", "/no/such/draft"], "not found"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a[2:]) or "empty" for a, _ in BAD])
def test_bad_input_one_line_exit_2(args, message):
    res = run(*args, timeout=60)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_prompt_longer_than_context(tiny_model_folder):
    res = run("generate", "word " * 3000, "--model", str(tiny_model_folder), "--raw")
    assert res.returncode == 2 and "context" in res.stderr and "Traceback" not in res.stderr


def test_mismatched_tokenizer_fails_before_generating(tiny_model_folder, other_tokenizer_folder):
    res = run(
        "generate", "hi", "--model", str(tiny_model_folder), "--draft-model", str(other_tokenizer_folder)
    )
    assert res.returncode == 2
    assert "tokenizers differ" in res.stderr and "vocabulary sizes differ" in res.stderr
    assert res.stdout == ""


@pytest.mark.slow
def test_generate_default_model_text_and_json():
    res = run(
        "generate",
        "What is the capital of France?",
        "--max-new-tokens",
        "24",
        "--prompt-lookup",
        "--no-color",
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    res = run("generate", "What is the capital of France?", "--max-new-tokens", "24", "--json")
    out = json.loads(res.stdout)
    assert "Paris" in out["text"] and out["stats"]["new_tokens"] <= 24
    # The caches are sized for this prompt, not the model's 8192 positions (360 MiB in float32).
    assert 0 < out["stats"]["memory_bytes"]["target_kv_cache"] < 64 << 20


def test_generate_sizes_its_cache_for_the_prompt():
    """One position per byte of the prompt (a byte-level tokenizer makes no more tokens than that),
    the template's allowance, the new tokens and a step's drafts."""
    from verispec.commands.generate import TEMPLATE_TOKENS, cache_length

    assert cache_length("héllo", 10, 4) == 6 + TEMPLATE_TOKENS + 10 + 4 + 1


def test_gemma_draft_for_default_target_is_refused(tmp_path, monkeypatch):
    """Refused from the two GGUF files' headers, before either model is converted or loaded (in a
    fresh cache, where converting both would take about two minutes)."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    res = run("generate", "hi", "--draft-model", "gemma3-270m", timeout=600)
    assert res.returncode == 2
    assert "tokenizers differ" in res.stderr and "(target 49152, draft 262144)" in res.stderr
    assert "converting" not in res.stderr and not (tmp_path / "converted").exists()


@pytest.mark.parametrize(
    ("calls", "drafted", "acceptance", "per_call", "warns"),
    [
        (53, 46, 0.26, 1.23, False),  # the default drafters: low acceptance, over one token per call
        (40, 120, 0.3, 1.9, False),
        (60, 240, 0.02, 1.05, True),  # every call verified drafts, hardly any were accepted
        (62, 5, 0.2, 1.02, False),  # prompt lookup rarely matched: few drafts, little wasted
        (64, 0, 0.0, 1.0, False),
        (0, 0, 0.0, 0.0, False),
    ],
)
def test_speculation_hint_only_when_drafting_did_not_pay(calls, drafted, acceptance, per_call, warns):
    from verispec.commands.generate import speculation_hint

    stats = {
        "target_calls": calls,
        "draft_tokens": drafted,
        "acceptance_rate": acceptance,
        "mean_accepted_length": per_call,
    }
    hint = speculation_hint(stats)
    assert (hint is not None) == warns
    if warns:
        assert "1.05 tokens per target call" in hint and "-k 0" in hint
