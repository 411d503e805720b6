"""``verispec bench`` end to end on a tiny model, its pieces, and its refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from verispec.adaptive import expected_speedup
from verispec.bench.cli import build_configs
from verispec.bench.measure import (
    conditional_acceptance,
    draft_fraction,
    draft_lengths,
    predicted_speedup,
    predicted_speedup_by_length,
)
from verispec.bench.methods import MethodConfig
from verispec.bench.prompts import default_prompts_path, load_prompts, select
from verispec.cli import main
from verispec.models.fast_llama import kernel_available
from verispec.stats import GenerationStats

requires_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")

ROW_FIELDS = set(
    "method category num_speculative_tokens prompts new_tokens seconds tokens_per_second "
    "decode_tokens_per_second speedup acceptance_rate mean_accepted_length outputs_match_baseline "
    "predicted_speedup relative_to_autoregressive speedup_interval".split()
)


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    """Two questions in Spec-Bench's format, one repetitive (prompt lookup finds matches)."""
    rows = [
        {"question_id": 1, "category": "summarization",
         "turns": ["Summarize: the cat sat on the mat. The cat sat on the mat. The cat sat.", "again"]},
        {"question_id": 2, "category": "coding", "turns": ["Write a Python function that adds two numbers."]},
    ]  # fmt: skip
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_writes_results_table_and_plots(tiny_model_folder, prompts_file, tmp_path, capsys, monkeypatch):
    import verispec.bench.cli as bench_cli

    measured = bench_cli.verify_costs
    readings = iter([3.0, 1.2, 1.1])  # v(5) before the run, then after each of the two prompts

    def verify_costs(model, widths, *args, **kwargs):
        costs = measured(model, widths, *args, **kwargs)
        return {**costs, 5: next(readings)}

    monkeypatch.setattr(bench_cli, "verify_costs", verify_costs)
    roundtrips = iter([60.0, 62.0, 340.0])  # the cores near, near, then far apart (ns)
    monkeypatch.setattr(bench_cli, "core_roundtrip_ns", lambda: next(roundtrips))
    out = tmp_path / "out"
    code = main([
        "bench", "--model", str(tiny_model_folder), "--prompts", str(prompts_file), "--max-new-tokens", "8",
        "--methods", "autoregressive,prompt-lookup,hf-generate,llama.cpp,draft-model", "-k", "2,3",
        "--out", str(out), "--no-progress",
    ])  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    top = {
        "machine",
        "config",
        "rows",
        "verify_cost_ratio",
        "bandwidth_bound_tokens_per_second",
        "memory_bytes",
    }
    assert top <= set(results)
    assert results["verify_cost_ratio"] > 0 and results["bandwidth_bound_tokens_per_second"] > 0
    samples = results["memory_bandwidth_samples"]
    assert len(samples["during"]) == 2  # one reading after each prompt
    every = [samples["before"], *samples["during"], samples["after"]]
    assert results["memory_bandwidth_bytes_per_second"] == pytest.approx(sum(every) / len(every))
    # the verify cost too is read again after each prompt; the ratio is the median of the readings
    verify = results["by_dtype"]["float32"]["verify_cost_ratio_samples"]
    assert verify == {"before": 3.0, "during": [1.2, 1.1]}
    assert results["verify_cost_ratio"] == 1.2
    assert "median of 3 readings through the run, 1.10-3.00" in (out / "results.md").read_text()
    # each reading after a prompt beside how far apart the cores were: split where they moved
    assert results["core_roundtrip_ns_samples"] == {"before": 60.0, "during": [62.0, 340.0]}
    place = results["by_dtype"]["float32"]["verify_cost_ratio_by_placement"]
    assert place["near"] == {"readings": 1, "verify_cost_ratio": 1.2, "roundtrip_ns": 62.0}
    assert place["far"] == {"readings": 1, "verify_cost_ratio": 1.1, "roundtrip_ns": 340.0}
    split = "1.20 in the 1 readings with the cores 62 ns apart (round trip), 1.10 in the 1 with them 340 ns"
    assert split in (out / "results.md").read_text()
    # beside the ratio, the step times it divides (medians of the same readings)
    ms = results["by_dtype"]["float32"]["verify_step_ms"]
    assert set(ms) == {"1", "5"} and 0 < ms["1"] < ms["5"] * 10
    assert f"one token {ms['1']:.2f} ms, five {ms['5']:.2f} ms" in (out / "results.md").read_text()
    assert "same output (greedy): every prompt's tokens equal" in (out / "results.md").read_text()
    rows = results["rows"]
    for row in rows:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
    # every config on every category plus "all"; llama.cpp is skipped (the target is no GGUF) with a note
    labels = {r["label"] for r in rows}
    plain, lookup = {"autoregressive", "hf-generate"}, {"prompt-lookup k=2", "prompt-lookup k=3"}
    assert labels == plain | lookup | {"prompt-lookup k=3 adaptive"}
    assert {r["category"] for r in rows} == {"summarization", "coding", "all"}
    assert any("llama.cpp" in n for n in results["notes"])
    assert any("no shipped draft" in n for n in results["notes"])  # draft-model skipped, not mislabelled
    # lossless: greedy speculative output equals plain greedy output on every prompt
    for row in rows:
        if row["method"] == "prompt-lookup":
            assert row["outputs_match_baseline"] is True
            assert row["acceptance_by_position"] is not None
        if row["method"] == "autoregressive":
            assert row["speedup"] == pytest.approx(1.0)
        # what any lookup could reach on the plain outputs, and any copying drafter (bench.ceiling)
        if row["method"] == "prompt-lookup":
            assert 0 < row["lookup_ceiling"] <= row["copy_bound"]
        else:
            assert row["lookup_ceiling"] is None and row["copy_bound"] is None
    summ = next(r for r in rows if r["label"] == "prompt-lookup k=3" and r["category"] == "summarization")
    assert summ["prompts"] == 1 and 1 <= summ["new_tokens"] <= 8
    assert summ["speedup_interval"] is None  # one prompt: nothing to resample
    both = next(r for r in rows if r["label"] == "prompt-lookup k=3" and r["category"] == "all")
    lo, hi = both["speedup_interval"]  # two prompts: the interval spans both prompts' own speedups
    assert lo - 1e-9 <= both["speedup"] <= hi + 1e-9
    # every counted run is in the file, so any figure can be recomputed from it
    runs = [r for r in results["runs"] if r["label"] == "prompt-lookup k=3"]
    assert [r["category"] for r in runs] == ["summarization", "coding"]
    assert sum(r["new_tokens"] for r in runs) == both["new_tokens"]
    assert sum(r["seconds"] for r in runs) == pytest.approx(both["seconds"])
    for name in ("speedup_by_category.png", "acceptance_by_position.png", "speedup_vs_k.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    goals = {g["goal"]: g for g in results["goals"]}
    lossless = "every speculative method of ours: greedy output identical to plain greedy output"
    assert goals[lossless]["met"] is True
    assert any(g.startswith("prompt-lookup k=3 adaptive within 5%") for g in goals)
    table = (out / "results.md").read_text()
    assert "| summarization | prompt-lookup k=2 |" in table
    assert "(ceiling " in goals["prompt-lookup k=2 >= 2.0x on summarization, coding"]["value"]
    assert "prompt-lookup k=2" in capsys.readouterr().out


def test_bench_draft_model_and_assisted_peer(tiny_model_folder, prompts_file, tmp_path):
    """Self-drafting (the target as its own draft): every draft token is accepted, output unchanged."""
    out = tmp_path / "out"
    code = main([
        "bench", "--model", str(tiny_model_folder), "--draft-model", str(tiny_model_folder), "--prompts",
        str(prompts_file), "--categories", "coding", "--max-new-tokens", "6", "-k", "2", "--no-progress",
        "--methods", "draft-model,hf-assisted", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = {r["label"]: r for r in results["rows"] if r["category"] == "all"}
    assert set(rows) == {"autoregressive", "draft-model k=2", "draft-model k=2 adaptive", "hf-assisted k=2",
                         "hf-generate"}  # fmt: skip
    assert rows["draft-model k=2"]["acceptance_rate"] == 1.0
    assert (
        rows["draft-model k=2"]["outputs_match_baseline"]
        and rows["hf-assisted k=2"]["outputs_match_baseline"]
    )
    assert results["memory_bytes"]["draft_weights"] > 0


def test_seeded_sampled_bench_checks_the_copying_methods_output(tiny_model_folder, prompts_file, tmp_path):
    """Sampling with a seed, prompt lookup's output is the plain output (its drafts are point
    masses), and the bench says so per row and in its goals; a draft model's sampled output follows
    the target's law but not the plain tokens, so its rows say nothing (None)."""
    out = tmp_path / "out"
    code = main([
        "bench", "--model", str(tiny_model_folder), "--draft-model", str(tiny_model_folder), "--prompts",
        str(prompts_file), "--max-new-tokens", "12", "-k", "3", "--no-progress", "--temperature", "0.8",
        "--seed", "5", "--methods", "autoregressive,prompt-lookup,draft-model", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = [r for r in results["rows"] if r["category"] == "all"]
    lookup = [r for r in rows if r["method"] == "prompt-lookup"]
    assert lookup and all(r["outputs_match_baseline"] is True for r in lookup)
    assert sum(r["prompts_matching_baseline"] for r in lookup) == 2 * len(lookup)
    assert all(r["outputs_match_baseline"] is None for r in rows if r["method"] == "draft-model")
    goals = {g["goal"]: g for g in results["goals"]}
    same = goals["seeded sampling: our copying methods' output identical to plain sampled output"]
    assert same["met"] is True and same["value"] == "all identical"
    assert not any("greedy output identical" in g for g in goals)  # the greedy check is for greedy runs


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--methods", "autoregressive,medusa"], "unknown methods medusa"),
        (["--categories", "poetry"], "unknown categories poetry"),
        (["--per-category", "0"], "--per-category"),
        (["-k", "0"], "--num-speculative-tokens"),
        (["-k", "two"], "--num-speculative-tokens"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_bad_input_exits_2(prompts_file, tmp_path, capsys, extra, message):
    code = main(["bench", "--prompts", str(prompts_file), "--out", str(tmp_path / "o"), *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_missing_prompt_file_exits_2(tmp_path, capsys):
    assert main(["bench", "--prompts", str(tmp_path / "nope.jsonl")]) == 2
    assert "prompt file not found" in capsys.readouterr().err


def test_select_takes_first_n_of_each_category_and_first_turn(prompts_file):
    prompts = load_prompts(prompts_file)
    assert [p.category for p in prompts] == ["summarization", "coding"]
    assert prompts[0].text.startswith("Summarize") and "again" not in prompts[0].text
    assert [p.question_id for p in select(prompts, ["coding"], 1)] == ["2"]
    assert len(select(prompts, None, None)) == 2


def test_default_prompt_file_is_spec_bench():
    path = default_prompts_path()
    if not path.is_file():
        pytest.skip("the shared Spec-Bench file is not in this checkout's parent")
    prompts = load_prompts()
    assert len(prompts) == 480 and len({p.category for p in prompts}) == 13
    assert len(select(prompts, ["rag", "coding"], 3)) == 6


def test_configs_bring_their_baselines():
    configs = build_configs(["prompt-lookup", "hf-prompt-lookup"], [2, 4, 8], ["float32", "bfloat16"], "add")
    labels = [c.label for c in configs]
    assert labels[:2] == ["autoregressive", "autoregressive [bfloat16]"]
    assert "prompt-lookup k=4 adaptive" in labels and "prompt-lookup k=8 [bfloat16]" in labels
    assert "hf-generate" in labels and "hf-prompt-lookup k=8" in labels
    assert "hf-prompt-lookup k=4 adaptive" not in labels  # adaptive k is ours only
    bf16 = MethodConfig("prompt-lookup", 4, dtype="bfloat16")
    assert bf16.baseline == MethodConfig("autoregressive", dtype="bfloat16")
    only = build_configs(["prompt-lookup"], [2, 4], ["float32"], "only")
    assert [c.label for c in only] == ["autoregressive", "prompt-lookup k=4 adaptive"]


def test_expected_speedup_model():
    # every step drafts: the paper's formula
    assert predicted_speedup(0.8, 4, 0.1, 1.2) == pytest.approx(expected_speedup(0.8, 4, 0.1, 1.2))
    # no step drafts: plain decoding
    assert predicted_speedup(0.8, 4, 0.0, 1.2, fraction=0.0) == 1.0
    # half the steps draft 2 tokens, always accepted, free verification: (3 + 1) / (1 + 1) tokens per cost
    assert predicted_speedup(1.0, 2, 0.0, 1.0, fraction=0.5) == pytest.approx(2.0, rel=1e-4)


def test_prediction_from_the_draft_lengths_verified():
    verify = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2}
    # every call drafts k = 4: the fixed-length formula
    assert predicted_speedup_by_length(0.7, [0, 10], 0.05, verify) is not None
    assert predicted_speedup_by_length(0.7, [0, 0, 0, 0, 10], 0.05, verify) == pytest.approx(
        predicted_speedup(0.7, 4, 0.05, 1.2)
    )
    # half the calls plain, half drafting 4: the formula with f = 1/2
    assert predicted_speedup_by_length(0.7, [5, 0, 0, 0, 5], 0.05, verify) == pytest.approx(
        predicted_speedup(0.7, 4, 0.05, 1.2, fraction=0.5)
    )
    # mixed lengths, by hand: 2 calls of 1 token (1 + a tokens at cost c + v(2)) and 1 call of 3
    a, c = 0.5, 0.1
    tokens = 2 * (1 + a) + (1 + a + a**2 + a**3)
    cost = 2 * (c + 1.05) + (3 * c + 1.15)
    assert predicted_speedup_by_length(a, [0, 2, 0, 1], c, verify) == pytest.approx(tokens / cost)
    # a length whose verify cost was not measured: no prediction; nothing drafted: plain decoding
    assert predicted_speedup_by_length(a, [0, 0, 0, 0, 0, 1], c, verify) is None
    assert predicted_speedup_by_length(a, [7], c, verify) == 1.0


def test_draft_lengths_from_positions_reached():
    stats = GenerationStats()
    stats.record_step(4, 1)
    stats.record_step(2, 2)
    stats.record_step(0, 0)
    stats.record_step(2, 0)
    stats.record_step(1, 1)
    assert draft_lengths(stats) == [1, 1, 2, 0, 1]  # no draft, one of 1, two of 2, one of 4


def test_conditional_acceptance_counts_only_reached_positions():
    stats = GenerationStats()
    stats.record_step(4, 1)  # accepted position 0, rejected position 1: positions 2, 3 never reached
    stats.record_step(4, 4)
    stats.record_step(0, 0)
    # reached: pos0 2, pos1 2, pos2 1, pos3 1 = 6; accepted 5
    assert conditional_acceptance(stats) == pytest.approx(5 / 6)
    assert stats.acceptance_rate == pytest.approx(5 / 8)
    assert draft_fraction(stats) == pytest.approx(2 / 3)


def test_tune_prints_costs_acceptance_and_a_pick(tiny_model_folder, prompts_file, capsys):
    code = main([
        "tune", "--model", str(tiny_model_folder), "--prompt-lookup", "--prompts", str(prompts_file),
        "--max-new-tokens", "8", "--k-max", "6", "--json",
    ])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "prompt-lookup" and report["draft_cost"] >= 0
    assert report["probe_k"] == 6  # lookup cuts its drafts by cost: probed at --k-max, then capped
    assert set(report["verify_cost_by_tokens"]) == {str(t) for t in range(1, 8)}
    assert set(report["categories"]) == {"summarization", "coding", "all"}
    for cat in report["categories"].values():
        assert 0 <= cat["acceptance"] <= 1 and 0 <= cat["best_k"] <= 6
        assert set(cat["expected_speedup"]) == {str(k) for k in range(1, 7)}


def test_tune_predicts_lookup_from_its_draft_lengths_cut_at_each_k():
    from verispec.bench.measure import predicted_speedup_by_length
    from verispec.bench.tune import capped

    assert capped([5, 3, 2, 1], 2) == [5, 3, 3] and capped([5, 3, 2, 1], 3) == [5, 3, 2, 1]
    assert capped([5, 3], 4) == [5, 3]
    # 10 plain steps, 10 steps of one draft token, 10 of three; verifying costs nothing extra.
    lengths, free = [10, 10, 0, 10], {t: 1.0 for t in range(1, 6)}
    one = predicted_speedup_by_length(0.5, capped(lengths, 1), 0.0, free)
    three = predicted_speedup_by_length(0.5, capped(lengths, 3), 0.0, free)
    assert one == pytest.approx((10 + 20 * 1.5) / 30) and three == pytest.approx((10 + 15 + 10 * 1.875) / 30)


def test_tune_bad_input_exits_2(prompts_file, capsys):
    assert main(["tune", "--prompts", str(prompts_file), "--k-max", "0"]) == 2
    assert "--k-max" in capsys.readouterr().err


def test_speedup_interval_is_a_seeded_paired_bootstrap_over_prompts():
    from verispec.bench.runner import ratio_interval

    tokens, base = [64, 64, 64, 64], [1.0, 2.0, 1.5, 1.0]
    # Every prompt twice as fast: every draw gives 2, however unequal the prompts' lengths.
    assert ratio_interval(tokens, [b / 2 for b in base], tokens, base) == pytest.approx((2.0, 2.0))
    seconds = [0.5, 2.0, 1.5, 1.0]  # only prompt 0 is faster (2x)
    lo, hi = ratio_interval(tokens, seconds, tokens, base)
    point = sum(base) / sum(seconds)  # equal tokens: the ratio of the summed seconds
    assert 1.0 <= lo < point < hi <= 2.0
    assert ratio_interval(tokens, seconds, tokens, base) == (lo, hi)  # seeded
    assert ratio_interval(tokens, seconds, tokens, base, level=0.5) != (lo, hi)
    gen = np.random.default_rng(1)
    for _ in range(20):  # same tokens (greedy outputs match): every draw lies between the prompts' ratios
        n = int(gen.integers(2, 9))
        tok, sec, bsec = (gen.uniform(1, 10, n) for _ in range(3))
        lo, hi = ratio_interval(tok, sec, tok, bsec)
        own = bsec / sec
        assert own.min() - 1e-9 <= lo <= hi <= own.max() + 1e-9
    assert ratio_interval(tokens[:1], seconds[:1], tokens[:1], base[:1]) is None
    with pytest.raises(ValueError):
        ratio_interval(tokens, seconds[:3], tokens, base)
    # With every round's time: rounds that agree change nothing; rounds that differ widen it.
    twice = [[b / 2, b / 2] for b in base]
    same = ratio_interval(tokens, [b / 2 for b in base], tokens, base, twice, [[b, b] for b in base])
    assert same == pytest.approx((2.0, 2.0))
    # The baseline's second round was slower: a draw of only that round makes its prompt look 3x.
    lo, hi = ratio_interval(tokens, [b / 2 for b in base], tokens, base, twice, [[b, 1.5 * b] for b in base])
    assert lo == pytest.approx(2.0) and 2.0 < hi <= 3.0
    # Our second round was slower: a draw of only that round makes its prompt look 1x.
    ours = [[b / 2, b] for b in base]
    lo, hi = ratio_interval(tokens, [b / 2 for b in base], tokens, base, ours, [[b, b] for b in base])
    assert 1.0 <= lo < 2.0 and hi == pytest.approx(2.0)


def test_goal_faster_format_speculative_against_llama_cpp():
    from verispec.bench.report import goal_checks
    from verispec.bench.runner import ALL

    def row(label, method, dtype, cat, tps):
        return {
            "label": label,
            "method": method,
            "dtype": dtype,
            "category": cat,
            "tokens_per_second": tps,
            "speedup": 1.0,
            "adaptive": False,
            "outputs_match_baseline": True,
        }

    cats = ("summarization", "rag", "coding", ALL)
    rows = [row("llama.cpp", "llama.cpp", "gguf", c, 80.0) for c in cats]
    rows += [row("autoregressive [int8]", "autoregressive", "int8", c, 70.0) for c in cats]
    lookup = zip(cats, (120, 90, 85, 95))
    rows += [row("prompt-lookup k=8 [int8]", "prompt-lookup", "int8", c, t) for c, t in lookup]
    results = {"rows": rows, "by_dtype": {"int8": {"bandwidth_bound_tokens_per_second": 200.0}}}
    checks = {c["goal"].split(" on ")[0]: c for c in goal_checks(results)}
    assert checks["int8 plain faster than llama.cpp plain"]["met"] is False
    spec = checks["int8 speculative faster than llama.cpp plain"]
    assert spec["met"] is True and "coding 1.06x" in spec["value"]
    # A run of none of those categories (here qa alone) has nothing to judge them on: no goal
    # (a bench run of --categories qa once crashed here, writing no results).
    qa = [{**r, "category": "qa" if r["category"] != ALL else ALL} for r in rows]
    goals = [c["goal"] for c in goal_checks({**results, "rows": qa})]
    assert not any("llama.cpp" in g for g in goals)


def test_prompt_lookup_goals_cover_every_weight_format():
    """The 2x and never-below-0.95x goals are checked for each format's prompt lookup, over that
    format's own plain decoding (an int8 cell below 0.95x is a miss like a float32 one)."""
    from verispec.bench.report import goal_checks
    from verispec.bench.runner import ALL

    def row(label, dtype, cat, speedup):
        return {"label": label, "method": "prompt-lookup", "dtype": dtype, "category": cat,
                "speedup": speedup, "adaptive": False, "outputs_match_baseline": True}  # fmt: skip

    rows = []
    formats = (("prompt-lookup k=4", "float32", 1.0), ("prompt-lookup k=4 [int8]", "int8", 0.94))
    for label, dtype, low in formats:
        rows += [row(label, dtype, c, s) for c, s in (("stem", low), ("rag", 1.3), (ALL, 1.1))]
    checks = {c["goal"]: c for c in goal_checks({"rows": rows, "by_dtype": {}})}
    assert checks["prompt-lookup k=4 never below 0.95x"]["met"] is True
    int8 = checks["prompt-lookup k=4 [int8] never below 0.95x"]
    assert int8["met"] is False and int8["value"].startswith("lowest stem 0.94x")
    assert checks["prompt-lookup k=4 [int8] >= 2.0x on rag"]["met"] is False


def test_verify_cost_goal_is_judged_per_weight_format():
    """With several formats each is judged on its own ratio (float32 on its 4-bit blocks and int8
    on AMX tiles verify at different costs); with one, the run's ratio."""
    from verispec.bench.report import goal_checks

    bound = {"bandwidth_bound_tokens_per_second": 200.0}
    formats = {"float32": {**bound, "verify_cost_ratio": 1.53}, "int8": {**bound, "verify_cost_ratio": 1.29}}
    checks = {c["goal"]: c for c in goal_checks({"rows": [], "by_dtype": formats})}
    assert checks["forward over 5 new tokens <= 1.3x one token (float32)"]["met"] is False
    assert checks["forward over 5 new tokens <= 1.3x one token (int8)"]["met"] is True
    one = goal_checks({"rows": [], "by_dtype": {"float32": bound}, "verify_cost_ratio": 1.2})
    assert {c["goal"]: c["met"] for c in one}["forward over 5 new tokens <= 1.3x one token"] is True


def test_adaptive_goal_states_the_gap_with_its_interval_over_prompts():
    """The adaptive row is compared with the best fixed k of the worst category, and the value
    carries the paired interval of adaptive over that fixed k on that category's prompts."""
    from verispec.bench.report import goal_checks

    def row(label, k, adaptive, cat, speedup):
        return {"label": label, "method": "prompt-lookup", "dtype": "float32", "category": cat,
                "num_speculative_tokens": k, "adaptive": adaptive, "speedup": speedup,
                "outputs_match_baseline": True}  # fmt: skip

    speedups = {"k=4": (1.2, 1.0, 1.1), "k=8": (1.1, 1.1, 1.1), "k=8 adaptive": (1.2, 0.9, 1.05)}
    rows = []
    for name, (a, b, every) in speedups.items():
        label = f"prompt-lookup {name}"
        k, adaptive = int(name[2]), name.endswith("adaptive")
        rows += [row(label, k, adaptive, "a", a), row(label, k, adaptive, "b", b)]
        rows.append(row(label, k, adaptive, "all", every))
    # category b's runs, as its rows say: adaptive at 6 / 7.3 = 0.82 of k=8's rate
    seconds = {"prompt-lookup k=8": [1.0, 2.0, 3.0], "prompt-lookup k=8 adaptive": [1.2, 2.5, 3.6]}
    runs = [
        {"label": label, "prompt": i, "category": "b", "new_tokens": 10, "seconds": sec}
        for label, secs in seconds.items()
        for i, sec in enumerate(secs)
    ]
    results = {"rows": rows, "by_dtype": {}, "runs": runs}
    check = next(c for c in goal_checks(results) if "within 5%" in c["goal"])
    assert check["met"] is False
    assert check["value"].startswith("worst b: 0.82 (") and "(prompt-lookup k=8)" in check["value"]
    lo, hi = (float(x) for x in check["value"].split("(")[1].split(")")[0].split("-"))
    assert 0.8 <= lo <= 6 / 7.3 <= hi <= 1 / 1.2  # between the prompts' own ratios (0.8 and 0.83)
    del results["runs"]  # older result files: the figure without an interval
    check = next(c for c in goal_checks(results) if "within 5%" in c["goal"])
    assert check["value"] == "worst b: 0.82 of the best fixed k (prompt-lookup k=8)"


def test_repeats_keep_each_configs_fastest_round_in_shuffled_orders() -> None:
    from verispec.bench.methods import RunResult, Sampling
    from verispec.bench.runner import run_interleaved
    from verispec.config import SamplingConfig

    configs = [MethodConfig("autoregressive"), MethodConfig("prompt-lookup", k=4)]
    calls: list[tuple[int, str]] = []
    seconds = iter([5.0, 3.0, 1.0, 4.0, 2.0, 6.0, 7.0, 8.0])  # in call order

    def runner(ids, cfg, request):
        calls.append((ids[0], cfg.method))
        return RunResult(token_ids=[1], seconds=next(seconds), first_token_seconds=0.1, first_tokens=1)

    request = Sampling(4, SamplingConfig(temperature=0.0))
    out = run_interleaved(
        configs, dict.fromkeys(configs, runner), [[10], [20]], request, progress=False, repeats=2
    )
    # Every round of a prompt runs every config once; each config keeps its fastest round.
    assert [p for p, _ in calls] == [10, 10, 10, 10, 20, 20, 20, 20]
    for at in range(0, 8, 2):
        assert sorted(m for _, m in calls[at : at + 2]) == ["autoregressive", "prompt-lookup"]
    times = [5.0, 3.0, 1.0, 4.0, 2.0, 6.0, 7.0, 8.0]  # as `seconds` handed them out
    for cfg in configs:
        mine = [t for (_, method), t in zip(calls, times, strict=True) if method == cfg.method]
        assert [r.round_seconds for r in out[cfg]] == [tuple(mine[:2]), tuple(mine[2:])]
        assert [r.seconds for r in out[cfg]] == [min(mine[:2]), min(mine[2:])]
    with pytest.raises(ValueError):
        run_interleaved(configs, dict.fromkeys(configs, runner), [[10]], request, progress=False, repeats=0)


def test_interleaved_orders_are_seeded_shuffles_that_vary_each_configs_predecessor() -> None:
    """Each round's order is a seeded permutation: the same seed gives the same orders, every
    config runs in every position, and each config follows several others (a rotation kept every
    config's predecessor fixed, so what one run left behind fell on the same config each time)."""
    from collections import Counter

    from verispec.bench.methods import RunResult, Sampling
    from verispec.bench.runner import run_interleaved
    from verispec.config import SamplingConfig

    configs = [MethodConfig("prompt-lookup", k=k) for k in range(1, 6)]

    def orders(seed: int) -> list[int]:
        calls: list[int] = []

        def runner(ids, cfg, request):
            calls.append(cfg.k)
            return RunResult(token_ids=[1], seconds=1.0, first_token_seconds=0.1, first_tokens=1)

        request = Sampling(4, SamplingConfig(temperature=0.0))
        prompts = [[i] for i in range(20)]
        run_interleaved(
            configs, dict.fromkeys(configs, runner), prompts, request, progress=False, repeats=2, seed=seed
        )
        return calls

    calls = orders(0)
    assert calls == orders(0) and calls != orders(1)
    rounds = [calls[i : i + 5] for i in range(0, len(calls), 5)]
    assert all(sorted(r) == [1, 2, 3, 4, 5] for r in rounds)
    assert all(len({r[pos] for r in rounds}) == 5 for pos in range(5))  # every config in every position
    before = Counter((r[i - 1], r[i]) for r in rounds for i in range(1, 5))
    assert all(len({a for (a, b) in before if b == k}) >= 3 for k in range(1, 6))


def test_a_peer_probe_reports_how_its_child_failed(tmp_path) -> None:
    """llama.cpp is tried in a child process first: a crash there is a note, not the end of the bench."""
    import sys

    from verispec.bench.peers import child_failure, llama_cpp_failure

    py = sys.executable
    assert child_failure([py, "-c", "pass"], timeout=60) is None
    gone = "import sys; sys.exit('no model here')"
    assert child_failure([py, "-c", gone], timeout=60) == "exit status 1: no model here"
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert child_failure([py, "-c", crash], timeout=60) == "killed by SIGSEGV"
    assert child_failure([py, "-c", "import time; time.sleep(30)"], timeout=0.5) == "no answer within 0 s"
    failure = llama_cpp_failure(tmp_path / "missing.gguf", threads=1, timeout=60)
    assert failure is not None and failure.startswith("exit status 1")


def test_a_llama_cpp_crash_on_an_amx_cpu_names_the_build_without_amx() -> None:
    from verispec.bench.peers import llama_cpp_failure_note

    amx = "Intel(R) Xeon(R) Processor (family 6, model 167; avx2+avx512f+avx512_vnni+avx512_bf16+amx_tile)"
    crash = llama_cpp_failure_note("killed by SIGSEGV", amx)
    assert crash.startswith("llama.cpp failed on this machine (killed by SIGSEGV): llama.cpp skipped")
    assert "without AMX" in crash and "benchmarks/README.md" in crash
    assert "AMX" not in llama_cpp_failure_note("killed by SIGSEGV", "AMD EPYC (family 25, model 1; avx2)")
    assert "AMX" not in llama_cpp_failure_note("exit status 1: no model here", amx)


def test_bandwidth_goal_of_a_format_read_as_4bit_blocks_uses_the_float32_bound():
    """Where float32 matrices are read as their exact 4-bit blocks, the goal is judged against the
    bound of reading the float32 matrices (the issue's), and the value shows both fractions."""
    from verispec.bench.report import goal_checks

    plain = {"plain_decode_tokens_per_second": 120.0, "bandwidth_bound_tokens_per_second": 400.0}
    blocks = {
        **plain,
        "weight_bytes_per_token": 100,
        "dense_weight_bytes_per_token": 450,
        "dense_bound_tokens_per_second": 89.0,
        "plain_fraction_of_bound": 0.30,
        "plain_fraction_of_dense_bound": 120.0 / 89.0,
    }
    dense = {**blocks, "weight_bytes_per_token": 450, "plain_fraction_of_bound": 0.70}
    goal = "plain decoding (float32) >= 75% of the bandwidth bound (decode-only)"
    got = {c["goal"]: c for c in goal_checks({"rows": [], "by_dtype": {"float32": blocks}})}[goal]
    assert got["met"] is True and "135% of reading the float32 matrices" in got["value"]
    assert "30% (120.0 of 400.0 tokens/s) over the 4-bit blocks" in got["value"]
    got = {c["goal"]: c for c in goal_checks({"rows": [], "by_dtype": {"float32": dense}})}[goal]
    assert got["met"] is False and "blocks" not in got["value"]


def test_bandwidth_goal_judges_float32_only() -> None:
    """The issue sets the 75% goal for float32: another format's fraction is shown, not judged."""
    from verispec.bench.report import goal_checks

    w4a8 = {
        "plain_decode_tokens_per_second": 120.0,
        "bandwidth_bound_tokens_per_second": 400.0,
        "weight_bytes_per_token": 100,
        "dense_weight_bytes_per_token": 100,
        "plain_fraction_of_bound": 0.30,
    }
    checks = [c for c in goal_checks({"rows": [], "by_dtype": {"w4a8": w4a8}}) if "bandwidth" in c["goal"]]
    assert len(checks) == 1 and checks[0]["met"] is None
    assert "the goal is float32's" in checks[0]["goal"]
    assert "30% (120.0 of 400.0 tokens/s)" in checks[0]["value"]


def test_a_formats_line_says_where_its_prompts_run() -> None:
    """The kernel-only formats (int4, w4a8) hold ``1 << 30`` as their kernel prompt limit: the line
    says every prompt runs there, not a ten-digit token count."""
    from verispec.bench.report import _kernel_prompts

    assert _kernel_prompts(1 << 30) == ", every prompt on the kernel"
    assert _kernel_prompts(2048) == ", kernel prompts up to 2048 tokens"
    assert _kernel_prompts(None) == ""


def test_verify_readings_split_by_placement_only_where_the_cores_moved() -> None:
    from verispec.bench.measure import by_placement

    ratios = [1.2, 1.3, 1.7, 1.6, 1.25]
    place = by_placement(ratios, [60.0, 65.0, 340.0, 350.0, None])  # the last reading had no probe
    assert place is not None and 65.0 < place["roundtrip_cut_ns"] < 340.0
    assert place["near"] == {"readings": 2, "verify_cost_ratio": 1.25, "roundtrip_ns": 62.5}
    assert place["far"] == {"readings": 2, "verify_cost_ratio": 1.65, "roundtrip_ns": 345.0}
    assert by_placement(ratios, [60.0, 70.0, 80.0, 90.0, 100.0]) is None  # one placement all run
    assert by_placement(ratios, [None] * 5) is None  # no kernel: never read


@requires_kernel
def test_core_roundtrip_is_read_between_two_threads_and_not_with_one() -> None:
    from verispec.bench.measure import core_roundtrip_ns
    from verispec.models.fast_llama import _load_kernel

    kernel = _load_kernel()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ns = kernel.core_roundtrip_ns()
        assert 1.0 < ns < 2e6  # a cache line's trip, not a time slice (2 ms at most per trial)
        assert core_roundtrip_ns() == pytest.approx(ns, rel=100)
        torch.set_num_threads(1)
        assert kernel.core_roundtrip_ns() == -1.0 and core_roundtrip_ns() is None
    finally:
        torch.set_num_threads(before)
