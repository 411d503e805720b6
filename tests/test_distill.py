"""verispec.distill: the draft model's exactness, early exit, `verispec distill`, binding to a target."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from verispec.api import as_kvmodel, speculative_generate
from verispec.config import ConfigError
from verispec.distill import EarlyExitProposer, load_draft, load_shipped_draft, target_id
from verispec.distill.early_exit import early_exit_model
from verispec.distill.shipped import build_draft, save_draft
from verispec.distill.train import new_config
from verispec.proposers import DraftModelProposer


def _target(seed: int = 0, layers: int = 3):
    hf = tiny_llama(vocab_size=64, seed=seed, layers=layers, dtype=torch.float32)
    return hf, as_kvmodel(hf, fresh=True)


def test_early_exit_logits_equal_the_targets_truncated_stack():
    hf, kv = _target()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    draft = early_exit_model(kv, num_layers=2)
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states[2]
        expected = hf.lm_head(hf.model.norm(hidden))[0]  # [T, V]
    got = draft.forward(ids, logits="all")[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_draft_cache_rollback_matches_one_shot_forward():
    hf, kv = _target()
    draft = early_exit_model(kv, num_layers=2, max_batch_size=2)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    whole = draft.forward(ids, rows=[1], logits="all")[0]
    draft.truncate(torch.tensor([4]), rows=[1])
    draft.forward(torch.tensor([[7, 7, 7]]), rows=[1], logits="none")  # a rejected branch
    draft.truncate(torch.tensor([4]), rows=[1])
    again = draft.forward(ids[:, 4:], rows=[1], logits="all")[0]
    assert draft.lengths.tolist() == [0, 10]
    torch.testing.assert_close(again, whole[4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_early_exit_greedy_equals_plain_greedy(num_layers):
    hf, kv = _target()
    prompt = [3, 14, 15, 9, 26]
    plain = speculative_generate(kv, None, prompt, max_new_tokens=30, num_speculative_tokens=0, temperature=0)
    spec = speculative_generate(
        kv,
        EarlyExitProposer(kv, num_layers=num_layers),
        prompt,
        max_new_tokens=30,
        num_speculative_tokens=4,
        temperature=0,
    )
    assert spec.token_ids == plain.token_ids
    assert spec.stats.draft_tokens > 0


def test_early_exit_rejects_bad_depth():
    _, kv = _target()
    with pytest.raises(ConfigError, match="num_layers"):
        EarlyExitProposer(kv, num_layers=3)


def _save_tiny_draft(kv, folder, vocab: int = 16, trained_head: bool = False):
    cfg = new_config(kv.hf_model, [0], vocab, trained_head=trained_head)
    model = build_draft(kv, cfg, torch.arange(vocab))
    if trained_head:
        with torch.no_grad():
            model.head.mul_(3.0)  # differs from the target's rows: must survive the round trip
    save_draft(folder, model, {"target_name": "tiny", "target_id": target_id(kv)})
    return model


@pytest.mark.parametrize("trained_head", [False, True])
def test_subset_draft_never_proposes_outside_its_vocabulary_and_stays_lossless(tmp_path, trained_head):
    _, kv = _target()
    saved = _save_tiny_draft(kv, tmp_path, vocab=16, trained_head=trained_head)
    draft = load_draft(tmp_path, kv)
    stored = saved.head.detach().half().float() if trained_head else saved.head  # trained rows ship as fp16
    torch.testing.assert_close(draft.model.head, stored)
    logits = draft.forward(torch.tensor([[1, 2, 3]]), logits="last")[0]
    assert torch.isinf(logits[16:]).all() and torch.isfinite(logits[:16]).all()
    prompt = [5, 6, 7]
    plain = speculative_generate(kv, None, prompt, max_new_tokens=24, num_speculative_tokens=0, temperature=0)
    spec = speculative_generate(
        kv, DraftModelProposer(draft), prompt, max_new_tokens=24, num_speculative_tokens=3, temperature=0
    )
    assert spec.token_ids == plain.token_ids
    sampled = speculative_generate(
        kv,
        DraftModelProposer(draft),
        prompt,
        max_new_tokens=24,
        num_speculative_tokens=3,
        temperature=0.8,
        seed=3,
    )
    assert len(sampled.token_ids) == 24


def test_draft_for_another_target_is_refused(tmp_path):
    _, kv_a = _target(seed=0)
    _, kv_b = _target(seed=1)
    assert target_id(kv_a) != target_id(kv_b)
    _save_tiny_draft(kv_a, tmp_path)
    with pytest.raises(ConfigError, match="trained for target 'tiny'"):
        load_draft(tmp_path, kv_b)
    assert load_shipped_draft(kv_b) is None  # no shipped draft matches a random model


def test_distill_cli_trains_saves_and_resumes(tiny_model_folder, tmp_path, capsys):
    from verispec.cli import main

    out = tmp_path / "draft"
    common = [
        "distill",
        "--target",
        str(tiny_model_folder),
        "--out",
        str(out),
        "--prompts",
        "4",
        "--max-new-tokens",
        "6",
        "--gen-batch",
        "4",
        "--draft-vocab",
        "512",
        "--layers",
        "1",
        "--eval-per-category",
        "1",
        "--eval-tokens",
        "4",
        "--quiet",
    ]
    assert main([*common, "--steps", "2"]) == 0
    meta = json.loads((out / "draft.json").read_text())
    assert meta["config"]["draft_vocab"] == 512 and meta["config"]["init_layers"] == [1]
    assert "--steps 2" in meta["command"] and meta["acceptance_before"]["overall"]["acceptance"] >= 0
    assert torch.load(out / "checkpoint.pt")["step"] == 2
    assert main([*common, "--steps", "3", "--resume"]) == 0
    assert torch.load(out / "checkpoint.pt")["step"] == 3
    from verispec import load_model

    target = load_model(str(tiny_model_folder))
    draft = load_draft(out, target)
    assert draft.model.cfg.draft_vocab == 512
    assert '"after"' in capsys.readouterr().out
