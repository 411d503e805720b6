"""Measure prompt lookup's acceptance by match length on held-out Spec-Bench prompts.

Fits the prior of :data:`verispec.proposers.LOOKUP_ACCEPTANCE_PRIOR`. The benchmark uses the first
prompts of each category, so this script skips them (``--skip 5``: questions 6, 7, ... of each).

For every position of the target's plain greedy output it finds prompt lookup's match (length m) and
walks the copy: the i-th copied token (i = 0, 1, ...) is an observation at effective match length
m + i (a match that was continued i times is m + i long), a success when it equals the target's own
token; the walk stops at the first failure, as verification does. Prints, per match-length bucket,
the chance the next copied token is accepted.

    python benchmarks/lookup_acceptance.py --skip 5 --per-category 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json

import verispec
from verispec.bench.prompts import load_prompts
from verispec.proposers import LOOKUP_BUCKETS, PromptLookup, lookup_bucket
from verispec.tokenizers import encode_prompt


def walk(pl: PromptLookup, seq: list[int], first: int, counts: dict[int, list[int]]) -> None:
    """Add the observations of every position from ``first`` on to ``counts[bucket] = [ok, seen]``."""
    for t in range(first, len(seq)):
        start, m = pl.match(seq[:t])
        if m == 0:
            continue
        i = 0
        while start + i < t and t + i < len(seq):
            ok = seq[start + i] == seq[t + i]
            c = counts.setdefault(lookup_bucket(m + i), [0, 0])
            c[0] += ok
            c[1] += 1
            if not ok:
                break
            i += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip", type=int, default=5, help="questions per category the benchmark uses")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    target = verispec.load_model("default", dtype=args.dtype)
    pl = PromptLookup()
    by_cat: dict[str, list] = {}
    for prompt in load_prompts():
        by_cat.setdefault(prompt.category, []).append(prompt)
    counts: dict[int, list[int]] = {}
    per_cat: dict[str, dict[int, list[int]]] = {}
    for cat, rows in by_cat.items():
        for prompt in rows[args.skip : args.skip + args.per_category]:
            ids = encode_prompt(target.tokenizer, prompt.text, chat=target.instruct)
            out = verispec.speculative_generate(
                target, None, ids, max_new_tokens=args.max_new_tokens, temperature=0
            )
            seq = list(ids) + out.token_ids
            walk(pl, seq, len(ids), counts)
            walk(pl, seq, len(ids), per_cat.setdefault(cat, {}))
    print(f"{'match length':>14}{'accepted':>10}{'seen':>7}")
    for b in range(len(LOOKUP_BUCKETS)):
        ok, seen = counts.get(b, [0, 0])
        lo = LOOKUP_BUCKETS[b]
        hi = LOOKUP_BUCKETS[b + 1] - 1 if b + 1 < len(LOOKUP_BUCKETS) else None
        name = f"{lo}" if hi == lo else f"{lo}-{hi}" if hi else f"{lo}+"
        print(f"{name:>14}{ok / seen if seen else float('nan'):10.2f}{seen:7d}")
    print(json.dumps({cat: {b: c for b, c in sorted(v.items())} for cat, v in per_cat.items()}))


if __name__ == "__main__":
    main()
