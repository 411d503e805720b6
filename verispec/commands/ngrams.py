"""Build an n-gram table of a target's own greedy answers (a drafter beside prompt lookup).

    verispec ngrams --model default --prompts 1200 --out DIR

The target answers verispec's own training prompts (:mod:`verispec.distill.prompts`; none from
Spec-Bench) greedily, a batch of rows at a time; the answers go to ``DIR/corpus.jsonl`` as they
come, so an interrupted run resumes where it stopped. The table written to ``DIR`` holds every
answer. Its chances of acceptance are calibrated leaving one prompt category out at a time: a
table of the other twelve categories' answers predicts the left-out one's. Held out at random
instead, the answers' close siblings (the same template on another topic) stay in the table, and
the estimates came out about twice what held-out Spec-Bench answers showed (session 31,
``benchmarks/DRAFTS.md``); left out by category, they matched them.

Use a table with ``verispec generate --ngrams DIR`` (``--ngrams`` alone: the table shipped for the
target) or ``verispec bench --methods lookup+ngrams --ngrams DIR``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from verispec.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="target: packaged name, .gguf file, HF folder, hub id")
    p.add_argument("--dtype", default="float32", help="weight format the target answers in")
    p.add_argument("--prompts", type=int, default=1200, help="training prompts to answer")
    p.add_argument("--max-new-tokens", type=int, default=192, help="longest answer, in tokens")
    p.add_argument("--seed", type=int, default=7, help="picks the prompts (verispec.distill.prompts)")
    p.add_argument("--batch-size", type=int, default=16, help="rows answered together")
    p.add_argument("--orders", type=int, default=4, help="longest context of the table, in tokens")
    p.add_argument("--out", required=True, help="folder for the table (and corpus.jsonl, the answers)")


def run(args: argparse.Namespace) -> int:
    if args.prompts < 2 or args.max_new_tokens < 1 or args.batch_size < 1 or args.orders < 1:
        raise ConfigError("--prompts must be >= 2; --max-new-tokens, --batch-size and --orders >= 1")
    from verispec.distill.data import offline_passages
    from verispec.distill.prompts import CATEGORIES, prompts_for
    from verispec.distill.shipped import target_id
    from verispec.models.loading import load_model, resolve

    resolve(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model, dtype=args.dtype, max_batch_size=args.batch_size, max_length=2048)
    prompts = prompts_for(args.prompts, offline_passages(), seed=args.seed)
    corpus = out / "corpus.jsonl"
    answer_all(target, prompts, corpus, args.max_new_tokens, args.batch_size)
    rows = [json.loads(line) for line in corpus.read_text().splitlines()][: args.prompts]
    meta = {
        "target_name": args.model,
        "target_id": target_id(target),
        "dtype": args.dtype,
        "command": "verispec ngrams " + shlex.join(sys.argv[sys.argv.index("ngrams") + 1 :])
        if "ngrams" in sys.argv
        else "verispec ngrams",
    }
    folds = [i % len(CATEGORIES) for i in range(len(rows))]  # each answer's prompt category
    table, meta = build(rows, args.orders, folds, meta)
    from verispec.ngrams import save_table

    save_table(out, table, meta)
    held = meta["calibration"]
    print(
        f"verispec ngrams: {len(table)} contexts from {meta['corpus']['tokens']} tokens; each prompt "
        f"category left out in turn, the table's token was the next one at {held['hit_rate']:.1%} of "
        f"its positions (it had one at {held['coverage']:.1%}); written to {out}",
        file=sys.stderr,
    )
    return 0


def answer_all(target, prompts: list[str], corpus: Path, max_new_tokens: int, batch_size: int) -> None:
    """Append the target's greedy answers to ``prompts`` (one JSON line each: ``prompt`` and
    ``answer`` token ids, the answer ending at its end-of-sequence token if it reached one) to
    ``corpus``, skipping the prompts answered by an earlier run."""
    from verispec.rejection import greedy_tokens
    from verispec.tokenizers import encode_prompt

    done = len(corpus.read_text().splitlines()) if corpus.is_file() else 0
    eos = set(getattr(target, "eos_token_ids", ()) or ())
    chat = bool(getattr(target, "instruct", False))
    room = target.max_length - max_new_tokens - 1
    t0, made = time.perf_counter(), 0
    with corpus.open("a") as f:
        for b in range(done, len(prompts), batch_size):
            ids = [encode_prompt(target.tokenizer, t, chat=chat)[-room:] for t in prompts[b : b + batch_size]]
            target.reset(len(ids))
            answers = [[greedy_tokens(target, [p], [row])[0][-1]] for row, p in enumerate(ids)]
            live = [row for row, a in enumerate(answers) if a[-1] not in eos]
            for _ in range(max_new_tokens - 1):
                if not live:
                    break
                best = greedy_tokens(target, [[answers[row][-1]] for row in live], live)  # [n][1]
                for row, (token,) in zip(live, best):
                    answers[row].append(token)
                made += len(live)
                live = [row for row in live if answers[row][-1] not in eos]
            for p, a in zip(ids, answers):
                f.write(json.dumps({"prompt": p, "answer": a}) + "\n")
            f.flush()
            rate = made / max(time.perf_counter() - t0, 1e-9)
            done_now = f"{b + len(ids)}/{len(prompts)}"
            print(f"verispec ngrams: {done_now} answered ({rate:.0f} tokens/s)", file=sys.stderr)


def build(rows: list[dict], orders: int, folds: list[int], meta: dict, context: int = 3):
    """The table of every answer in ``rows`` (each after the last ``context`` tokens of its prompt)
    and ``meta`` completed with its corpus, its ``prior`` and the calibration's figures.

    ``folds`` ``[S]`` labels each row (its prompt's category): each label's rows are predicted in
    turn by a table of all other rows, and the hits per share bucket over all of them give the
    ``prior`` (made non-decreasing, :func:`monotone`)."""
    from verispec.ngrams import SHARE_EDGES, NgramTable

    if len(set(folds)) < 2:
        raise ConfigError("calibration needs answers to prompts of at least two categories")
    seqs = [r["prompt"][-context:] + r["answer"] for r in rows]
    ctx = [min(context, len(r["prompt"])) for r in rows]
    hits, seen = [0] * len(SHARE_EDGES), [0] * len(SHARE_EDGES)
    for fold in sorted(set(folds)):
        rest = [i for i, f in enumerate(folds) if f != fold]
        out = [i for i, f in enumerate(folds) if f == fold]
        table = NgramTable([seqs[i] for i in rest], [ctx[i] for i in rest], orders=orders)
        h, s = table.calibrate([seqs[i] for i in out], [ctx[i] for i in out])
        hits, seen = [a + b for a, b in zip(hits, h)], [a + b for a, b in zip(seen, s)]
    positions = sum(len(s) - c for s, c in zip(seqs, ctx))
    meta = {
        **meta,
        "corpus": {
            "sequences": len(seqs),
            "tokens": sum(len(r["answer"]) for r in rows),
            "source": "the target's greedy answers to verispec's own prompts (verispec.distill.prompts)",
        },
        "share_edges": list(SHARE_EDGES),
        "prior": monotone([(h + 1) / (s + 2) for h, s in zip(hits, seen)], seen),
        "calibration": {
            "method": "each prompt category predicted by a table of the others",
            "folds": len(set(folds)),
            "positions": positions,
            "predictions": seen,
            "hits": hits,
            "coverage": sum(seen) / max(positions, 1),
            "hit_rate": sum(hits) / max(positions, 1),
        },
    }
    return NgramTable(seqs, ctx, orders=orders), meta


def monotone(values: list[float], weights: list[int]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (pool adjacent
    violators): a larger share of what followed a context never gets a lower estimate."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, float(max(w, 1)), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [round(b[0], 4) for b in blocks for _ in range(int(b[2]))]
