"""The shipped EAGLE head with and without alternatives (a greedy tree of drafts), side by side.

For each prompt (the first N of each Spec-Bench category, as ``verispec bench`` picks them), plain
decoding, the head drafting a chain, and the head drafting a chain with its next candidates beside it
run one after another in an order rotated per prompt, greedy, on the float32 fast path. Prints decode
tokens/s, tokens per target call, acceptance and drafted tokens per call for each, and the geometric
mean over categories of the whole-request speedup over plain decoding. Every output must equal plain
decoding's. Run it alone on the machine (``flock /tmp/verispec-cpu.lock``).

    python benchmarks/tree_ab.py [--per-category 2] [-k 4] [--lookup-first] [--dtype float32]
"""

from __future__ import annotations

import argparse
import collections
import math

import verispec
from verispec.api import speculative_generate
from verispec.bench.prompts import load_prompts, select
from verispec.costs import costs_for
from verispec.distill.shipped import load_shipped_draft
from verispec.lookup_first import LookupFirst
from verispec.tokenizers import encode_prompt

MODES = ("plain", "chain", "tree")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("-k", type=int, default=4, help="longest chain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookup-first", action="store_true", help="prompt lookup first, the head behind")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    target = verispec.load_model("default", max_length=2048, dtype=args.dtype)
    head = load_shipped_draft(target)
    alternatives = head.alternatives
    proposer = LookupFirst(head, costs=costs_for(target)) if args.lookup_first else head

    def run(ids: list[int], mode: str):
        if mode == "plain":
            return speculative_generate(
                target, None, ids, max_new_tokens=args.max_new_tokens, temperature=0, num_speculative_tokens=0
            )
        head.alternatives = alternatives if mode == "tree" else 0
        return speculative_generate(
            target,
            proposer,
            ids,
            max_new_tokens=args.max_new_tokens,
            temperature=0,
            num_speculative_tokens=args.k,
        )

    warm = encode_prompt(target.tokenizer, "Hi", chat=True)
    for mode in MODES:
        run(warm, mode)
    totals = {m: collections.Counter() for m in MODES}
    seconds = collections.defaultdict(lambda: collections.defaultdict(float))  # category -> mode -> s
    for n, prompt in enumerate(select(load_prompts(), None, args.per_category)):
        ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
        outputs = {}
        for mode in MODES[n % 3 :] + MODES[: n % 3]:
            result = run(ids, mode)
            s = result.stats
            outputs[mode] = result.token_ids
            t = totals[mode]
            t["tokens"] += s.new_tokens
            t["decode_us"] += round((s.seconds - s.prefill_seconds) * 1e6)
            t["calls"] += s.target_calls
            t["drafted"] += s.draft_tokens
            t["accepted"] += s.accepted_tokens
            seconds[prompt.category][mode] += s.seconds
        assert outputs["chain"] == outputs["plain"] == outputs["tree"], prompt.question_id
    for mode, t in totals.items():
        print(
            f"{mode:6s} decode {t['tokens'] / t['decode_us'] * 1e6:6.1f} tokens/s, "
            f"{t['tokens'] / t['calls']:.3f} tokens per call, acceptance "
            f"{t['accepted'] / max(t['drafted'], 1):.3f}, {t['drafted'] / t['calls']:.2f} drafted per call"
        )
    for mode in MODES[1:]:
        logs = [math.log(by["plain"] / by[mode]) for by in seconds.values()]
        geomean = math.exp(sum(logs) / len(logs))
        print(f"{mode}: whole-request speedup, geometric mean over categories {geomean:.3f}x")


if __name__ == "__main__":
    main()
