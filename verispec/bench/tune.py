"""Measure a workload's draft cost c and acceptance a, and pick the draft length k.

The pick maximises the expected speedup ``(1 - a^(k+1)) / ((1 - a)(k c + v(k)))`` (Leviathan et al.,
2023), with the target's cost ``v(k)`` of verifying k + 1 tokens measured on this machine instead of
taken as 1, and, for drafters that sometimes find nothing (prompt lookup), weighted by the fraction
of steps that draft (see :mod:`verispec.bench.measure`). ``a`` is measured by generating the workload
at a probe k; a category where no k beats plain decoding gets k = 0.

Prompt lookup (alone or with an n-gram table) cuts each draft to the length its estimates say pays,
so few steps verify k tokens and the formula at k foretold too little for large k and too much for
small (session 32: it picked k = 2 at 1.31x for lookup with the table in int8, where replaying the
same decisions at the measured costs gives 1.35x for k = 2 and 1.37x for 3 to 8). For these the
workload runs at k = ``--k-max`` and the prediction for each k takes the draft lengths verified,
each cut to at most k (:func:`~verispec.bench.measure.predicted_speedup_by_length`), as the bench
predicts.
"""

from __future__ import annotations

import argparse
import json

from verispec.bench.measure import (
    conditional_acceptance,
    draft_fraction,
    draft_lengths,
    eagle_token_seconds,
    forward_seconds,
    lookup_seconds,
    predicted_speedup,
    predicted_speedup_by_length,
    table_seconds,
    verify_costs,
)
from verispec.bench.methods import MethodConfig, Sampling, run_ours
from verispec.bench.prompts import load_prompts, select
from verispec.commands.common import (
    add_device_argument,
    add_ngrams_argument,
    add_sampling_arguments,
    one_drafter,
    sampling_config,
)
from verispec.config import ConfigError
from verispec.models.fast_llama import DTYPES
from verispec.ngrams import NgramLookup
from verispec.proposers import DraftModelProposer, PromptLookup
from verispec.stats import GenerationStats


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``verispec tune``."""
    p.add_argument(
        "--model", default="default", help="target: packaged name, .gguf file, HF folder or hub id"
    )
    p.add_argument(
        "--draft-model", default=None, help="draft model (default: the shipped draft, else lookup)"
    )
    p.add_argument("--prompt-lookup", action="store_true", help="tune n-gram prompt lookup")
    add_ngrams_argument(
        p, "tune prompt lookup with an n-gram table of the target's answers (the shipped one, or DIR)"
    )
    p.add_argument(
        "--prompts", default=None, help="Spec-Bench-format .jsonl (default: the shared Spec-Bench file)"
    )
    p.add_argument("--categories", default=None, help="comma list (default: every category)")
    p.add_argument("--per-category", type=int, default=2, help="prompts per category (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--probe-k",
        type=int,
        default=None,
        help="draft length used to measure acceptance (default: 4 for a draft model; --k-max for "
        "prompt lookup, whose drafts are cut by cost)",
    )
    p.add_argument("--k-max", type=int, default=12, help="largest k considered")
    add_sampling_arguments(p)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weight format of the target")
    p.add_argument("--backend", default="auto", choices=["auto", "fast", "hf"])
    add_device_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Measure costs and acceptance, then print the expected speedup per k and the pick."""
    if args.probe_k is not None and not 1 <= args.probe_k <= 64:
        raise ConfigError(f"--probe-k must lie in 1..64, got {args.probe_k}")
    if not 1 <= args.k_max <= 32:
        raise ConfigError(f"--k-max must lie in 1..32, got {args.k_max}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    one_drafter(
        (
            ("--prompt-lookup", args.prompt_lookup),
            ("--draft-model", args.draft_model),
            ("--ngrams", args.ngrams),
        )
    )
    sampling = sampling_config(args)
    categories = [c.strip() for c in (args.categories or "").split(",") if c.strip()] or None
    prompts = select(load_prompts(args.prompts), categories, args.per_category)
    from verispec.commands.drafters import build_proposer
    from verispec.distill.eagle import EagleProposer
    from verispec.models.loading import load_model, resolve
    from verispec.tokenizers import encode_prompt

    resolve(args.model)
    target = load_model(args.model, backend=args.backend, dtype=args.dtype, device=args.device)
    # No drafter named: tune the shipped draft alone (build_proposer falls back to lookup without one);
    # the default drafter's mixture with lookup has no single k to tune.
    name = args.draft_model or (None if args.prompt_lookup or args.ngrams else "default")
    proposer = build_proposer(target, name, args.prompt_lookup, backend=args.backend, ngrams=args.ngrams)
    if isinstance(proposer, NgramLookup):
        method = "lookup+ngrams"
    else:
        method = "prompt-lookup" if isinstance(proposer, PromptLookup) else "draft-model"

    step = forward_seconds(target, [1], greedy=sampling.greedy)[1]
    if isinstance(proposer, DraftModelProposer):
        draft_cost = forward_seconds(proposer.model, [1])[1] / step
    elif isinstance(proposer, EagleProposer):
        draft_cost = eagle_token_seconds(proposer) / step
    elif isinstance(proposer, NgramLookup):  # each step asks lookup, then the table
        draft_cost = (lookup_seconds(proposer.lookup) + table_seconds(proposer.table)) / step
    else:
        draft_cost = lookup_seconds(proposer) / step
    verify = verify_costs(target, list(range(1, args.k_max + 2)), greedy=sampling.greedy)

    cut_by_cost = method != "draft-model"  # lookup drafts only what its estimates say pays
    if args.probe_k is None:
        args.probe_k = args.k_max if cut_by_cost else 4
    req = Sampling(args.max_new_tokens, sampling, args.seed)
    cfg = MethodConfig(method, args.probe_k)
    per_cat: dict[str, GenerationStats] = {}
    total = GenerationStats()
    for p in prompts:
        ids = encode_prompt(target.tokenizer, p.text, chat=target.instruct)
        stats = run_ours(target, proposer, ids, cfg, req).stats
        per_cat.setdefault(p.category, GenerationStats()).merge(stats)
        total.merge(stats)
    per_cat["all"] = total

    report = {"model": args.model, "method": method, "draft_cost": draft_cost, "probe_k": args.probe_k,
              "verify_cost_by_tokens": {str(t): v for t, v in verify.items()}, "categories": {}}  # fmt: skip
    for cat, stats in per_cat.items():
        a = conditional_acceptance(stats)
        f = 1.0 if method == "draft-model" else draft_fraction(stats)  # lookup drafts only on a match
        if cut_by_cost:  # the draft lengths verified at the probe, each capped at k
            lengths = draft_lengths(stats)
            curve = {
                k: predicted_speedup_by_length(a, capped(lengths, k), draft_cost, verify) or 1.0
                for k in range(1, args.k_max + 1)
            }
        else:
            curve = {
                k: predicted_speedup(a, k, draft_cost, verify[k + 1], f) for k in range(1, args.k_max + 1)
            }
        best = max(curve, key=curve.get)
        report["categories"][cat] = {
            "acceptance": a, "acceptance_rate": stats.acceptance_rate, "draft_fraction": f,
            "expected_speedup": {str(k): s for k, s in curve.items()},
            "best_k": best if curve[best] > 1.0 else 0, "best_expected_speedup": max(1.0, curve[best]),
        }  # fmt: skip
    if args.json:
        print(json.dumps(report))
    else:
        print(_format(report))
    return 0


