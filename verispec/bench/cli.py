"""Benchmark speculative methods and peers on Spec-Bench prompts; write results.json, a table and plots.

Every method runs on the same prompts in the same run, interleaved prompt by prompt; speedups are
against the same engine's plain decoding. Peers: transformers ``generate`` (plain, prompt lookup,
assisted) and llama.cpp (plain, prompt lookup) when llama-cpp-python is installed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from verispec.bench.ceiling import add_copy_ceilings
from verispec.bench.measure import (
    bandwidth_probe,
    by_placement,
    conditional_acceptance,
    core_roundtrip_ns,
    draft_lengths,
    forward_seconds,
    load_average,
    lookup_seconds,
    machine_info,
    memory_bandwidth,
    predicted_speedup_by_length,
    table_seconds,
    verify_costs,
    weight_bytes,
)
from verispec.bench.methods import METHODS, OURS, SPECULATIVE, MethodConfig, Sampling, run_ours
from verispec.bench.peers import (
    HFPeer,
    LlamaCppPeer,
    llama_cpp_available,
    llama_cpp_failure,
    llama_cpp_failure_note,
)
from verispec.bench.prompts import load_prompts, select
from verispec.bench.report import goal_checks, markdown, plot_all
from verispec.bench.runner import ALL, aggregate, run_interleaved
from verispec.commands.common import add_device_argument, add_sampling_arguments, sampling_config
from verispec.config import ConfigError
from verispec.models.fast_llama import DTYPES
from verispec.models.schedule import cpu_name
from verispec.proposers import DraftModelProposer, PromptLookup
from verispec.stats import GenerationStats

DEFAULT_METHODS = ",".join(METHODS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``verispec bench``."""
    p.add_argument(
        "--prompts",
        default=None,
        help="Spec-Bench-format .jsonl (default ../shared/data/spec_bench/question.jsonl from the repo)",
    )
    p.add_argument("--categories", default=None, help="comma list (default: every category in the file)")
    p.add_argument(
        "--per-category", type=int, default=None, help="first N prompts of each category (default all)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_arguments(p)
    p.add_argument(
        "--model", default="default", help="target: packaged name, .gguf file, HF folder or hub id"
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft for draft-model and hf-assisted (default: the shipped draft, if any)",
    )
    p.add_argument(
        "--ngrams",
        default=None,
        metavar="DIR",
        help="n-gram table for lookup+ngrams (default: the one shipped for the target, if any)",
    )
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list from: {DEFAULT_METHODS}")
    p.add_argument(
        "--num-speculative-tokens",
        "-k",
        default="4",
        help="draft length, or a comma list of them to sweep (e.g. 2,4,8)",
    )
    p.add_argument(
        "--adaptive",
        choices=["none", "add", "only"],
        default="add",
        help="adaptive-k rows for our speculative methods (start k: the middle of the sweep)",
    )
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.0,
        help="adaptive draft-model rows stop drafting below this draft confidence",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="our weight format(s), comma list of float32, bfloat16, int8, int4, w4a8; each its own plain "
        "baseline",
    )
    p.add_argument("--backend", default="auto", choices=["auto", "fast", "hf"])
    add_device_argument(p)
    p.add_argument("--out", default="bench-results", help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every method per prompt; each keeps its fastest (default 1)",
    )


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer or a comma list of integers, got {text!r}") from exc
    if not values or any(v < 1 or v > 64 for v in values):
        raise ConfigError(f"{name} values must lie in 1..64, got {text!r}")
    return sorted(dict.fromkeys(values))


def _names(text: str | None) -> list[str]:
    return [v.strip() for v in (text or "").split(",") if v.strip()]


