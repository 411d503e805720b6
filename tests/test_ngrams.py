"""The n-gram table of a target's own answers and its drafter (verispec.ngrams, `verispec ngrams`)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from test_exactness import SIGMAS, TARGET, exact_law, first_tokens, max_z

import verispec
from verispec.cli import main
from verispec.commands.ngrams import build, monotone
from verispec.config import ConfigError, SamplingConfig
from verispec.ngrams import (
    SHARE_EDGES,
    NgramLookup,
    NgramTable,
    _hash_columns,
    _hashes,
    expected_accepted,
    load_table,
    save_table,
    share_bucket,
)
from verispec.proposers import PromptLookup
from verispec.sampling import SamplingTensors

GREEDY = SamplingTensors.from_configs([SamplingConfig(temperature=0.0)])
PRIOR = [0.1, 0.2, 0.4, 0.5, 0.6, 0.8, 0.9]


def test_keys_of_one_context_are_those_of_its_columns():
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 262_144, size=(50, 4))  # ids beyond 2^16 as well
    for n in (1, 2, 4):
        columns = _hash_columns([ctx[:, 4 - n + j] for j in range(n)])  # the last n tokens
        assert [_hashes(row.tolist(), 4)[n - 1] for row in ctx] == columns.tolist()
    assert _hashes([1, 2], 2)[1] != _hashes([2, 1], 2)[1]
    assert len(set(_hashes([5, 5, 5], 3))) == 3 and _hashes([7, 8, 9], 2) == _hashes([8, 9], 5)


def test_table_keeps_the_most_frequent_next_token_of_the_longest_context():
    seqs = [[1, 2, 3]] * 3 + [[5, 2, 4]] * 2
    table = NgramTable(seqs, [0] * len(seqs), orders=2)
    # After (5, 2): 4 twice, share 2 / 3. After 2 alone: 3 three times and 4 twice, share 3 / 6.
    assert table.predict([5, 2]) == (4, share_bucket(2 / 3))
    assert table.predict([9, 2]) == (3, share_bucket(3 / 6))
    assert table.predict([1]) == (2, share_bucket(3 / 4))
    assert table.predict([9]) is None and table.predict([]) is None
    assert table.draft([1, 2], 5) == ([3], [share_bucket(3 / 4)])  # nothing ever followed 3


def test_context_tokens_are_never_predicted():
    table = NgramTable([[7, 8, 9, 10]], [2], orders=2)
    assert table.predict([7]) is None  # 8 followed 7, but inside the context
    assert table.predict([8]) == (9, share_bucket(1 / 2))
    assert table.draft([7, 8], 4)[0] == [9, 10]


def test_calibration_counts_hits_by_share_bucket():
    table = NgramTable([[1, 2, 3], [1, 2, 3]], [0, 0], orders=1)
    hits, seen = table.calibrate([[1, 2, 4], [1, 2, 3]], [0, 0])
    bucket = share_bucket(2 / 3)
    assert seen[bucket] == 4 and hits[bucket] == 3  # 1 -> 2 twice, 2 -> 3 once of twice
    assert sum(seen) == 4 and len(hits) == len(SHARE_EDGES)


def test_monotone_pools_violators():
    assert monotone([0.1, 0.5, 0.3, 0.9], [1, 1, 1, 1]) == [0.1, 0.4, 0.4, 0.9]
    assert monotone([0.6, 0.2], [3, 1]) == [0.5, 0.5]
    assert monotone([0.1, 0.2], [1, 1]) == [0.1, 0.2]


def test_expected_accepted_tokens():
    assert expected_accepted([]) == 0.0
    assert expected_accepted([0.5, 0.5]) == pytest.approx(0.75)


def test_save_and_load_round_trip(tmp_path):
    seqs = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5]]
    table = NgramTable(seqs, [1, 2], orders=3)
    save_table(tmp_path, table, {"target_id": "x", "prior": PRIOR})
    again, meta = load_table(tmp_path)
    assert again.sequences == seqs and again.context == [1, 2] and again.orders == 3
    assert meta["prior"] == PRIOR
    for ctx in ([1, 4], [6], [2, 6, 5], [5, 3]):
        assert again.predict(ctx) == table.predict(ctx)
    with pytest.raises(ValueError, match="prior"):
        save_table(tmp_path, table, {"prior": [0.5]})
    with pytest.raises(ConfigError, match="not an n-gram table"):
        load_table(tmp_path / "missing")


def test_a_table_for_another_target_is_refused(tmp_path):
    save_table(tmp_path, NgramTable([[1, 2]], [0]), {"target_id": "0123456789abcdef", "prior": PRIOR})
    with pytest.raises(ConfigError, match="built for another target"):
        load_table(tmp_path, tiny_llama())


def propose(drafter, tokens: list[int], k: int = 4):
    return drafter.propose([0], [tokens], torch.tensor([k]), GREEDY, [None])


def test_drafts_from_the_table_where_lookup_has_nothing():
    drafter = NgramLookup(NgramTable([[10, 11, 12, 13, 14]] * 9, [0] * 9, orders=2), PRIOR)
    tokens = [1, 2, 3, 10]  # 10 never occurred before in the sequence: nothing to copy
    drafter.start(0, tokens)
    prop = propose(drafter, tokens)
    assert prop.tokens.shape == (1, 4) and prop.accept_probs.shape == (1, 4)
    assert prop.tokens[0].tolist() == [11, 12, 13, 14] and int(prop.num_draft[0]) == 4
    assert prop.accept_probs[0].tolist() == pytest.approx([PRIOR[share_bucket(9 / 10)]] * 4)
    assert drafter.table_drafts == 1


def test_keeps_the_draft_expected_to_give_more():
    table = NgramTable([[22, 90, 91, 92, 93]] * 9, [0] * 9, orders=2)  # after 22: 90 91 92 93
    tokens = [10, 20, 21, 22, 23, 24, 25, 26, 9, 10, 20, 21, 22]  # lookup copies 23 24 25 26
    alone = PromptLookup()
    alone.start(0, tokens)
    copied = propose(alone, tokens)
    assert copied.tokens[0].tolist() == [23, 24, 25, 26]
    rarely = NgramLookup(table, [0.05] * len(SHARE_EDGES))  # a table that is rarely right
    rarely.start(0, tokens)
    prop = propose(rarely, tokens)
    assert prop.tokens[0].tolist() == [23, 24, 25, 26]
    assert prop.accept_probs[0].tolist() == copied.accept_probs[0].tolist()
    assert rarely.lookup_drafts == 1 and rarely.table_drafts == 0
    often = NgramLookup(table, [0.99] * len(SHARE_EDGES))  # one nearly always right
    often.start(0, tokens)
    prop = propose(often, tokens)
    assert prop.tokens[0].tolist() == [90, 91, 92, 93] and prop.accept_probs[0].tolist() == pytest.approx(
        [0.99] * 4
    )
    assert often.lookup_drafts == 0 and often.table_drafts == 1


def test_table_estimates_are_learned_per_sequence():
    table = NgramTable([[10 + i, 200 + i] for i in range(4)], [0] * 4, orders=1)
    drafter = NgramLookup(table, PRIOR, prior_weight=1.0)
    b = share_bucket(1 / 2)
    tokens = [5, 10]
    drafter.start(0, tokens)
    for i in range(3):  # the target never follows 10 + i with 200 + i here; nothing recurs to copy
        prop = propose(drafter, tokens, 1)
        assert prop.tokens[0].tolist() == [200 + i] and prop.accept_probs[0, 0].item() == pytest.approx(
            PRIOR[b] / (1.0 + i)
        )  # (prior * 1 + 0 hits) / (1 + i seen)
        tokens = tokens + [99 + i, 11 + i]


def test_greedy_output_is_the_targets_with_tables_right_and_wrong():
    target = tiny_llama(vocab_size=64, seed=3)
    prompt = [1, 7, 3, 9]
    plain = verispec.speculative_generate(
        target, None, torch.tensor(prompt), max_new_tokens=40, temperature=0.0
    )
    out = plain.token_ids
    rng = random.Random(0)
    wrong = [[rng.randrange(64) for _ in range(30)] for _ in range(20)]
    for seqs, context in (([prompt[-3:] + out], [3]), (wrong, [0] * 20)):
        drafter = NgramLookup(NgramTable(seqs, context), [0.9] * len(SHARE_EDGES))
        got = verispec.speculative_generate(
            target,
            drafter,
            torch.tensor(prompt),
            max_new_tokens=40,
            num_speculative_tokens=4,
            temperature=0.0,
        )
        assert got.token_ids == out
        assert drafter.table_drafts > 0 and got.stats.draft_tokens > 0
    assert got.stats.accepted_tokens < got.stats.draft_tokens  # the wrong table was rejected too


def test_sampled_outputs_follow_the_target_law():
    """Point-mass drafts from a table of the toy target's likely paths keep the target's law."""
    seqs = [[0, 0, 1, 2, 2, 3, 3, 0]] * 5 + [[0, 2, 2, 0, 0]] * 3
    drafter = NgramLookup(NgramTable(seqs, [0] * len(seqs), orders=2), [0.6] * len(SHARE_EDGES))
    counts, drafted = first_tokens(drafter, temperature=1.0)
    assert drafted > 0
    assert max_z(counts, exact_law(TARGET, 0, temperature=1.0, top_k=None, top_p=None)) < SIGMAS


def test_build_calibrates_each_category_on_a_table_of_the_others():
    rows = [{"prompt": [1, 2, 3, 4], "answer": [5, 6, 7]}, {"prompt": [4], "answer": [5, 6, 0]}] * 2
    table, meta = build(rows, orders=2, folds=[0, 1, 2, 2], meta={"target_id": "t"})
    cal = meta["calibration"]
    assert cal["folds"] == 3 and cal["positions"] == 12
    # Every answer's 5 and 6 hit. After 5 6: fold 0 meets 7 once and 0 once (a tie: the smaller
    # id, 0, a miss); fold 1 meets 7 twice and 0 once (a miss); fold 2 meets one of each, so its 7
    # misses and its 0 hits.
    assert sum(cal["predictions"]) == 12 and sum(cal["hits"]) == 9
    assert len(meta["prior"]) == len(SHARE_EDGES) and meta["prior"] == sorted(meta["prior"])
    assert meta["corpus"] == {"sequences": 4, "tokens": 12, "source": meta["corpus"]["source"]}
    assert table.predict([2, 3, 4]) == (5, share_bucket(2 / 3))  # (3, 4): 5 twice
    with pytest.raises(ConfigError, match="two categories"):
        build(rows, orders=2, folds=[0] * 4, meta={})


def test_ngrams_command_builds_a_table_the_generate_command_uses(tiny_model_folder, tmp_path, capsys):
    out = tmp_path / "table"
    args = ["ngrams", "--model", str(tiny_model_folder), "--prompts", "6", "--max-new-tokens", "6"]
    assert main([*args, "--batch-size", "4", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(1 <= len(r["answer"]) <= 6 for r in rows)
    meta = json.loads((out / "ngrams.json").read_text())
    assert meta["command"].startswith("verispec ngrams") and len(meta["prior"]) == len(SHARE_EDGES)
    # A rerun resumes: every prompt already has its answer, so the corpus stays as it was.
    assert main([*args, "--out", str(out)]) == 0
    assert len((out / "corpus.jsonl").read_text().splitlines()) == 6
    capsys.readouterr()
    gen = ["generate", "--model", str(tiny_model_folder), "--ngrams", str(out), "--max-new-tokens", "8"]
    assert main([*gen, "--json", "hello"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*gen, "--prompt-lookup", "hello"]) == 2
    assert "choose one drafter" in capsys.readouterr().err


def tiny_table_and_prompt(tiny_model_folder, tmp_path):
    """A one-sequence n-gram table bound to the tiny model, and a one-prompt Spec-Bench file."""
    from verispec.distill.shipped import target_id

    target = verispec.load_model(str(tiny_model_folder))
    table = tmp_path / "table"
    save_table(table, NgramTable([[1, 2, 3]], [0]), {"target_id": target_id(target), "prior": PRIOR})
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]}) + "\n"
    )
    return table, prompts


def test_bench_runs_lookup_with_a_table(tiny_model_folder, tmp_path):
    table, prompts = tiny_table_and_prompt(tiny_model_folder, tmp_path)
    out = tmp_path / "out"
    args = ["bench", "--model", str(tiny_model_folder), "--prompts", str(prompts), "--max-new-tokens", "6"]
    args += ["--methods", "autoregressive,lookup+ngrams", "-k", "2", "--adaptive", "none", "--no-progress"]
    assert main([*args, "--ngrams", str(table), "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    mine = [r for r in rows if r["method"] == "lookup+ngrams"]
    assert {r["category"] for r in mine} == {"qa", "all"}
    assert all(r["outputs_match_baseline"] is True for r in mine)
    # Without --ngrams there is no table for this target: the rows are skipped with a note.
    assert main([*args, "--out", str(tmp_path / "none")]) == 0
    results = json.loads((tmp_path / "none" / "results.json").read_text())
    assert not any(r["method"] == "lookup+ngrams" for r in results["rows"])
    assert any("no n-gram table" in n for n in results["notes"])


def test_default_drafter_takes_the_shipped_table(tiny_model_folder, tmp_path, monkeypatch):
    """Where prompt lookup drafts by default (an int8 target, or one on the kernel), a table shipped
    for the target drafts beside it; --prompt-lookup still means lookup alone."""
    import verispec.ngrams as ngrams
    from verispec.commands.drafters import build_proposer
    from verispec.distill.shipped import target_id

    target = verispec.load_model(str(tiny_model_folder), dtype="int8")
    monkeypatch.setattr(ngrams, "SHIPPED", tmp_path)
    assert type(build_proposer(target, None, False)) is PromptLookup  # no table for this target
    save_table(
        tmp_path / "other", NgramTable([[1, 2]], [0]), {"target_id": "0123456789abcdef", "prior": PRIOR}
    )
    assert type(build_proposer(target, None, False)) is PromptLookup  # another target's table
    save_table(tmp_path / "mine", NgramTable([[1, 2]], [0]), {"target_id": target_id(target), "prior": PRIOR})
    chosen = build_proposer(target, None, False)
    assert isinstance(chosen, NgramLookup) and len(chosen.table) == 1
    assert type(build_proposer(target, None, True)) is PromptLookup
    assert isinstance(build_proposer(target, None, False, ngrams="default"), NgramLookup)


def test_vllm_ngram_draft_name_means_prompt_lookup():
    import argparse

    from verispec.commands.common import check_model_arguments
    from verispec.entrypoints.openai.api_server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-model", "[ngram]", "--num-speculative-tokens", "4"])
    check_model_arguments(args)
    assert args.prompt_lookup is True and args.draft_model is None
    args = parser.parse_args(["--speculative-model", "[ngram]", "--ngrams"])
    with pytest.raises(ConfigError, match="choose one drafter"):
        check_model_arguments(args)


def test_tune_measures_lookup_with_a_table(tiny_model_folder, tmp_path, capsys):
    table, prompts = tiny_table_and_prompt(tiny_model_folder, tmp_path)
    args = ["tune", "--model", str(tiny_model_folder), "--prompts", str(prompts), "--max-new-tokens", "6"]
    assert main([*args, "--k-max", "4", "--ngrams", str(table), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["method"] == "lookup+ngrams" and report["draft_cost"] > 0
    assert set(report["categories"]) == {"qa", "all"}
    assert all(0 <= c["draft_fraction"] <= 1 for c in report["categories"].values())
    assert main([*args, "--ngrams", str(table), "--prompt-lookup"]) == 2
    assert "choose one drafter: --prompt-lookup or --ngrams" in capsys.readouterr().err
