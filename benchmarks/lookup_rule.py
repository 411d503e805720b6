"""Replay prompt lookup's draft-length rule on held-out Spec-Bench outputs, without timing noise.

Speculation is lossless, so a greedy request emits the target's plain greedy output whatever is
drafted: given that output, every step of the engine can be replayed exactly (what
:class:`verispec.PromptLookup` proposes, where :func:`verispec.costs.best_draft_length` cuts it,
how many copied tokens the target confirms). Charging each step its width's cost from a fixed cost
curve, plus a fixed overhead per drafting step (the proposal itself, the rule, the bookkeeping),
gives the speedup over plain decoding the rule would get at that cost. This is how the lookup's
constants are chosen; the benchmark uses the first questions of each category, so this script uses
later ones (``--skip 5``).

    python benchmarks/lookup_rule.py generate --dtype int8 --skip 5 --per-category 4 --out /tmp/lr_int8.json
    python benchmarks/lookup_rule.py replay /tmp/lr_int8.json --cost int8 --rules 4/1,4/1.5
    python benchmarks/lookup_rule.py replay /tmp/lr_int8.json --cost int8-zen3 --rules 4/1/vote2 --adaptive
    python benchmarks/lookup_rule.py replay /tmp/lr_int8.json --cost int8-zen3 --rules 4/1/vote2 \
        --ngrams default

``ceiling`` replays each request with an oracle instead: at every step it drafts exactly the longest
run of the coming tokens that any piece of the request's own committed text holds, so it bounds what
any prompt-lookup drafter could reach on these outputs (tokens per target call, decode and
whole-request speedup at the machine's step costs, and with verification free):

    python benchmarks/lookup_rule.py generate --dtype int8 --skip 0 --per-category 10 --out /tmp/c.json
    python benchmarks/lookup_rule.py ceiling /tmp/c.json --ks 4,8 --anchors 0,1

``--ngrams DIR`` (``default``: the table shipped for the default model) adds a column for prompt
lookup with an n-gram table of the target's answers beside it (:class:`verispec.ngrams.NgramLookup`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

import torch

from verispec.bench.ceiling import copy_ceiling, oracle_seconds
from verispec.costs import best_draft_length
from verispec.ngrams import NgramLookup, load_table, shipped_table_for
from verispec.proposers import PromptLookup
from verispec.sampling import SamplingConfig, SamplingTensors

COST_CURVES = {
    # v(w): a step of w tokens over a one-token step, w = 1..9.
    # int8: what the engine measured for itself in session 3 (2/3/4 tokens: 1.17/1.25/1.69), then the
    # bench's 5-token figure (1.56-1.68) and 9 tokens at 2.91 (session 2), interpolated.
    "int8": (1.0, 1.17, 1.25, 1.69, 1.68, 1.99, 2.29, 2.60, 2.91),
    # float32: 5 tokens 1.20, 9 tokens 1.66 (sessions 2-3), linear between.
    "float32": (1.0, 1.05, 1.10, 1.15, 1.20, 1.315, 1.43, 1.545, 1.66),
    # Session 15, the Xeon, int8 (float16 cache), medians of 9 at 200 and at 1000 cached tokens
    # (2, 3, 5 and 9 tokens measured; 4, 6, 7 and 8 interpolated).
    "int8-200": (1.0, 1.06, 1.12, 1.175, 1.23, 1.385, 1.54, 1.695, 1.85),
    "int8-1000": (1.0, 1.09, 1.21, 1.31, 1.41, 1.615, 1.82, 2.025, 2.23),
    # Session 29, a 2-core Zen 3 EPYC (AVX2), run I's readings before the requests (benchmarks/
    # README.md): float32 read from its 4-bit blocks, and int8 (whose 2-token step read 0.93,
    # taken as 1).
    "float32-zen3": (1.0, 1.25, 1.56, 2.03, 2.17, 2.54, 3.32, 3.80, 3.88),
    "int8-zen3": (1.0, 1.0, 1.10, 1.21, 1.45, 1.48, 2.07, 2.12, 2.34),
}


def generate(args: argparse.Namespace) -> None:
    import verispec
    from verispec.bench.prompts import load_prompts
    from verispec.tokenizers import encode_prompt

    target = verispec.load_model("default", dtype=args.dtype)
    by_cat: dict[str, list] = {}
    for prompt in load_prompts():
        by_cat.setdefault(prompt.category, []).append(prompt)
    wanted = set(args.categories.split(",")) if args.categories else None
    warm = encode_prompt(target.tokenizer, "Say hello.", chat=target.instruct)
    verispec.speculative_generate(target, None, warm, max_new_tokens=8, temperature=0)  # warm-up
    rows = []
    for cat, prompts in by_cat.items():
        if wanted is not None and cat not in wanted:
            continue
        for prompt in prompts[args.skip : args.skip + args.per_category]:
            ids = encode_prompt(target.tokenizer, prompt.text, chat=target.instruct)
            out = verispec.speculative_generate(
                target, None, ids, max_new_tokens=args.max_new_tokens, temperature=0
            )
            rows.append(
                {
                    "category": cat,
                    "question_id": prompt.question_id,
                    "prompt": list(ids),
                    "output": out.token_ids,
                    "seconds": out.stats.seconds,
                    "prefill_seconds": out.stats.prefill_seconds,
                }
            )
    step_costs = getattr(target, "step_cost_prior", None)
    with open(args.out, "w") as f:
        json.dump({"dtype": args.dtype, "skip": args.skip, "step_costs": step_costs, "rows": rows}, f)


def replay_one(
    make: Callable[[], PromptLookup | NgramLookup],
    prompt: list[int],
    output: list[int],
    costs: Sequence[float],
    k: int,
    overhead: float,
    extra_cost_weight: float = 1.0,
    misjudged: float = 0.0,
    adaptive: bool = False,
) -> tuple[float, int, int]:
    """Replay one request: ``(cost in one-token steps, drafted, accepted)``. The rule sees ``costs``;
    a step of w tokens is charged ``costs[w - 1] + misjudged * (w - 1)`` (what the rule's figures
    missed). ``adaptive``: the draft cap moves as :func:`verispec.adaptive.adapt_k` moves it for a
    drafter whose drafts are cut by cost (from k, up by one after a fully accepted draft that used
    the whole cap, up to 2k; down towards the accepted length after a rejected one, never below k);
    ``costs`` then extends past its last width at its mean cost per extra token."""
    if adaptive and len(costs) < 2 * k + 2:
        per_token = (costs[-1] - 1.0) / (len(costs) - 1)
        costs = list(costs) + [costs[-1] + per_token * i for i in range(1, 2 * k + 3 - len(costs))]
    cap = k
    pl = make()
    params = SamplingTensors.from_configs([SamplingConfig(temperature=0.0)])
    seq = list(prompt) + output[:1]  # the first new token comes from the prompt's forward
    full = list(prompt) + output
    pl.start(0, seq)
    cost, drafted, accepted = 1.0, 0, 0
    while len(seq) < len(full):
        room = min(cap, len(full) - len(seq) - 1)
        n = 0
        if room > 0:
            prop = pl.propose([0], [seq], torch.tensor([room]), params, [None])
            m = int(prop.num_draft[0])
            if m:
                n = best_draft_length(prop.accept_probs[0, :m].tolist(), costs[: m + 1], extra_cost_weight)
            draft = prop.tokens[0, :n].tolist()
            cost += overhead
        else:
            draft = []
        at = len(seq)
        ok = 0
        while ok < n and full[at + ok] == draft[ok]:
            ok += 1
        cost += costs[n] + misjudged * n
        drafted += n
        accepted += ok
        if adaptive and n and n >= cap:
            cap = min(2 * k, cap + 1) if ok == n else max(k, min(cap - 1, ok + 1))
        seq = full[: at + ok + 1]
    return cost, drafted, accepted


def rules(specs: str) -> dict[str, tuple[Callable[[], PromptLookup | NgramLookup], float]]:
    """Rules named ``prior_weight/extra_cost_weight[/voteN]`` (:class:`PromptLookup`'s prior weight,
    :func:`best_draft_length`'s weight on extra cost, and N for :attr:`PromptLookup.vote_below`),
    comma-separated."""
    out: dict[str, tuple[Callable[[], PromptLookup | NgramLookup], float]] = {}
    for spec in specs.split(","):
        parts = spec.split("/")
        w, x = float(parts[0]), float(parts[1])
        vote = int(parts[2].removeprefix("vote")) if len(parts) > 2 else 0
        out[spec] = (lambda w=w, vote=vote: PromptLookup(prior_weight=w, vote_below=vote), x)
    return out


def cost_curve(name: str, data: dict) -> list[float]:
    """``COST_CURVES[name]``, or for ``machine`` the curve ``generate`` recorded (the model's
    ``step_cost_prior``, measured once per machine)."""
    if name != "machine":
        return list(COST_CURVES[name])
    if not data.get("step_costs"):
        raise SystemExit("this file has no step costs: generate it again, or pick a --cost curve")
    return list(data["step_costs"])


def replay(args: argparse.Namespace) -> None:
    data = json.load(open(args.data))
    costs = cost_curve(args.cost, data)
    rules_ = rules(args.rules)
    if args.ngrams:
        table, meta = ngram_table(args.ngrams)
        rules_["ngrams"] = (lambda: NgramLookup(table, meta["prior"]), 1.0)
    cats = list(dict.fromkeys(r["category"] for r in data["rows"]))
    print(f"{'category':>15}" + "".join(f"{n:>11}" for n in rules_))
    totals = {n: [0.0, 0] for n in rules_}
    worst = {n: 9.0 for n in rules_}
    for cat in cats + ["all"]:
        line = f"{cat:>15}"
        for name, (make, weight) in rules_.items():
            if cat == "all":
                cost, tokens = totals[name]
                line += f"{tokens / cost:11.3f}"
                continue
            cost = tokens = 0
            for r in data["rows"]:
                if r["category"] == cat:
                    c, _, _ = replay_one(
                        make,
                        r["prompt"],
                        r["output"],
                        costs,
                        args.k,
                        args.overhead,
                        weight,
                        args.misjudged,
                        args.adaptive,
                    )
                    cost, tokens = cost + c, tokens + len(r["output"])
            totals[name][0] += cost
            totals[name][1] += tokens
            worst[name] = min(worst[name], tokens / cost)
            line += f"{tokens / cost:11.3f}"
        print(line)
    print(f"{'worst':>15}" + "".join(f"{worst[n]:11.3f}" for n in rules_))


def ceiling(args: argparse.Namespace) -> None:
    """Per anchor and category: tokens per target call of the copy oracle at each k, its decode
    speedup over plain decoding at the cost curve, and its whole-request speedup with the prompt's
    measured time (``generate`` records it); ``free``: the whole-request speedup with every step
    costing one token's, a bound for any drafter of this kind at any verification cost."""
    data = json.load(open(args.data))
    costs = cost_curve(args.cost, data)
    ks = [int(x) for x in args.ks.split(",")]
    cats = list(dict.fromkeys(r["category"] for r in data["rows"]))
    print(f"cost curve ({args.cost}): " + " ".join(f"{c:.2f}" for c in costs))
    for anchor in (int(x) for x in args.anchors.split(",")):
        where = "any source" if anchor == 0 else f"sources after a {anchor}-token match"
        print(f"\nanchor {anchor}: {where}")
        head = f"{'category':>15}{'prompt%':>8}"
        for k in ks:
            head += f"{f'k={k} tok/call':>16}{'decode':>8}{'whole':>7}{'free':>7}"
        print(head)
        for cat in cats + ["all"]:
            rows = [r for r in data["rows"] if cat in ("all", r["category"])]
            print(_ceiling_line(cat, rows, costs, ks, anchor))


def _ceiling_line(cat: str, rows: list[dict], costs: Sequence[float], ks: list[int], anchor: int) -> str:
    """One category's line of :func:`ceiling`'s table."""
    timed = all("seconds" in r for r in rows)
    plain = sum(r["seconds"] for r in rows) if timed else 0.0
    line = f"{cat:>15}"
    line += f"{100 * sum(r['prefill_seconds'] for r in rows) / plain:8.0f}" if timed else f"{'-':>8}"
    for k in ks:
        tokens = calls = 0
        oracle_steps = whole = free = 0.0
        for r in rows:
            cost, n_calls = copy_ceiling(r["prompt"], r["output"], costs, k, anchor)
            steps = len(r["output"]) - 1
            tokens, calls, oracle_steps = tokens + steps, calls + n_calls, oracle_steps + cost - 1.0
            if timed:
                whole += oracle_seconds(r["seconds"], r["prefill_seconds"], steps, cost - 1.0)
                free += oracle_seconds(r["seconds"], r["prefill_seconds"], steps, n_calls)
        line += f"{tokens / max(1, calls):16.2f}{tokens / max(1e-9, oracle_steps):8.2f}"
        line += f"{plain / whole:7.2f}{plain / free:7.2f}" if timed else f"{'-':>7}{'-':>7}"
    return line


def ngram_table(where: str):
    """``(table, meta)`` of ``--ngrams``: a folder, or ``default`` for the default model's."""
    if where != "default":
        return load_table(where)
    import verispec

    found = shipped_table_for(verispec.load_model("default"))
    if found is None:
        raise SystemExit("no n-gram table is shipped for the default model")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="plain greedy outputs of held-out prompts")
    g.add_argument("--dtype", default="int8")
    g.add_argument("--skip", type=int, default=5, help="questions per category the benchmark uses")
    g.add_argument("--per-category", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--categories", default=None, help="comma-separated; default all")
    g.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="decode speedup over plain decoding per category, per rule")
    r.add_argument("data")
    r.add_argument("--cost", choices=sorted(COST_CURVES) + ["machine"], default="int8")
    r.add_argument("-k", type=int, default=8)
    r.add_argument(
        "--overhead",
        type=float,
        default=0.015,
        help="cost of proposing, per drafting step, in one-token steps",
    )
    r.add_argument("--rules", default="4/1,4/1.5", help="prior_weight/extra_cost_weight, comma-separated")
    r.add_argument(
        "--misjudged", type=float, default=0.0, help="true cost per drafted token above what the rule sees"
    )
    r.add_argument("--adaptive", action="store_true", help="the draft cap adapts from k (as --adaptive does)")
    r.add_argument("--ngrams", default=None, help="also replay lookup with this n-gram table ('default')")
    c = sub.add_parser("ceiling", help="what the best drafter copying the request's own text could reach")
    c.add_argument("data")
    c.add_argument("--cost", choices=sorted(COST_CURVES) + ["machine"], default="machine")
    c.add_argument("--ks", default="4,8", help="draft caps, comma-separated")
    c.add_argument("--anchors", default="0,1", help="tokens a source's context must match, comma-separated")
    args = p.parse_args()
    {"generate": generate, "replay": replay, "ceiling": ceiling}[args.cmd](args)


if __name__ == "__main__":
    main()
