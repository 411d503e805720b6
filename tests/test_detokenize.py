"""Incremental decoding of a growing output: always the text of decoding it whole, for a few tokens'
work per step."""

from __future__ import annotations

import random

import pytest

from verispec.detokenize import IncrementalDecoder


@pytest.fixture(scope="module")
def decode(tiny_model_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_folder)
    return tok, (lambda ids: tok.decode(ids, skip_special_tokens=True))


def _grow(decoder: IncrementalDecoder, ids: list[int], rng: random.Random, whole) -> int:
    """Feed ``ids`` in random increments; every text must equal decoding the prefix whole."""
    n = steps = 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 4))
        assert decoder.text(ids[:n]) == whole(ids[:n])
        steps += 1
    return steps


def test_text_equals_the_whole_decode_at_every_step(decode) -> None:
    """Characters split across byte-level tokens (accents, CJK, emoji), special tokens that decoding
    skips, and random ids (many of them stray bytes)."""
    tok, whole = decode
    rng = random.Random(0)
    text = "Héllo wörld! 日本語のテキスト 🙂🚀 naïve café, “quotes” <|im_end|> and more: x² ≥ 0."
    for _ in range(5):
        _grow(IncrementalDecoder(whole), tok.encode(text * 3), rng, whole)
    for _ in range(200):
        ids = [rng.randrange(49152) for _ in range(rng.randint(1, 60))]
        _grow(IncrementalDecoder(whole), ids, rng, whole)


def test_decoding_that_depends_on_the_previous_token() -> None:
    """A SentencePiece-like decoder drops the leading space of its first word: the window must give
    each new token the context of the one before it."""
    vocab = {1: " the", 2: " cat", 3: " sat", 4: ".", 5: " on"}

    def whole(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids).removeprefix(" ")

    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.choice(list(vocab)) for _ in range(rng.randint(1, 30))]
        _grow(IncrementalDecoder(whole), ids, rng, whole)


def test_work_per_step_stays_small_and_rewrites_start_over(decode) -> None:
    tok, whole = decode
    decoded: list[int] = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return whole(ids)

    ids = tok.encode("Speculative decoding drafts and verifies in one pass: 日本語 🙂 café. " * 12)
    decoder = IncrementalDecoder(counting)
    for n in range(1, len(ids) + 1):
        assert decoder.text(ids[:n]) == whole(ids[:n])
    # The first two calls decode everything read so far; after that only a short window.
    assert max(decoded[4:]) <= 4 and sum(decoded) < 4 * len(ids)
    # A list that is not an extension (cut short, or rewritten) is decoded again from its start.
    # (Only the window and what follows may be rewritten: earlier tokens are taken as settled.)
    assert decoder.text(ids[:10]) == whole(ids[:10])
    changed = ids[:9] + [ids[20]]
    assert decoder.text(changed) == whole(changed)