def parse_options(args: argparse.Namespace) -> tuple[list[str], list[int], list[str]]:
    """Validated (methods, k values, dtypes); raises ConfigError before anything loads."""
    methods = _names(args.methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ConfigError(
            f"unknown methods {', '.join(unknown) or '(none given)'}; choose from {DEFAULT_METHODS}"
        )
    ks = _int_list(args.num_speculative_tokens, "--num-speculative-tokens")
    dtypes = _names(args.dtype) or ["float32"]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ConfigError(f"unknown --dtype {', '.join(bad)}; choose from {', '.join(DTYPES)}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if not 0.0 <= args.confidence_threshold < 1.0:
        raise ConfigError(f"--confidence-threshold must lie in [0, 1), got {args.confidence_threshold}")
    return methods, ks, dtypes


def build_configs(methods: list[str], ks: list[int], dtypes: list[str], adaptive: str) -> list[MethodConfig]:
    """Every column of the run; our plain decoding in each dtype always comes along (the baseline)."""
    configs = [MethodConfig("autoregressive", dtype=d) for d in dtypes]
    start_k = ks[len(ks) // 2]
    for m in methods:
        if m == "autoregressive":
            continue
        for d in dtypes if m in OURS else ["float32"]:
            if m not in SPECULATIVE:
                configs.append(MethodConfig(m))
                continue
            if adaptive != "only" or m not in OURS:
                configs.extend(MethodConfig(m, k, dtype=d) for k in ks)
            if adaptive != "none" and m in OURS:
                configs.append(MethodConfig(m, start_k, adaptive=True, dtype=d))
    base_peers = {
        "hf-prompt-lookup": "hf-generate",
        "hf-assisted": "hf-generate",
        "llama.cpp-prompt-lookup": "llama.cpp",
    }
    for m, base in base_peers.items():  # a peer's speedup needs its own plain decoding
        if m in methods and MethodConfig(base) not in configs:
            configs.append(MethodConfig(base))
    return list(dict.fromkeys(configs))


def _load_targets(args: argparse.Namespace, dtypes: list[str]) -> dict[str, object]:
    from verispec.models.loading import load_model, wrap

    targets: dict[str, object] = {}
    for d in dtypes:
        try:
            if not targets:
                targets[d] = load_model(args.model, backend=args.backend, dtype=d, device=args.device)
            else:
                first = next(iter(targets.values()))
                kv = wrap(first.hf_model, first.tokenizer, backend=args.backend, dtype=d)
                kv.name, kv.instruct = first.name, first.instruct
                targets[d] = kv
        except ValueError as exc:  # a backend refusing a weight format
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"--dtype {d}: {exc}") from exc
    return targets


def _draft_kv(draft):
    """The draft's own cached model, for a draft-model or an EAGLE proposer."""
    return draft.model if isinstance(draft, DraftModelProposer) else draft.draft


def _draft(args: argparse.Namespace, target, notes: list[str]):
    """The proposer behind the draft-model rows: a :class:`DraftModelProposer` or an EAGLE head."""
    from verispec.commands.drafters import build_proposer, shipped_draft_for
    from verispec.distill.eagle import EagleProposer

    if args.draft_model in (None, "default"):
        proposer = shipped_draft_for(target)
        if proposer is None:
            notes.append(
                "no --draft-model given and no shipped draft for this target yet: "
                "draft-model, lookup+draft and hf-assisted skipped"
            )
            return None
    else:
        proposer = build_proposer(target, args.draft_model, False, backend=args.backend)
    if not isinstance(proposer, (DraftModelProposer, EagleProposer)):
        notes.append(
            "the draft resolved to no draft model: draft-model, lookup+draft and hf-assisted skipped"
        )
        return None
    return proposer


def _ngrams(args: argparse.Namespace, target, notes: list[str]):
    """The drafter behind the lookup+ngrams rows: lookup with ``--ngrams DIR`` or the shipped table."""
    from verispec.ngrams import NgramLookup

    if args.ngrams is not None:
        return NgramLookup.for_target(target, Path(args.ngrams).expanduser())
    found = NgramLookup.shipped(target)
    if found is None:
        notes.append("no --ngrams given and no n-gram table shipped for this target: lookup+ngrams skipped")
    return found


def run(args: argparse.Namespace) -> int:
    """Validate, load, measure costs, run interleaved, write results."""
    methods, ks, dtypes = parse_options(args)
    sampling = sampling_config(args)
    prompts = select(load_prompts(args.prompts), _names(args.categories) or None, args.per_category)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    from verispec.models.loading import resolve

    resolve(args.model)
    notes: list[str] = []
    t0 = time.perf_counter()
    machine = machine_info()

    def say(msg: str) -> None:
        print(f"verispec bench [{time.perf_counter() - t0:5.0f} s]: {msg}", file=sys.stderr, flush=True)

    say(f"{len(prompts)} prompts; loading {args.model}")

    targets = _load_targets(args, dtypes)
    main = targets[dtypes[0]]
    tokenizer = main.tokenizer
    encoded = [encode(tokenizer, p.text, main.instruct) for p in prompts]

    draft = None
    if {"draft-model", "hf-assisted", "lookup+draft"} & set(methods):
        draft = _draft(args, main, notes)
        if draft is None:
            methods = [m for m in methods if m not in ("draft-model", "hf-assisted", "lookup+draft")]
        elif "hf-assisted" in methods and getattr(_draft_kv(draft), "hf_model", None) is None:
            notes.append("the draft is no transformers model (a distilled draft): hf-assisted skipped")
            methods.remove("hf-assisted")
    table_lookup = None
    if "lookup+ngrams" in methods:
        table_lookup = _ngrams(args, main, notes)
        if table_lookup is None:
            methods = [m for m in methods if m != "lookup+ngrams"]
    llama = None
    if {"llama.cpp", "llama.cpp-prompt-lookup"} & set(methods):
        kind, where = resolve(args.model)
        if not llama_cpp_available():
            notes.append(
                "llama-cpp-python is not installed (pip install 'verispec[llama-cpp]'): llama.cpp skipped"
            )
        elif kind != "gguf":
            notes.append("llama.cpp needs a GGUF model; the target is not one: llama.cpp skipped")
        elif (failure := llama_cpp_failure(Path(where), torch.get_num_threads())) is not None:
            notes.append(llama_cpp_failure_note(failure, cpu_name()))
        else:
            longest = max(len(ids) for ids in encoded) + args.max_new_tokens + 64
            llama = LlamaCppPeer(
                Path(where),
                list(main.eos_token_ids),
                n_ctx=max(2048, longest),
                threads=torch.get_num_threads(),
            )
            notes.append(f"llama.cpp runs {Path(where).name} (its own weight format)")
        if llama is None:
            methods = [m for m in methods if not m.startswith("llama.cpp")]
    for note in notes:
        say(note)

    configs = build_configs(methods, ks, dtypes, args.adaptive)
    req = Sampling(args.max_new_tokens, sampling, args.seed)
    hf = HFPeer(
        main.hf_model,
        list(main.eos_token_ids),
        None if draft is None else getattr(_draft_kv(draft), "hf_model", None),
    )
    lookup = PromptLookup()
    proposers = {}
    for d in targets:
        if isinstance(draft, DraftModelProposer):
            proposers[("draft-model", d, False)] = DraftModelProposer(draft.model)
            proposers[("draft-model", d, True)] = DraftModelProposer(
                draft.model, confidence_threshold=args.confidence_threshold
            )
        elif draft is not None:  # an EAGLE head reads the hidden states of the target it drafts for
            from verispec.distill.eagle import EagleProposer
            from verispec.distill.model import DraftKV
            from verispec.distill.shipped import draft_weights_for

            kv, weights = draft.draft, draft_weights_for(targets[d])
            if kv.weights != weights:  # the format load_draft would have chosen for this target
                kv = DraftKV(kv.model, kv.tokenizer, max_length=kv.max_length, weights=weights)
            proposers[("draft-model", d, False)] = proposers[("draft-model", d, True)] = EagleProposer(
                targets[d], kv
            )
        proposers[("prompt-lookup", d, False)] = proposers[("prompt-lookup", d, True)] = lookup
        if table_lookup is not None:
            proposers[("lookup+ngrams", d, False)] = proposers[("lookup+ngrams", d, True)] = table_lookup
        if draft is not None:  # the default drafter: lookup first, the draft where lookup has nothing
            from verispec.costs import costs_for
            from verispec.lookup_first import LookupFirst

            mixed = LookupFirst(proposers[("draft-model", d, False)], costs=costs_for(targets[d]))
            proposers[("lookup+draft", d, False)] = proposers[("lookup+draft", d, True)] = mixed

    def runner_for(cfg: MethodConfig):
        if cfg.method in OURS:
            target = targets[cfg.dtype]
            proposer = proposers.get((cfg.method, cfg.dtype, cfg.adaptive))
            return lambda ids, c, r: run_ours(target, proposer, ids, c, r)
        if cfg.method.startswith("hf-"):
            return hf.run
        return llama.run

    runners = {cfg: runner_for(cfg) for cfg in configs}

    say("measuring memory bandwidth and forward costs")
    device = getattr(next(iter(targets.values())), "device", "cpu")
    probe = bandwidth_probe(device=device)  # one 512 MiB tensor for every reading of the run
    bandwidth_before = memory_bandwidth(probe=probe)
    # 5: verify_cost_ratio; 2 .. k + 1: the predictions, from the draft lengths each k verified
    widths = sorted({1, 5, *range(2, max(ks, default=0) + 2)})
    step_seconds: dict[str, dict[int, list[float]]] = {d: {} for d in targets}  # T -> readings
    costs = {
        d: verify_costs(t, widths, greedy=sampling.greedy, seconds=step_seconds[d])
        for d, t in targets.items()
    }
    draft_cost: dict[tuple[str, str], float] = {}
    for d in targets:
        step = step_seconds[d][1][0]  # the one-token step verify_costs just timed
        copying = lookup_seconds(lookup)
        draft_cost[("prompt-lookup", d)] = copying / step
        if table_lookup is not None:
            draft_cost[("lookup+ngrams", d)] = (copying + table_seconds(table_lookup.table)) / step
        if isinstance(draft, DraftModelProposer):
            draft_cost[("draft-model", d)] = forward_seconds(draft.model, [1])[1] / step

    def predict(cfg: MethodConfig, stats: GenerationStats) -> float | None:
        if cfg.method not in OURS or cfg.adaptive:
            return None
        if (cfg.method, cfg.dtype) not in draft_cost:  # (an EAGLE head's cost: not timed)
            return None
        return predicted_speedup_by_length(
            conditional_acceptance(stats),
            draft_lengths(stats),
            draft_cost[(cfg.method, cfg.dtype)],
            costs[cfg.dtype],
        )

    say(f"running {len(configs)} configurations on {len(prompts)} prompts, interleaved")
    started = time.time()
    bandwidth_during: list[float] = []
    # The verify cost is read again after every prompt, like the bandwidth: one reading before the
    # run swung with the machine's state (float32 0.97-1.39 across runs of the same code).
    verify_during: dict[str, list[float]] = {d: [] for d in targets}
    # How far apart the cores are, beside each reading: on a VM they can move between an L3 shared
    # and two CCDs within minutes, and multi-token steps pay for the data their threads pass.
    roundtrip_before = core_roundtrip_ns()
    roundtrip_during: list[float | None] = []

    def between_prompts() -> None:
        bandwidth_during.append(memory_bandwidth(reps=3, probe=probe))
        roundtrip_during.append(core_roundtrip_ns())
        for d, t in targets.items():
            reading = verify_costs(t, [5], reps=3, greedy=sampling.greedy, seconds=step_seconds[d])
            verify_during[d].append(reading[5])

    results = run_interleaved(
        configs,
        runners,
        encoded,
        req,
        warmup=Sampling(min(8, args.max_new_tokens), sampling, args.seed),
        progress=not args.no_progress,
        between_prompts=between_prompts,
        repeats=args.repeats,
    )
    categories = [p.category for p in prompts]
    rows = aggregate(
        configs,
        categories,
        results,
        greedy=sampling.greedy,
        reference=MethodConfig("autoregressive", dtype=dtypes[0]),
        predict=predict,
        # Seeded copies equal plain only where a token's logits do not depend on the call's width.
        seeded=args.seed is not None and all(getattr(t, "uses_kernel", False) for t in targets.values()),
    )
    if sampling.greedy:  # what any prompt lookup could reach on these requests (verispec.bench.ceiling)
        add_copy_ceilings(rows, configs, categories, encoded, results, costs)

    runs = [  # every counted run, so that any figure can be recomputed from the file
        {
            "label": cfg.label,
            "prompt": i,
            "question_id": prompts[i].question_id,
            "category": prompts[i].category,
            "new_tokens": len(run.token_ids),
            "seconds": run.seconds,
            "first_token_seconds": run.first_token_seconds,
            "round_seconds": list(run.round_seconds),
        }
        for cfg in configs
        for i, run in enumerate(results[cfg])
    ]

    # The machine's bandwidth moves between minutes here (24-64 GB/s on the 2-core EPYC): the bound is
    # taken from the mean of every reading, before the run, after each prompt and after the run,
    # so it follows the machine's state while the runs it is compared with were timed.
    bandwidth_after = memory_bandwidth(probe=probe)
    readings = [bandwidth_before, *bandwidth_during, bandwidth_after]
    bandwidth = statistics.fmean(readings)
    by_dtype = {}
    for d, t in targets.items():
        wb = weight_bytes(t, d, greedy=sampling.greedy)
        dense = weight_bytes(t, d, greedy=sampling.greedy, blocks=False)
        plain = next(
            r for r in rows if r["method"] == "autoregressive" and r["dtype"] == d and r["category"] == ALL
        )
        bound = bandwidth / wb if wb else 0.0
        by_dtype[d] = {
            "weight_bytes_per_token": wb,
            "bandwidth_bound_tokens_per_second": bound,
            "plain_tokens_per_second": plain["tokens_per_second"],
            "plain_decode_tokens_per_second": plain["decode_tokens_per_second"],
            "plain_fraction_of_bound": plain["decode_tokens_per_second"] / bound if bound else None,
            # Where float32 matrices are read as their exact 4-bit blocks: the bound of reading the
            # float32 matrices instead (the bound), and plain decoding's fraction of it.
            "dense_weight_bytes_per_token": dense,
            "dense_bound_tokens_per_second": bandwidth / dense if dense else 0.0,
            "plain_fraction_of_dense_bound": (
                plain["decode_tokens_per_second"] * dense / bandwidth if dense and bandwidth else None
            ),
            # The median of every reading: before the run (9 rounds) and after each prompt (3).
            "verify_cost_ratio": statistics.median([costs[d][5], *verify_during[d]]),
            "verify_cost_ratio_samples": {"before": costs[d][5], "during": verify_during[d]},
            # The readings taken after prompts, split by the core round trip read beside them.
            "verify_cost_ratio_by_placement": by_placement(verify_during[d], roundtrip_during),
            "verify_cost_by_tokens": {str(k): v for k, v in costs[d].items()},
            # The times the ratio divides, medians of every reading (ms): one token and five.
            "verify_step_ms": {str(k): statistics.median(step_seconds[d][k]) * 1e3 for k in (1, 5)},
            "draft_cost": {m: c for (m, dd), c in draft_cost.items() if dd == d},
            # How the kernel read the paired weights (verispec.models.schedule); None: no kernel.
            "kernel_schedule": getattr(t, "kernel_schedule", None),
            # Prompts up to this many tokens ran on the kernel, longer ones on the torch path.
            "kernel_prefill_max": t.kernel_prefill_max.get(d) if getattr(t, "uses_kernel", False) else None,
        }
    first = by_dtype[dtypes[0]]
    from verispec.commands.generate import memory_report

    memory = {"target_weights": int(getattr(main, "weight_bytes", lambda: first["weight_bytes_per_token"])())}
    memory.update(memory_report(main, draft))
    machine["load_average_at_end"] = load_average()
    results_json = {
        "machine": machine,
        "config": {
            "command": "verispec bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
            if len(sys.argv) > 1 and sys.argv[1] == "bench"
            else "verispec bench (API)",
            "prompts_file": str(args.prompts or "default"),
            "categories": list(dict.fromkeys(p.category for p in prompts)),
            "prompts": len(prompts),
            "per_category": args.per_category,
            "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "seed": args.seed,
            "model": args.model,
            "draft_model": args.draft_model if draft is not None else None,
            "methods": methods,
            "num_speculative_tokens": ks,
            "adaptive": args.adaptive,
            "confidence_threshold": args.confidence_threshold,
            "dtypes": dtypes,
            "backend": args.backend,
            "target_backend": type(main).__name__,
            "wall_seconds": time.time() - started,
        },
        "memory_bandwidth_bytes_per_second": bandwidth,
        "memory_bandwidth_samples": {
            "before": bandwidth_before,
            "during": bandwidth_during,
            "after": bandwidth_after,
        },
        "core_roundtrip_ns_samples": {"before": roundtrip_before, "during": roundtrip_during},
        "weight_bytes_per_token": first["weight_bytes_per_token"],
        "bandwidth_bound_tokens_per_second": first["bandwidth_bound_tokens_per_second"],
        "verify_cost_ratio": first["verify_cost_ratio"],
        "by_dtype": by_dtype,
        "memory_bytes": memory,
        "notes": notes,
        "rows": rows,
        "runs": runs,
    }
    results_json["goals"] = goal_checks(results_json)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results_json, indent=1) + "\n", encoding="utf-8")
    table = markdown(results_json)
    (out / "results.md").write_text(table, encoding="utf-8")
    plot_all(results_json, out)
    print(table)
    say(f"wrote {out / 'results.json'}, results.md and plots")
    return 0


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Prompt token ids, through the chat template for instruct models."""
    from verispec.tokenizers import encode_prompt

    return encode_prompt(tokenizer, text, chat=chat)
