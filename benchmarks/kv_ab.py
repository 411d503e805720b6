"""One weight format over a float16 KV cache and over a bfloat16 one, side by side.

Two copies of the default model in ``--dtype`` (int4 or w4a8) on the kernel: one with the float16
cache every format but float32 holds by default, the other with ``VERISPEC_KV_CACHE=bfloat16``,
whose attention runs in bfloat16 products (the kernel's ``attention_bf16``). For each prompt (the
first N of each Spec-Bench category, as ``verispec bench`` picks them), plain greedy decoding and
prompt lookup with the shipped n-gram table run on both, in an order rotated per prompt, each
configuration keeping its fastest of ``--repeats`` rounds. Prints whole-request and decode-only
tokens/s per configuration, over all prompts and for the long-prompt categories, the geometric mean
over categories of each speedup, and checks that the drafter's output equals plain decoding's on
each copy (the two copies' outputs may differ: their attention rounds differently; how many prompts
they agree on is printed). Run it alone on the machine (``flock /tmp/verispec-cpu.lock``).

    python benchmarks/kv_ab.py [--dtype w4a8] [--per-category 2] [--repeats 2] [-k 4]
        [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import math
import os

from side_by_side import fastest_rounds, generate

import verispec
from verispec.bench.prompts import load_prompts, select
from verispec.ngrams import NgramLookup
from verispec.tokenizers import encode_prompt

CONFIGS = ("plain/float16", "plain/bfloat16", "table/float16", "table/bfloat16")
LONG = ("summarization", "rag")  # Spec-Bench's long prompts (660-770 tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="w4a8", choices=["int4", "w4a8"])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("-k", type=int, default=4, help="draft tokens per step for the drafter")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    before = os.environ.get("VERISPEC_KV_CACHE")
    targets = {}
    try:
        for cache in ("float16", "bfloat16"):
            os.environ["VERISPEC_KV_CACHE"] = cache
            targets[cache] = verispec.load_model("default", max_length=2048, dtype=args.dtype)
    finally:
        if before is None:
            os.environ.pop("VERISPEC_KV_CACHE", None)
        else:
            os.environ["VERISPEC_KV_CACHE"] = before
    drafters = {cache: NgramLookup.shipped(t) for cache, t in targets.items()}
    if any(d is None for d in drafters.values()):
        raise SystemExit("no n-gram table is shipped for the default model")

    def run(ids: list[int], config: str):
        method, cache = config.split("/")
        drafter = drafters[cache] if method == "table" else None
        return generate(targets[cache], drafter, ids, args.max_new_tokens, args.k)

    warm = encode_prompt(targets["float16"].tokenizer, "Hi", chat=True)
    for config in CONFIGS:
        run(warm, config)
    tokens = collections.defaultdict(collections.Counter)  # category -> config -> new tokens
    decode = collections.defaultdict(lambda: collections.defaultdict(float))
    seconds = collections.defaultdict(lambda: collections.defaultdict(float))
    same = prompts = 0
    for n, prompt in enumerate(select(load_prompts(), None, args.per_category)):
        ids = encode_prompt(targets["float16"].tokenizer, prompt.text, chat=True)
        best = fastest_rounds(CONFIGS, run, ids, n, args.repeats)
        for config, result in best.items():
            want = best["plain/" + config.split("/")[1]]
            assert result.token_ids == want.token_ids, (prompt.question_id, config)
            s = result.stats
            tokens[prompt.category][config] += s.new_tokens
            decode[prompt.category][config] += s.seconds - s.prefill_seconds
            seconds[prompt.category][config] += s.seconds
        prompts += 1
        same += best["plain/float16"].token_ids == best["plain/bfloat16"].token_ids

    def rates(categories) -> str:
        cells = []
        for config in CONFIGS:
            t = sum(tokens[c][config] for c in categories)
            whole = sum(seconds[c][config] for c in categories)
            dec = sum(decode[c][config] for c in categories)
            cells.append(f"{config} {t / whole:.1f} / {t / dec:.1f}")
        return ", ".join(cells)

    print(f"{args.dtype}, tokens/s whole request / decode-only:")
    print(f"  all {prompts} prompts: {rates(list(seconds))}")
    print(f"  {' and '.join(LONG)}: {rates([c for c in LONG if c in seconds])}")

    def geomean(num: str, den: str, categories) -> float:
        logs = [math.log(seconds[c][num] / seconds[c][den]) for c in categories]
        return math.exp(sum(logs) / len(logs))

    every, long = list(seconds), [c for c in LONG if c in seconds]
    print("whole-request speedup, geometric mean over categories (all / long prompts):")
    for label, num, den in (
        ("plain, bfloat16 over float16", "plain/float16", "plain/bfloat16"),
        ("table, bfloat16 over float16", "table/float16", "table/bfloat16"),
        ("table over plain, float16", "plain/float16", "table/float16"),
        ("table over plain, bfloat16", "plain/bfloat16", "table/bfloat16"),
    ):
        print(f"  {label:30s} {geomean(num, den, every):.3f}x / {geomean(num, den, long):.3f}x")
    print("the drafter's output equals plain decoding's on each copy")
    print(f"plain outputs on the two copies identical on {same} of {prompts} prompts")


if __name__ == "__main__":
    main()
