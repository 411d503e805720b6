"""``results.md`` and the PNG plots from the rows of ``results.json``."""

from __future__ import annotations

from pathlib import Path

from verispec.bench.methods import COPYING, OURS, SPECULATIVE
from verispec.bench.runner import ALL, INTERVAL_LEVEL, ratio_interval
from verispec.models.schedule import EVERY_PROMPT


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:{spec}}{suffix}"


def markdown(results: dict) -> str:
    """The Markdown report: setup, measured costs, memory, then one table row per config and category."""
    m, c = results["machine"], results["config"]
    lines = [
        "# verispec bench",
        "",
        f"Command: `{c['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
        f"transformers {m['transformers']}, llama-cpp-python {m['llama_cpp'] or 'not installed'}; "
        f"commit {m.get('git_commit') or '?'}; load average {m.get('load_average_at_start')} at start, "
        f"{m.get('load_average_at_end')} at end.",
        f"Model {c['model']}, draft {c['draft_model'] or '-'}, {c['max_new_tokens']} new tokens, temperature "
        f"{c['temperature']}, {c['prompts']} prompts.",
        "",
        f"- memory bandwidth {results['memory_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s"
        f"{_samples(results.get('memory_bandwidth_samples'))}; "
        f"bandwidth bound {results['bandwidth_bound_tokens_per_second']:.1f} tokens/s "
        f"({results['weight_bytes_per_token'] / 2**20:.0f} MiB of weights per token)",
        f"- verify_cost_ratio (forward over 5 new tokens / 1, at 200 cached) "
        f"{_fmt(results['verify_cost_ratio'])}"
        f"{_verify_samples(next(iter(results.get('by_dtype', {}).values()), {}))}",
    ]
    for dtype, d in results.get("by_dtype", {}).items():
        lines.append(
            f"- {dtype}: bound {d['bandwidth_bound_tokens_per_second']:.1f} tokens/s, plain decoding "
            f"{_fmt(d.get('plain_decode_tokens_per_second'), '.1f')} tokens/s decode-only "
            f"({_fmt(d.get('plain_fraction_of_bound'), '.0%')} of the bound"
            + (
                f"; {_fmt(d.get('plain_fraction_of_dense_bound'), '.0%')} of the "
                f"{d['dense_bound_tokens_per_second']:.1f} tokens/s of reading its float32 matrices, "
                "which it reads as their exact 4-bit blocks"
                if _reads_blocks(d)
                else ""
            )
            + "), verify_cost_ratio "
            f"{_fmt(d['verify_cost_ratio'])}{_verify_samples(d)}"
            + (f", kernel schedule {d['kernel_schedule']}" if d.get("kernel_schedule") else "")
            + _kernel_prompts(d.get("kernel_prefill_max"))
        )
    mem = results.get("memory_bytes") or {}
    if mem:
        lines.append("- memory: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items()))
    for note in results.get("notes", []):
        lines.append(f"- note: {note}")
    if results.get("goals"):
        lines += ["", "## Goals", "", goals_markdown(results["goals"])]
    lines += [
        "",
        "Speedup: tokens/s (whole request, prompt included) over the same engine's plain decoding on the "
        f"same prompts, with its {INTERVAL_LEVEL:.0%} interval in brackets (paired bootstrap over the cell's "
        "prompts, and over their rounds with --repeats); decode: the same after the first token; "
        "predicted: the expected-speedup model "
        "(decode) from measured acceptance and costs; vs ours: tokens/s over our float32 plain decoding; "
        "same output (greedy): every prompt's tokens equal those of the same engine's plain decoding in the "
        "same weight format, or, for plain decoding in another weight format or engine, our float32 plain "
        "decoding's, which a different format need not reproduce. In the goals, a prompt-lookup cell's "
        "ceiling is what any lookup (a copy after a one-token match, drafted at most k long) could reach "
        "on these very outputs at this run's measured step costs, and its bound what any drafter copying "
        "from the request could reach at any k with verification free (an oracle replays the plain "
        "output; verispec.bench.ceiling).",
        "",
        "| category | method | tok/s | decode tok/s | speedup | decode speedup | predicted | vs ours | "
        "acceptance | accepted/call | same output |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    cats = list(dict.fromkeys(r["category"] for r in results["rows"]))
    cats = [c for c in cats if c != ALL] + [ALL]
    for cat in cats:
        for r in (r for r in results["rows"] if r["category"] == cat):
            lines.append(
                f"| {cat} | {r['label']} | {r['tokens_per_second']:.1f} | "
                f"{r['decode_tokens_per_second']:.1f} | {_fmt(r['speedup'], '.2f', 'x')}"
                f"{_interval(r.get('speedup_interval'))} | "
                f"{_fmt(r.get('decode_speedup'), '.2f', 'x')} | {_fmt(r['predicted_speedup'], '.2f', 'x')} | "
                f"{_fmt(r['relative_to_autoregressive'], '.2f', 'x')} | "
                f"{_fmt(r['acceptance_rate'], '.0%')} | {_fmt(r['mean_accepted_length'], '.2f')} | "
                f"{_fmt(r['outputs_match_baseline'])} |"
            )
    return "\n".join(lines) + "\n"


def plot_all(results: dict, out: Path) -> list[Path]:
    """Write the three plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    paths = []

    # 1. speedup by category and method: each config at its k with the best overall speedup.
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["category"] == ALL and r["speedup"] is not None:
            key = (r["method"], r["dtype"], r["adaptive"])
            if key not in best or r["speedup"] > best[key]["speedup"]:
                best[key] = r
    labels = [r["label"] for r in best.values()]
    cats = [c for c in dict.fromkeys(r["category"] for r in rows) if c != ALL] + [ALL]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cats) * max(1, len(labels)) / 3), 4.5))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        ys = [
            next((r["speedup"] or 0 for r in rows if r["label"] == label and r["category"] == c), 0)
            for c in cats
        ]
        ax.bar([i + j * width for i in range(len(cats))], ys, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over the same engine's plain decoding")
    ax.set_title("Speedup by category (tokens/s, whole request)")
    paths.append(_save(fig, ax, out / "speedup_by_category.png", ncol=2))

    # 2. acceptance by draft position, over all prompts.
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r["category"] == ALL and r["acceptance_by_position"]:
            pos = r["acceptance_by_position"]
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=r["label"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (all prompts)")
    paths.append(_save(fig, ax, out / "acceptance_by_position.png"))

    # 3. decode speedup against k, measured (solid) and predicted (dashed), the prediction being of
    # decoding alone; adaptive as a marker.
    fig, ax = plt.subplots(figsize=(7, 4))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["category"] == ALL and r["num_speculative_tokens"] and r.get("decode_speedup") is not None:
            groups.setdefault((r["method"], r["dtype"], r["adaptive"]), []).append(r)
    for (method, dtype, adaptive), rs in groups.items():
        rs.sort(key=lambda r: r["num_speculative_tokens"])
        ks = [r["num_speculative_tokens"] for r in rs]
        name = method + ("" if dtype == "float32" else f" [{dtype}]")
        if adaptive:
            ax.plot(
                ks,
                [r["decode_speedup"] for r in rs],
                marker="*",
                markersize=12,
                linestyle="none",
                label=f"{name} adaptive (start k)",
            )
            continue
        (line,) = ax.plot(ks, [r["decode_speedup"] for r in rs], marker="o", label=f"{name} measured")
        pred = [r.get("predicted_speedup") for r in rs]
        if any(p is not None for p in pred):
            ax.plot(
                ks,
                [p if p is not None else float("nan") for p in pred],
                linestyle="--",
                color=line.get_color(),
                label=f"{name} predicted",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("decode speedup (all prompts)")
    ax.set_title("Decode speedup against k: measured and predicted")
    paths.append(_save(fig, ax, out / "speedup_vs_k.png"))
    return paths


def _save(fig, ax, path: Path, ncol: int = 1) -> Path:
    """Add a legend when something was drawn, write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    if ax.get_legend_handles_labels()[0]:  # something drawn with a label
        ax.legend(fontsize=7, ncol=ncol)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _interval(interval: list[float] | tuple[float, float] | None) -> str:
    """`` (0.91-1.08)`` for a speedup interval, empty without one."""
    return "" if not interval else f" ({interval[0]:.2f}-{interval[1]:.2f})"


def _paired_interval(results: dict, label: str, base_label: str, category: str) -> tuple[float, float] | None:
    """:func:`~verispec.bench.runner.ratio_interval` of ``label`` over ``base_label`` on ``category``'s
    prompts, from the runs in ``results`` (None when the file has none: results before session 10)."""
    runs = results.get("runs")
    if not runs:
        return None

    def pick(lab: str) -> list[dict]:
        chosen = (r for r in runs if r["label"] == lab and category in (ALL, r["category"]))
        return sorted(chosen, key=lambda r: r["prompt"])

    ours, base = pick(label), pick(base_label)
    if len(ours) != len(base):
        return None
    return ratio_interval(
        [r["new_tokens"] for r in ours],
        [r["seconds"] for r in ours],
        [r["new_tokens"] for r in base],
        [r["seconds"] for r in base],
        [r.get("round_seconds") for r in ours],
        [r.get("round_seconds") for r in base],
    )


def _row(rows: list[dict], label: str, category: str) -> dict | None:
    return next((r for r in rows if r["label"] == label and r["category"] == category), None)


def _reads_blocks(d: dict) -> bool:
    """Whether a weight format's plain decoding read float32 matrices as their 4-bit blocks (its
    bytes per token below those of the float32 matrices)."""
    dense = d.get("dense_weight_bytes_per_token")
    return bool(dense) and dense > d.get("weight_bytes_per_token", dense)


def goal_checks(results: dict) -> list[dict]:
    """The project's performance goals, checked against this run: ``{"goal", "value", "met"}`` each
    (``met`` None when the run lacks the rows to decide). ``met`` judges the measured figure; where a
    goal is about one category's cell, the value carries that cell's interval (over its prompts, and
    their rounds with --repeats), so a reader can tell a miss from the spread of what it ran on."""
    rows, out = results["rows"], []
    cats = [c for c in dict.fromkeys(r["category"] for r in rows) if c != ALL]
    key_cats = [c for c in ("summarization", "rag", "coding") if c in cats]

    def add(goal: str, value: str, met: bool | None) -> None:
        out.append({"goal": goal, "value": value, "met": met})

    for dtype, d in results.get("by_dtype", {}).items():
        frac = d.get("plain_fraction_of_bound")
        value = (
            f"{_fmt(frac, '.0%')} ({_fmt(d.get('plain_decode_tokens_per_second'), '.1f')} of "
            f"{d['bandwidth_bound_tokens_per_second']:.1f} tokens/s)"
        )
        if dtype != "float32":  # the issue sets the goal for float32; other formats' fractions inform
            goal = f"plain decoding ({dtype}): fraction of its bandwidth bound (decode-only; "
            add(goal + "the goal is float32's)", value, None)
            continue
        if _reads_blocks(d):  # the bound reads the float32 matrices; judged against it
            frac = d.get("plain_fraction_of_dense_bound")
            value = (
                f"{_fmt(frac, '.0%')} of reading the float32 matrices "
                f"({d['dense_bound_tokens_per_second']:.1f} tokens/s); {value} over the 4-bit "
                "blocks it reads instead"
            )
        add(
            f"plain decoding ({dtype}) >= 75% of the bandwidth bound (decode-only)",
            value,
            None if frac is None else frac >= 0.75,
        )
    hf = _row(rows, "hf-generate", ALL)
    if hf and hf["relative_to_autoregressive"]:
        ratio = 1 / hf["relative_to_autoregressive"]
        add(">= 2x transformers generate (plain, float32)", f"{ratio:.2f}x", ratio >= 2.0)
    formats = results.get("by_dtype", {})
    ratios = (  # with several weight formats, each one's own ratio: their kernels differ
        [(f" ({dtype})", d.get("verify_cost_ratio")) for dtype, d in formats.items()]
        if len(formats) > 1
        else [("", results.get("verify_cost_ratio"))]
    )
    for label, v in ratios:
        add(f"forward over 5 new tokens <= 1.3x one token{label}", _fmt(v), None if v is None else v <= 1.3)
    llama = {c: _row(rows, "llama.cpp", c) for c in key_cats}
    for dtype in results.get("by_dtype", {}):
        if dtype == "float32" or not key_cats or not all(llama.values()):  # nothing to judge
            continue
        label = f"autoregressive [{dtype}]"
        ratios = {
            c: _row(rows, label, c)["tokens_per_second"] / llama[c]["tokens_per_second"] for c in key_cats
        }
        add(
            f"{dtype} plain faster than llama.cpp plain on {', '.join(key_cats)}",
            ", ".join(f"{c} {r:.2f}x" for c, r in ratios.items()),
            all(r > 1 for r in ratios.values()),
        )
        # The goal: with the faster format, our *speculative* decoding beats llama.cpp plain.
        spec_labels = [
            r["label"]
            for r in rows
            if r["category"] == ALL
            and r["dtype"] == dtype
            and r["method"] in SPECULATIVE
            and r["method"] in OURS
        ]
        if spec_labels:
            per = {
                lab: {
                    c: _row(rows, lab, c)["tokens_per_second"] / llama[c]["tokens_per_second"]
                    for c in key_cats
                }
                for lab in spec_labels
            }
            best = max(per, key=lambda lab: min(per[lab].values()))
            add(
                f"{dtype} speculative faster than llama.cpp plain on {', '.join(key_cats)} (best: {best})",
                ", ".join(f"{c} {r:.2f}x" for c, r in per[best].items()),
                all(r > 1 for r in per[best].values()),
            )
    # Every weight format's prompt lookup, over that format's plain decoding.
    lookups = [r for r in rows if r["method"] == "prompt-lookup" and r["category"] == ALL]
    for lk in lookups:
        per = {c: _row(rows, lk["label"], c)["speedup"] for c in cats}
        if key_cats:
            add(
                f"{lk['label']} >= 2.0x on {', '.join(key_cats)}",
                ", ".join(f"{c} {per[c]:.2f}x{_ceiling(_row(rows, lk['label'], c))}" for c in key_cats),
                all(per[c] >= 2.0 for c in key_cats),
            )
        worst = min(per, key=per.get)
        spread = _interval(_row(rows, lk["label"], worst).get("speedup_interval"))
        add(
            f"{lk['label']} never below 0.95x",
            f"lowest {worst} {per[worst]:.2f}x{spread}",
            per[worst] >= 0.95,
        )
    for ad in (r for r in rows if r["adaptive"] and r["category"] == ALL):
        fixed = [
            r["label"]
            for r in rows
            if r["category"] == ALL
            and r["method"] == ad["method"]
            and r["dtype"] == ad["dtype"]
            and not r["adaptive"]
        ]
        if not fixed:
            continue
        gaps, best_fixed = {}, {}
        for c in cats:
            best_fixed[c] = max(fixed, key=lambda f, c=c: _row(rows, f, c)["speedup"])
            gaps[c] = _row(rows, ad["label"], c)["speedup"] / _row(rows, best_fixed[c], c)["speedup"]
        worst = min(gaps, key=gaps.get)
        interval = _interval(_paired_interval(results, ad["label"], best_fixed[worst], worst))
        add(
            f"{ad['label']} within 5% of the best fixed k on every category",
            f"worst {worst}: {gaps[worst]:.2f}{interval} of the best fixed k ({best_fixed[worst]})",
            gaps[worst] >= 0.95,
        )
    spec = [r for r in rows if r["method"] in SPECULATIVE and r["category"] == ALL]
    config = results.get("config", {})
    greedy = not config.get("temperature")
    if greedy and spec and all(r["outputs_match_baseline"] is not None for r in spec):
        peers = [r["label"] for r in spec if r["method"] not in OURS and not r["outputs_match_baseline"]]
        if peers:
            add(
                "peers' speculative greedy output identical to their plain output",
                "differ: " + ", ".join(peers),
                None,
            )
        bad = [r["label"] for r in spec if r["method"] in OURS and not r["outputs_match_baseline"]]
        add(
            "every speculative method of ours: greedy output identical to plain greedy output",
            "all identical" if not bad else "differ: " + ", ".join(bad),
            not bad,
        )
    # Sampled rows carry a comparison only where the runner made one (a seed, on the kernel).
    copying = [r for r in spec if r["method"] in COPYING and r["outputs_match_baseline"] is not None]
    if copying and not greedy:
        bad = [r["label"] for r in copying if not r["outputs_match_baseline"]]
        add(
            "seeded sampling: our copying methods' output identical to plain sampled output",
            "all identical" if not bad else "differ: " + ", ".join(bad),
            not bad,
        )
    return out


def _ceiling(row: dict) -> str:
    """`` (ceiling 1.30x, bound 1.58x)`` for a prompt-lookup cell with the copy oracle's figures
    (:mod:`verispec.bench.ceiling`; results before session 39 have none)."""
    if row.get("lookup_ceiling") is None or row.get("copy_bound") is None:
        return ""
    return f" (ceiling {row['lookup_ceiling']:.2f}x, bound {row['copy_bound']:.2f}x)"


def goals_markdown(checks: list[dict]) -> str:
    """The goal checks as a Markdown table."""
    lines = ["| goal | this run | met |", "|---|---|:---:|"]
    for c in checks:
        lines.append(
            f"| {c['goal']} | {c['value']} | {'-' if c['met'] is None else ('yes' if c['met'] else 'NO')} |"
        )
    return "\n".join(lines)


def _kernel_prompts(limit: int | None) -> str:
    """How a format's prompts are split between the kernel and the torch path, for its line: the
    kernel takes prompts of up to ``limit`` tokens; the kernel-only formats' limit
    (``EVERY_PROMPT``) means every prompt."""
    if limit is None:
        return ""
    if limit >= EVERY_PROMPT:
        return ", every prompt on the kernel"
    return f", kernel prompts up to {limit} tokens"


def _verify_samples(by_dtype: dict) -> str:
    """`` (median of 27 readings through the run, 1.02-1.21; one token 3.02 ms, five 4.41 ms)`` for
    a weight format's verify-cost readings, if recorded (results before session 9 have one reading,
    taken before the run; the median step times are there from session 38 on), and where the run
    saw its cores both near and far apart, the median of each part (session 49)."""
    samples = by_dtype.get("verify_cost_ratio_samples")
    if not samples:
        return ""
    every = [samples["before"], *samples.get("during", [])]
    ms = by_dtype.get("verify_step_ms")
    times = f"; one token {ms['1']:.2f} ms, five {ms['5']:.2f} ms" if ms else ""
    place = by_dtype.get("verify_cost_ratio_by_placement")
    where = (
        f"; {place['near']['verify_cost_ratio']:.2f} in the {place['near']['readings']} readings with the "
        f"cores {place['near']['roundtrip_ns']:.0f} ns apart (round trip), "
        f"{place['far']['verify_cost_ratio']:.2f} in the {place['far']['readings']} with them "
        f"{place['far']['roundtrip_ns']:.0f} ns apart"
        if place
        else ""
    )
    spread = f"{min(every):.2f}-{max(every):.2f}"
    return f" (median of {len(every)} readings through the run, {spread}{times}{where})"


def _samples(samples: dict | None) -> str:
    """`` (mean of 27 readings through the run, 24.3-33.0; 28.1 before, 31.0 after)`` for the
    bandwidth readings, if recorded (older results have only ``before`` and ``after``)."""
    if not samples:
        return ""
    every = [samples["before"], *samples.get("during", []), samples["after"]]
    return (
        f" (mean of {len(every)} readings through the run, {min(every) / 1e9:.1f}-{max(every) / 1e9:.1f};"
        f" {samples['before'] / 1e9:.1f} before, {samples['after'] / 1e9:.1f} after)"
    )
