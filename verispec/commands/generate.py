"""Generate text for one prompt, streaming it, then print the statistics.

Accepted draft tokens are shown in green and tokens the target produced itself in plain text
(``--color``, on by default on a terminal), so the work of speculation is visible.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from verispec.api import result_of, stream_generate
from verispec.commands.common import (
    add_model_arguments,
    add_sampling_arguments,
    check_model_arguments,
    sampling_config,
)
from verispec.commands.drafters import proposer_from_args
from verispec.config import ConfigError, GenerationConfig
from verispec.tokenizers import encode_prompt

log = logging.getLogger("verispec")
GREEN, RESET = "\033[32m", "\033[0m"

TEMPLATE_TOKENS = 1024
"""Tokens allowed for a chat template around the prompt when sizing the cache (SmolLM2's adds about
30, with its default system prompt)."""


def cache_length(prompt: str, max_new_tokens: int, num_speculative_tokens: int) -> int:
    """Positions the caches need for one generation, sized before the tokenizer is loaded: a
    byte-level or byte-fallback tokenizer makes at most one token per byte of the prompt, plus the
    template's tokens, the new tokens and a step's drafts. ``load_model`` caps it at the model's
    own limit. (The model's limit, 8192 for SmolLM2, held a 360 MiB float32 cache for a one-line
    prompt.)"""
    return len(prompt.encode()) + TEMPLATE_TOKENS + max_new_tokens + num_speculative_tokens + 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``verispec generate``."""
    p.add_argument("prompt", help="the user message (sent through the chat template unless --raw)")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without chat template")
    p.add_argument("--adaptive", action="store_true", help="adapt k per step from observed acceptance")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    color = p.add_mutually_exclusive_group()
    color.add_argument("--color", dest="color", action="store_true", default=None)
    color.add_argument("--no-color", dest="color", action="store_false")


def run(args: argparse.Namespace) -> int:
    """Validate, load, generate."""
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        sampling=sampling_config(args),
        seed=args.seed,
        stop=tuple(args.stop),
        adaptive=args.adaptive,
    )
    check_model_arguments(args)
    from verispec.models.loading import load_model

    target = load_model(
        args.model,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        max_length=cache_length(args.prompt, args.max_new_tokens, args.num_speculative_tokens),
    )
    proposer = None
    if config.num_speculative_tokens > 0:
        proposer = proposer_from_args(target, args)
    prompt = encode_prompt(target.tokenizer, args.prompt, chat=target.instruct and not args.raw)
    color = sys.stdout.isatty() if args.color is None else args.color
    streamer = None if args.json else _Streamer(target.tokenizer, color)
    seq = None
    for events in stream_generate(target, proposer, [prompt], config):
        for ev in events:
            seq = ev.seq
            if streamer is not None:
                streamer.update(seq)
    assert seq is not None
    result = result_of(seq)
    result.stats.memory_bytes = memory_report(target, proposer)
    stats = result.stats.to_dict()
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                    "stats": stats,
                }
            )
        )
    else:
        streamer.finish()
        print(format_stats(stats), file=sys.stderr)
    hint = speculation_hint(stats)
    if hint is not None:
        log.warning("%s", hint)
    return 0


WASTED_TOKENS_PER_CALL = 1.1
"""Below this many tokens per target call, with a draft token or more verified per call, the wider
verification steps likely cost more than speculation gained (verifying 5 tokens costs 1.2-1.3
one-token steps on the 2-core CPUs of ``benchmarks/README.md``)."""


def speculation_hint(stats: dict) -> str | None:
    """Advice when speculation did not pay in a generation, else None.

    A low acceptance rate alone is no sign of that: the engine drafts as far as each token's
    estimated chance of acceptance pays, so the default drafters run at 20-35% acceptance while
    making 1.2-1.9 tokens per target call. What costs is verifying drafts that make hardly more than
    one token per call: at least one draft token per call on average and fewer than
    :data:`WASTED_TOKENS_PER_CALL` tokens per call.
    """
    calls, drafted, per_call = stats["target_calls"], stats["draft_tokens"], stats["mean_accepted_length"]
    if not calls or drafted < calls or per_call >= WASTED_TOKENS_PER_CALL:
        return None
    return (
        f"speculation made {per_call:.2f} tokens per target call "
        f"({100 * stats['acceptance_rate']:.0f}% of {drafted} draft tokens accepted): it did not "
        "pay here; try --prompt-lookup, another --draft-model, or -k 0 for plain decoding"
    )


