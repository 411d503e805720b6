"""Prompt encoding and the draft/target tokenizer check.

Speculative decoding compares token ids: a draft whose tokenizer differs from the target's proposes
ids that mean something else, and the output is silent garbage. :func:`check_compatible` refuses such
a pair before anything is generated and says what differs.
"""

from __future__ import annotations

from verispec.config import ConfigError


class TokenizerMismatchError(ConfigError):
    """Draft and target do not share a tokenizer."""


SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def check_compatible(
    target_tok, draft_tok, target_vocab: int | None = None, draft_vocab: int | None = None
) -> None:
    """Raise :class:`TokenizerMismatchError` naming the first differences between two tokenizers."""
    problems = []
    if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        problems.append(f"logit sizes differ (target {target_vocab}, draft {draft_vocab})")
    if target_tok is not None and draft_tok is not None and target_tok is not draft_tok:
        if len(target_tok) != len(draft_tok):
            problems.append(f"vocabulary sizes differ (target {len(target_tok)}, draft {len(draft_tok)})")
        else:
            t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
            if t_vocab != d_vocab:
                diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))
                problems.append(f"{len(diff)} vocabulary entries differ (e.g. {diff[0]!r})")
        for attr in SPECIAL:
            a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
            if a != b and a is not None and b is not None:
                problems.append(f"{attr} differs (target {a}, draft {b})")
    _refuse(problems)


def check_vocab_size(target_size: int, draft_size: int) -> None:
    """Raise :class:`TokenizerMismatchError` when two tokenizers, known by their numbers of tokens
    (a GGUF file's token list, read before converting it), cannot be the same."""
    if target_size != draft_size:
        _refuse([f"vocabulary sizes differ (target {target_size}, draft {draft_size})"])


def _refuse(problems: list[str]) -> None:
    if problems:
        raise TokenizerMismatchError(
            "draft and target tokenizers differ: "
            + "; ".join(problems)
            + ". Use a draft from the target's model family (same tokenizer), or --prompt-lookup."
        )


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Token ids for a user prompt: through the chat template when ``chat``, else as plain text."""
    if not text or not text.strip():
        raise ConfigError("the prompt is empty")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # a BatchEncoding in recent transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text).input_ids]
