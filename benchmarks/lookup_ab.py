"""Paired A/B of plain decoding and prompt lookup through the engine, prompt by prompt.

For each category's first two Spec-Bench prompts, runs plain decoding and prompt lookup (k tokens)
alternately, ``ROUNDS`` times each, 64 new tokens, greedy, and prints the median of the per-pair
decode-time ratios (plain over lookup) with its range. Adjacent pairs see the same machine phase,
so this resolves smaller differences than a whole ``verispec bench`` run. Run it alone on the
machine (``flock /tmp/verispec-cpu.lock``).

    python benchmarks/lookup_ab.py summarization,rag,coding int8 8 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import verispec
from verispec.bench.prompts import load_prompts, select
from verispec.config import GenerationConfig, SamplingConfig
from verispec.engine import Engine
from verispec.tokenizers import encode_prompt


def decode_seconds(target, ids: list[int], lookup: verispec.PromptLookup | None, k: int) -> float:
    """Seconds from the first new token to the last of one greedy request of 64 new tokens."""
    engine = Engine(target, lookup)
    config = GenerationConfig(
        max_new_tokens=64, num_speculative_tokens=k, sampling=SamplingConfig(temperature=0.0)
    )
    seq = engine.new_sequence(ids, config)
    target.reset(1)
    engine.add(seq, 0)
    engine.step([seq])
    start = time.perf_counter()
    while not seq.finished:
        engine.step([seq])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("categories", help="comma list of Spec-Bench categories")
    parser.add_argument("dtype", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("k", type=int, help="prompt lookup's draft length")
    parser.add_argument("rounds", type=int, help="pairs per prompt")
    args = parser.parse_args()
    target = verispec.load_model("default", max_length=2048, dtype=args.dtype)
    for category in args.categories.split(","):
        ratios = []
        for prompt in select(load_prompts(), [category], 2):
            ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
            decode_seconds(target, ids, None, 0)  # warm-up
            for _ in range(args.rounds):
                plain = decode_seconds(target, ids, None, 0)
                lookup = decode_seconds(target, ids, verispec.PromptLookup(), args.k)
                ratios.append(plain / lookup)
        print(
            f"{category:15s} {args.dtype} k={args.k}: decode speedup median "
            f"{statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