class _Streamer:
    """Prints new text as it is committed, coloured by origin."""

    def __init__(self, tokenizer, color: bool):
        self.tokenizer = tokenizer
        self.color = color
        self.printed_tokens = 0
        self.printed_text = ""

    def update(self, seq) -> None:
        text = seq.text
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
            return
        new = text[len(self.printed_text) :]
        if not new:
            return
        if self.color:
            pieces = self._split(seq, new)
            out = "".join(f"{GREEN}{p}{RESET}" if f else p for p, f in pieces) if pieces else new
        else:
            out = new
        sys.stdout.write(out)
        sys.stdout.flush()
        self.printed_text = text
        self.printed_tokens = len(seq.from_draft)

    def _split(self, seq, new: str) -> list[tuple[str, bool]]:
        """Cut ``new`` into the pieces each new token added, each with its origin."""
        ids = seq.output_ids
        pieces = []
        prev = self.printed_text
        for n in range(self.printed_tokens + 1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if not text.startswith(prev) or text.endswith("\ufffd"):
                continue
            pieces.append((text[len(prev) :], seq.from_draft[n - 1]))
            prev = text
        joined = "".join(p for p, _ in pieces)
        return pieces if joined == new else []

    def finish(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()


def memory_report(target, proposer) -> dict[str, int]:
    """Bytes that speculation adds (draft weights, both KV caches), where the models report them."""
    out: dict[str, int] = {}
    draft = _draft_model(proposer)
    for name, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        for what, method in (
            ("kv_cache", "cache_bytes"),
            ("weights", "weight_bytes"),
            ("total", "memory_bytes"),
        ):
            if name == "target" and what != "kv_cache":
                continue  # the target's weights are there without speculation too
            fn = getattr(model, method, None)
            if callable(fn):
                out[f"{name}_{what}"] = int(fn())
    return out


def _draft_model(proposer) -> object | None:
    """The model behind a proposer: a draft model's KVModel, an EAGLE head's cache (also when it sits
    behind lookup first); None for prompt lookup."""
    found = proposer
    for _ in range(3):  # LookupFirst -> EagleProposer -> DraftKV
        found = getattr(found, "model", None) or getattr(found, "draft", None)
        if found is None or any(hasattr(found, m) for m in ("memory_bytes", "cache_bytes")):
            return found
    return None


def format_stats(stats: dict) -> str:
    """The human-readable statistics block."""
    per_pos = stats["accepted_per_position"]
    drafted = stats["drafted_per_position"]
    rates = " ".join(f"{a}/{d}" for a, d in zip(per_pos, drafted)) or "-"
    lines = [
        "",
        f"new tokens         {stats['new_tokens']}  ({stats['prompt_tokens']} prompt)",
        f"time               {stats['seconds']:.2f} s  ({stats['prefill_seconds']:.2f} s prompt)",
        f"tokens/s           {stats['tokens_per_second']:.1f}  "
        f"(decode only {stats['decode_tokens_per_second']:.1f})",
        f"target calls       {stats['target_calls']}",
        f"draft tokens       {stats['draft_tokens']} proposed, {stats['accepted_tokens']} accepted "
        f"({100 * stats['acceptance_rate']:.0f}%)",
        f"mean accepted len  {stats['mean_accepted_length']:.2f} tokens per target call",
        f"accepted/position  {rates}",
    ]
    if stats.get("memory_bytes"):
        mem = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in stats["memory_bytes"].items())
        lines.append(f"memory added       {mem}")
    return "\n".join(lines)
