"""The float32 default model with and without its exact 4-bit blocks, side by side.

Two copies of the default model in float32 on the kernel: one reads its layer matrices as the
exact Q4_1 blocks they are made of (``FastLlama.q4_weights``, the default), the other reads the
float32 rows (``VERISPEC_NO_Q4=1``'s behaviour). For each prompt (the first N of each Spec-Bench
category, as ``verispec bench`` picks them), plain greedy decoding and decoding with the default
drafter (prompt lookup first, the shipped EAGLE head behind it) run on both, in an order rotated
per prompt, each configuration keeping its fastest of ``--repeats`` rounds. Prints whole-request
and decode-only tokens/s per configuration, the geometric mean over categories of each speedup,
and checks that each method's outputs are the same on both copies (greedy: every output equals
plain decoding's on the float32 rows; sampled, with one seed per prompt: each method's outputs
match between the copies, whose logits are bitwise the same). Run it alone on the machine
(``flock /tmp/verispec-cpu.lock``).

    python benchmarks/q4_ab.py [--per-category 2] [--repeats 2] [-k 4] [--max-new-tokens 64]
        [--temperature 0.0]
"""

from __future__ import annotations

import argparse
import collections
import math

from side_by_side import fastest_rounds, generate

import verispec
from verispec.bench.prompts import load_prompts, select
from verispec.costs import costs_for
from verispec.distill.shipped import load_shipped_draft
from verispec.lookup_first import LookupFirst
from verispec.models.fast_llama import FastLlama
from verispec.tokenizers import encode_prompt

CONFIGS = ("plain/rows", "plain/blocks", "drafter/rows", "drafter/blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step for the drafter")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    blocks = verispec.load_model("default", max_length=2048, dtype="float32")
    FastLlama.q4_weights = False
    try:
        rows = verispec.load_model("default", max_length=2048, dtype="float32")
    finally:
        FastLlama.q4_weights = True
    targets = {"rows": rows, "blocks": blocks}
    drafters = {name: LookupFirst(load_shipped_draft(t), costs=costs_for(t)) for name, t in targets.items()}

    def run(ids: list[int], config: str):
        method, weights = config.split("/")
        drafter = drafters[weights] if method == "drafter" else None
        return generate(targets[weights], drafter, ids, args.max_new_tokens, args.k, args.temperature)

    warm = encode_prompt(blocks.tokenizer, "Hi", chat=True)
    for config in CONFIGS:
        run(warm, config)
    tokens = collections.Counter()
    decode = collections.defaultdict(float)
    seconds = collections.defaultdict(lambda: collections.defaultdict(float))  # category -> config -> s
    for n, prompt in enumerate(select(load_prompts(), None, args.per_category)):
        ids = encode_prompt(blocks.tokenizer, prompt.text, chat=True)
        best = fastest_rounds(CONFIGS, run, ids, n, args.repeats)
        for config, result in best.items():
            want = best["plain/rows" if args.temperature == 0 else config.split("/")[0] + "/rows"]
            assert result.token_ids == want.token_ids, (prompt.question_id, config)
            s = result.stats
            tokens[config] += s.new_tokens
            decode[config] += s.seconds - s.prefill_seconds
            seconds[prompt.category][config] += s.seconds
    whole = {c: sum(by[c] for by in seconds.values()) for c in CONFIGS}
    for config in CONFIGS:
        print(
            f"{config:15s} whole request {tokens[config] / whole[config]:6.1f} tokens/s, "
            f"decode-only {tokens[config] / decode[config]:6.1f} tokens/s"
        )

    def geomean(num: str, den: str) -> float:
        logs = [math.log(by[num] / by[den]) for by in seconds.values()]
        return math.exp(sum(logs) / len(logs))

    print("whole-request speedup, geometric mean over categories:")
    print(f"  plain, blocks over rows:        {geomean('plain/rows', 'plain/blocks'):.3f}x")
    print(f"  drafter, blocks over rows:      {geomean('drafter/rows', 'drafter/blocks'):.3f}x")
    print(f"  drafter over plain, rows:       {geomean('plain/rows', 'drafter/rows'):.3f}x")
    print(f"  drafter over plain, blocks:     {geomean('plain/blocks', 'drafter/blocks'):.3f}x")
    if args.temperature == 0:
        print("every output equals plain decoding's on the float32 rows")
    else:
        print("each method's outputs are the same on both copies")


if __name__ == "__main__":
    main()