def capped(lengths: list[int], k: int) -> list[int]:
    """Calls by draft length (:func:`~verispec.bench.measure.draft_lengths`) had every draft been cut
    to at most ``k`` tokens: ``[n_0, .., n_k]``."""
    return [*lengths[:k], sum(lengths[k:])] if len(lengths) > k else list(lengths)


def _format(report: dict) -> str:
    """The human-readable table: expected speedup per k for each category, and the pick."""
    ks = list(next(iter(report["categories"].values()))["expected_speedup"])
    lines = [
        f"{report['method']} on {report['model']}: draft cost c = {report['draft_cost']:.3f} target steps "
        f"per draft token; acceptance measured at k = {report['probe_k']}",
        "verify cost v(k) = forward over k+1 tokens / 1 token: "
        + " ".join(f"{int(t) - 1}:{v:.2f}" for t, v in report["verify_cost_by_tokens"].items() if int(t) > 1),
        "expected speedup per k:",
        f"{'category':<16}{'a':>6}{'drafts':>8}" + "".join(f"{'k=' + k:>7}" for k in ks) + "   best k",
    ]
    for cat, c in report["categories"].items():
        curve = "".join(f"{c['expected_speedup'][k]:7.2f}" for k in ks)
        lines.append(
            f"{cat:<16}{c['acceptance']:6.2f}{c['draft_fraction']:8.0%}{curve}   "
            f"{c['best_k']} ({c['best_expected_speedup']:.2f}x)"
        )
    return "\n".join(lines)
