"""The Python API: ``speculative_generate``, ``generate`` (a transformers drop-in) and helpers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from verispec.adaptive import adapt_k
from verispec.config import ConfigError, GenerationConfig, SamplingConfig
from verispec.engine import Engine, SequenceState, StepEvent
from verispec.models.base import KVModel
from verispec.models.toy import LogitsModel
from verispec.proposers import DraftModelProposer, Proposer
from verispec.stats import GenerationStats
from verispec.tokenizers import check_compatible


@dataclass
class GenerationResult:
    """One sequence's output."""

    token_ids: list[int]
    """The new tokens (EOS included when generation stopped on it)."""
    text: str
    stats: GenerationStats
    finish_reason: str
    from_draft: list[bool]
    """Per new token: True when it was an accepted draft token, False when the target produced it."""


def as_kvmodel(model, *, fresh: bool = False) -> KVModel:
    """Accept a KVModel, a Hugging Face model, or any object with ``.logits(ids) -> [seq, V]``.

    Hugging Face models are wrapped once (the wrapper is kept on the model); ``fresh`` makes a new
    wrapper, needed when one model is both target and draft (each needs its own cache).
    """
    if all(hasattr(model, a) for a in ("forward", "truncate", "reset", "lengths")) and not isinstance(
        model, torch.nn.Module
    ):
        return model
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        from verispec.models.loading import wrap

        cached = getattr(model, "_verispec_kv", None)
        if cached is not None and not fresh:
            return cached
        kv = wrap(model, getattr(model, "_verispec_tokenizer", None))
        if not fresh:
            model._verispec_kv = kv
        return kv
    if hasattr(model, "logits"):
        return LogitsModel(model)
    raise TypeError(
        f"cannot use {type(model).__name__} as a model: give a KVModel, a transformers model, "
        "or an object with .logits(ids)"
    )


def make_proposer(
    target: KVModel, draft, *, target_obj=None, max_batch_size: int = 1, confidence_threshold: float = 0.0
) -> Proposer | None:
    """A proposer for ``draft``: None, a Proposer, or any model (checked against the target's tokenizer)."""
    if draft is None:
        return None
    if hasattr(draft, "propose") and hasattr(draft, "start"):
        return draft
    draft_kv = as_kvmodel(draft, fresh=draft is target_obj or draft is target)
    check_compatible(
        getattr(target, "tokenizer", None),
        getattr(draft_kv, "tokenizer", None),
        target.vocab_size,
        draft_kv.vocab_size,
    )
    return DraftModelProposer(
        draft_kv, max_batch_size=max_batch_size, confidence_threshold=confidence_threshold
    )


