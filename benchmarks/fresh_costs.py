"""How a fresh process prices its first drafts: the constant prior against the machine's curve.

Each `verispec generate` is a fresh process, and the engine chooses every draft's length by what
verifying it costs (:mod:`verispec.costs`). Until it has timed each width itself it used a guess of
5% per extra token; since session 29 it starts from the curve measured once on this machine
(``FastLlama.step_cost_prior``, :func:`verispec.models.schedule.apply_step_costs`). This loads the
default model once and runs each prompt (the README's chat prompt, then the first N of each
Spec-Bench category) greedily with prompt lookup, each run on fresh step costs as a new process
would have them, in four configurations in a seeded random order per prompt and round:

- ``plain``: plain decoding;
- ``guess``: prompt lookup, fresh costs starting from 5% per extra token (before session 29);
- ``measured``: prompt lookup, fresh costs starting from the machine's curve (now);
- ``warm``: prompt lookup, one set of costs shared by every run (a long-lived server).

Each keeps its fastest of ``--rounds`` rounds per prompt. Prints the whole-request speedup over
plain decoding, the draft tokens verified and accepted, and whether every output equals plain
decoding's. Run it alone on the machine (``flock /tmp/verispec-cpu.lock``).

    python benchmarks/fresh_costs.py [--dtype float32] [--per-category 1] [--rounds 3]
        [--max-new-tokens 128] [-k 8]
"""

from __future__ import annotations

import argparse
import random
import time

from verispec.adaptive import adapt_k
from verispec.bench.prompts import load_prompts, select
from verispec.config import GenerationConfig, SamplingConfig
from verispec.costs import StepCosts
from verispec.engine import Engine
from verispec.models.loading import load_model
from verispec.proposers import PromptLookup
from verispec.tokenizers import encode_prompt

KINDS = ("plain", "guess", "measured", "warm")
README_PROMPT = "Explain speculative decoding in two sentences."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=8, help="draft cap (adaptive, as the CLI's --adaptive)")
    args = ap.parse_args()

    model = load_model("default", dtype=args.dtype)
    prior = model.step_cost_prior
    print("measured curve v(1..):", [round(v, 2) for v in prior] if prior else None)
    texts = [("readme", README_PROMPT)]
    texts += [(p.category, p.text) for p in select(load_prompts(), None, args.per_category)]
    prompts = [encode_prompt(model.tokenizer, text, chat=True) for _, text in texts]
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.k,
        sampling=SamplingConfig(temperature=0.0),
        adaptive=True,
    )
    shared = StepCosts(prior)

    def run(kind: str, prompt: list[int]) -> tuple[float, list[int], int, int]:
        """(seconds, output ids, draft tokens verified, accepted) of one request."""
        costs = {"guess": StepCosts(), "measured": StepCosts(prior), "warm": shared}.get(kind)
        proposer = None if kind == "plain" else PromptLookup()
        engine = Engine(model, proposer, eos_token_ids=model.eos_token_ids, adaptive=adapt_k, costs=costs)
        seq = engine.new_sequence(prompt, config)
        start = time.perf_counter()
        for _ in engine.run([seq]):
            pass
        stats = seq.stats
        drafted, accepted = sum(stats.drafted_per_position), sum(stats.accepted_per_position)
        return time.perf_counter() - start, list(seq.output_ids), drafted, accepted

    for kind in KINDS:  # warm-up, uncounted
        run(kind, prompts[0])
    best = {kind: [float("inf")] * len(prompts) for kind in KINDS}
    last: dict[str, list[tuple[list[int], int, int]]] = {kind: [([], 0, 0)] * len(prompts) for kind in KINDS}
    order = random.Random(0)
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            kinds = list(KINDS)
            order.shuffle(kinds)
            for kind in kinds:
                seconds, out, drafted, accepted = run(kind, prompt)
                best[kind][i] = min(best[kind][i], seconds)
                last[kind][i] = (out, drafted, accepted)
    plain = sum(best["plain"])
    for kind in KINDS:
        same = all(last[kind][i][0] == last["plain"][i][0] for i in range(len(prompts)))
        drafted = sum(d for _, d, _ in last[kind])
        accepted = sum(a for _, _, a in last[kind])
        print(
            f"{kind:9s} {sum(best[kind]):7.2f} s  speedup {plain / sum(best[kind]):.3f}  "
            f"README prompt {best['plain'][0] / best[kind][0]:.3f}  drafted {drafted}  "
            f"accepted {accepted}  outputs same {same}"
        )


if __name__ == "__main__":
    main()