def _decoder(model: KVModel):
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _as_rows(input_ids) -> tuple[list[list[int]], bool]:
    """``input_ids`` as lists of ints; the flag says whether a batch (``[B, T]`` with B > 1) was given."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            return [input_ids.tolist()], False
        if input_ids.dim() == 2:
            return input_ids.tolist(), input_ids.shape[0] > 1
        raise ConfigError("input_ids must be [T] or [B, T]")
    seq = list(input_ids)
    if seq and isinstance(seq[0], (list, tuple, torch.Tensor)):
        rows = [list(map(int, r)) for r in seq]
        return rows, len(rows) > 1
    return [list(map(int, seq))], False


def _engine(target: KVModel, proposer: Proposer | None) -> Engine:
    return Engine(
        target,
        proposer,
        eos_token_ids=getattr(target, "eos_token_ids", ()),
        decode=_decoder(target),
        adaptive=adapt_k,
    )


def _sequences(
    engine: Engine, prompts: Sequence[Sequence[int]], config: GenerationConfig
) -> list[SequenceState]:
    seqs = [engine.new_sequence(p, config) for p in prompts]
    if config.seed is not None:  # distinct but reproducible streams for rows of one batch
        for i, s in enumerate(seqs):
            s.generator.manual_seed(config.seed + i)
    return seqs


def stream_generate(
    target: KVModel, proposer: Proposer | None, prompts: Sequence[Sequence[int]], config: GenerationConfig
) -> Iterator[list[StepEvent]]:
    """Run prompts as one batch, yielding each step's events (each event holds its sequence's state)."""
    engine = _engine(target, proposer)
    yield from engine.run(_sequences(engine, prompts, config))


def result_of(seq: SequenceState) -> GenerationResult:
    """Package a finished sequence."""
    return GenerationResult(
        token_ids=list(seq.output_ids),
        text=seq.text,
        stats=seq.stats,
        finish_reason=seq.finish_reason or "length",
        from_draft=list(seq.from_draft),
    )


def speculative_generate(
    target,
    draft,
    input_ids,
    *,
    max_new_tokens: int,
    num_speculative_tokens: int = 4,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    adaptive: bool = False,
    ignore_eos: bool = False,
) -> GenerationResult | list[GenerationResult]:
    """Generate with speculative decoding; the output is distributed exactly as the target's.

    Args:
        target: a model from :func:`verispec.load_model`, a transformers model, or any object with
            ``.logits(ids: [seq]) -> [seq, vocab]``.
        draft: the same kinds of model, a drafter such as :class:`verispec.PromptLookup`, or None
            (plain decoding).
        input_ids: one prompt (``[T]``, a list of ints, or ``[1, T]``) or a batch ``[B, T]``.
        temperature: 0 is greedy.

    Returns:
        A :class:`GenerationResult` (``.token_ids``, ``.stats``), or a list of them for a batch.
    """
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        num_speculative_tokens=num_speculative_tokens,
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p),
        seed=seed,
        stop=tuple(stop),
        adaptive=adaptive,
        ignore_eos=ignore_eos,
    )
    rows, batched = _as_rows(input_ids)
    target_kv = as_kvmodel(target)
    proposer = (
        make_proposer(target_kv, draft, target_obj=target, max_batch_size=len(rows))
        if num_speculative_tokens > 0
        else None
    )
    engine = _engine(target_kv, proposer)
    seqs = _sequences(engine, rows, config)
    for _ in engine.run(seqs):
        pass
    results = [result_of(s) for s in seqs]
    return results if batched else results[0]


def generate(
    model,
    input_ids: torch.Tensor | None = None,
    *,
    assistant_model=None,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    prompt_lookup_num_tokens: int | None = None,
    num_assistant_tokens: int | None = None,
    generation_config=None,
    seed: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for ``model.generate(input_ids, assistant_model=draft, ...)`` from transformers.

    Takes the same arguments (defaults from the model's ``generation_config``), and returns the same
    kind of output: ``[B, T + new]`` token ids, prompts included, rows padded with the pad token.
    Left padding marked by ``attention_mask`` is removed before decoding and restored in the output.
    """
    from verispec.proposers import PromptLookup

    if input_ids is None:
        input_ids = kwargs.pop("inputs", None)
    if input_ids is None:
        raise ConfigError("input_ids is required")
    if isinstance(input_ids, dict) or hasattr(input_ids, "keys"):
        attention_mask = input_ids.get("attention_mask", attention_mask)
        input_ids = input_ids["input_ids"]
    gc = generation_config or getattr(model, "generation_config", None)

    def pick(value, name, fallback):
        if value is not None:
            return value
        got = getattr(gc, name, None) if gc is not None else None
        return fallback if got is None else got

    max_new = pick(max_new_tokens, "max_new_tokens", None)
    if max_new is None:
        max_length = pick(None, "max_length", 20)
        max_new = max(1, max_length - input_ids.shape[-1])
    sampling = bool(pick(do_sample, "do_sample", False))
    temp = float(pick(temperature, "temperature", 1.0)) if sampling else 0.0
    k_top = pick(top_k, "top_k", None) if sampling else None
    p_top = pick(top_p, "top_p", None) if sampling else None
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
    if prompt_lookup_num_tokens:
        draft, k = PromptLookup(), int(prompt_lookup_num_tokens)
    else:
        draft = assistant_model
        k = int(
            num_assistant_tokens
            or getattr(getattr(assistant_model, "generation_config", None), "num_assistant_tokens", None)
            or 4
        )
    results = speculative_generate(
        model,
        draft,
        prompts if len(prompts) > 1 else prompts[0],
        max_new_tokens=int(max_new),
        num_speculative_tokens=k if draft else 0,
        temperature=temp,
        top_k=k_top,
        top_p=p_top,
        seed=seed,
    )
    results = results if isinstance(results, list) else [results]
    pad = getattr(gc, "pad_token_id", None)
    if pad is None:
        eos = getattr(gc, "eos_token_id", 0)
        pad = eos[0] if isinstance(eos, (list, tuple)) else (eos or 0)
    longest = max(len(r.token_ids) for r in results)
    out = torch.full((len(results), input_ids.shape[1] + longest), int(pad), dtype=input_ids.dtype)
    out[:, : input_ids.shape[1]] = input_ids
    for i, r in enumerate(results):
        out[i, input_ids.shape[1] : input_ids.shape[1] + len(r.token_ids)] = torch.tensor(r.token_ids)
    return out
