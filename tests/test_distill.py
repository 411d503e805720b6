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


# ---------------------------------------------------------------------------------------- EAGLE


def _eagle(kv, vocab: int = 48, layer: int = 2, use_kernel: bool | None = None):
    from verispec.distill.model import DraftKV

    cfg = new_config(kv.hf_model, [layer], vocab, trained_head=True, features=True)
    model = build_draft(kv, cfg, torch.arange(vocab))
    return model, DraftKV(model, max_length=kv.max_length, max_batch_size=2, use_kernel=use_kernel)


def _uncut(proposer):
    """``proposer`` with every drafted token verified: a random tiny head is rarely confident, so its
    own estimates would stop drafting and the engine's cost cut would drop the rest."""
    import dataclasses

    from verispec.costs import StepCosts

    proposer.stop_reach = 0.0
    proposer.costs = StepCosts()  # never measured: no cost-based stop either
    propose = proposer.propose
    proposer.propose = lambda *a: dataclasses.replace(propose(*a), accept_probs=None)
    return proposer


def _fast_target(seed: int = 0):
    from verispec.models.loading import wrap

    hf = tiny_llama(vocab_size=64, seed=seed, layers=3, dtype=torch.float32)
    return hf, wrap(hf, backend="fast", max_batch_size=2, max_length=256)


@pytest.mark.parametrize("k", [1, 4])
def test_eagle_greedy_equals_plain_greedy_for_a_batch(k):
    from verispec.distill.eagle import EagleProposer

    _, target = _fast_target()
    _, draft = _eagle(target)
    proposer = _uncut(EagleProposer(target, draft, max_batch_size=2))
    prompts = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3], [2, 7]]
    plain = speculative_generate(
        target, None, prompts, max_new_tokens=30, num_speculative_tokens=0, temperature=0
    )
    spec = speculative_generate(
        target, proposer, prompts, max_new_tokens=30, num_speculative_tokens=k, temperature=0
    )
    for got, want in zip(spec, plain):
        assert got.token_ids == want.token_ids
        assert got.stats.draft_tokens > 0
    # A draft token only ever comes from the head's subset.
    proposal = proposer.propose(
        [0], [prompts[0] + plain[0].token_ids[:3]], torch.tensor([k]), _greedy_params(), [None]
    )
    assert int(proposal.tokens.max()) < 48


def test_eagle_proposals_carry_the_heads_confidence_and_stop_early():
    """Each drafted token comes with the head's probability of it (its chance of acceptance for the
    engine's cost cut), and a row stops drafting once the running product falls below stop_reach."""
    from verispec.distill.eagle import EagleProposer

    _, target = _fast_target()
    _, draft = _eagle(target)
    proposer = EagleProposer(target, draft, max_batch_size=2)
    prompt = [3, 14, 15, 9, 26, 5, 35, 8]
    target.reset(1)
    target.forward(torch.tensor([prompt[:-1]]), rows=[0], logits="none")
    proposer.start(0, prompt)
    proposer.stop_reach = 0.0  # never stop: all 4 tokens
    full = proposer.propose([0], [prompt], torch.tensor([4]), _greedy_params(), [None])
    assert int(full.num_draft[0]) == 4 and full.accept_probs is not None
    probs = full.accept_probs[0]
    assert bool(((probs > 0) & (probs <= 1)).all())
    # The first estimate is the head's softmax probability of its first (argmax) token.
    head = torch.softmax(draft.logits(proposer._feature[0][None]), dim=-1)[0]
    torch.testing.assert_close(probs[0], head[int(full.tokens[0, 0])])
    proposer.stop_reach = float(probs[0]) + 1e-6  # the first token alone already falls below it
    short = proposer.propose([0], [prompt], torch.tensor([4]), _greedy_params(), [None])
    assert int(short.num_draft[0]) == 1 and short.tokens.shape[1] == 1
    assert int(short.tokens[0, 0]) == int(full.tokens[0, 0])

    # With the target's step costs measured, the bar is what one more token costs to draft (the
    # head's measured seconds per token over a target step) and to verify.
    from verispec.costs import StepCosts

    proposer.stop_reach = 0.0
    for step, per_extra, want in ((100.0, 0.0, 4), (1e-9, 0.0, 1), (100.0, 2.0, 1)):
        costs = proposer.costs = StepCosts()
        for _ in range(3):
            costs.record(1, 1, step, context=len(prompt))
            for width in range(2, 7):
                costs.record(1, width, step * (1 + per_extra * (width - 1)), context=len(prompt))
        got = proposer.propose([0], [prompt], torch.tensor([4]), _greedy_params(), [None])
        assert int(got.num_draft[0]) == want, (step, per_extra)
    assert proposer.stop_reaches(3, 1, len(prompt)) == [pytest.approx(2.0, abs=1e-3)] * 3


def test_eagle_sampled_estimates_do_not_depend_on_the_drawn_token():
    """Sampled drafts report sum q^2 of the head's distribution (see expected_acceptance), the same
    whichever token the draw gave; greedy drafts carry the head's next candidates as alternatives."""
    from verispec.config import SamplingConfig
    from verispec.distill.eagle import EagleProposer
    from verispec.proposers import expected_acceptance
    from verispec.sampling import SamplingTensors, logits_to_probs

    _, target = _fast_target()
    _, draft = _eagle(target)
    proposer = EagleProposer(target, draft, max_batch_size=2)
    proposer.stop_reach = 0.0
    prompt = [3, 14, 15, 9, 26, 5, 35, 8]
    target.reset(1)
    target.forward(torch.tensor([prompt[:-1]]), rows=[0], logits="none")
    proposer.start(0, prompt)
    params = SamplingTensors.from_configs([SamplingConfig(temperature=1.5)])
    seen = set()
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        out = proposer.propose([0], [prompt], torch.tensor([1]), params, [gen])
        want = expected_acceptance(logits_to_probs(draft.logits(proposer._feature[0][None]), params))
        torch.testing.assert_close(out.accept_probs[:, 0], want.float())
        assert out.alternatives is None
        seen.add(int(out.tokens[0, 0]))
    assert len(seen) > 1  # different draws, one estimate
    greedy = proposer.propose([0], [prompt], torch.tensor([2]), _greedy_params(), [None])
    head = torch.softmax(draft.logits(proposer._feature[0][None]), dim=-1)[0]
    order = torch.argsort(head, descending=True)[:4]
    assert int(greedy.tokens[0, 0]) == int(order[0])
    assert greedy.alternatives[0, 0].tolist() == order[1:].tolist()
    torch.testing.assert_close(greedy.alternative_probs[0, 0], head[order[1:]])


def _greedy_params():
    from verispec.config import SamplingConfig
    from verispec.sampling import SamplingTensors

    return SamplingTensors.from_configs([SamplingConfig(temperature=0)])


@pytest.mark.parametrize("use_kernel", [False, True])
def test_eagle_feeds_the_targets_recorded_features(use_kernel):
    """After a step, the draft's cache holds exactly the committed pairs (h_t, x_{t+1}), t <= N - 2,
    with the target's own features: its last output equals a one-shot forward over them (to float32
    rounding in torch; to the rounding of bfloat16 weights on the kernel)."""
    from verispec.config import GenerationConfig, SamplingConfig
    from verispec.distill.eagle import EagleProposer
    from verispec.engine import Engine

    _, target = _fast_target()
    model, draft = _eagle(target, use_kernel=use_kernel)
    if use_kernel and not draft.uses_kernel:
        pytest.skip("the C++ kernel is not available here")
    proposer = EagleProposer(target, draft, max_batch_size=2)
    engine = Engine(target, proposer)
    config = GenerationConfig(
        max_new_tokens=40, num_speculative_tokens=3, sampling=SamplingConfig(temperature=0)
    )
    seq = engine.new_sequence([3, 14, 15, 9, 26, 5, 35, 8], config)
    target.reset(1)
    engine.add(seq, 0)
    for _ in range(4):
        engine.step([seq])
    committed = list(seq.tokens)
    proposer.propose([0], [committed], torch.tensor([2]), _greedy_params(), [None])  # catch up
    n = len(committed)
    assert draft.lengths[0] >= n - 1 and proposer._agreed[0] == n - 1
    tol = 3e-2 if use_kernel else 1e-4
    torch.testing.assert_close(proposer._feature[0], one_shot_feature(model, committed), rtol=tol, atol=tol)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_draft_on_the_kernel_matches_torch_and_rolls_back_exactly(weights):
    """The kernel path of a DraftKV (bfloat16 or int8 weights) scores like its torch path, and a
    rejected branch rolled back leaves no trace: re-feeding gives bitwise the one-shot logits and
    features."""
    _, target = _fast_target()
    model, bf16 = _eagle(target)
    if not bf16.uses_kernel:
        pytest.skip("the C++ kernel is not available here")
    from verispec.distill.model import DraftKV

    fast = DraftKV(model, max_length=target.max_length, max_batch_size=2, weights=weights)
    if weights == "int8":  # a byte per weight: the kernel's copies take half of bfloat16's
        copies = bf16.memory_bytes() - fast.memory_bytes()
        assert 0.4 * bf16.memory_bytes() > copies > 0
        with pytest.raises(ValueError):
            DraftKV(model, weights="float16")
    slow = DraftKV(model, max_length=target.max_length, max_batch_size=2, use_kernel=False)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (1, 9), generator=gen)
    feats = torch.randn(1, 9, model.cfg.hidden_size, generator=gen)
    want = slow.forward(ids, rows=[1], logits="all", features=feats)  # [1, 9, V]
    got = fast.forward(ids, rows=[1], logits="all", features=feats)
    assert got.shape == want.shape and bool(torch.isinf(got[..., 48:]).all())
    torch.testing.assert_close(got[..., :48], want[..., :48], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fast.last_features, slow.last_features, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fast.logits(feats[0, -1:]), slow.logits(feats[0, -1:]), rtol=3e-2, atol=3e-2)
    whole, whole_feats = got.clone(), fast.last_features.clone()
    fast.truncate(torch.tensor([4]), rows=[1])
    fast.forward(
        torch.tensor([[7, 7, 7]]), rows=[1], logits="none", features=torch.randn(1, 3, feats.shape[-1])
    )
    fast.truncate(torch.tensor([4]), rows=[1])
    again = fast.forward(ids[:, 4:], rows=[1], logits="all", features=feats[:, 4:])
    assert fast.lengths.tolist() == [0, 9]
    assert torch.equal(again, whole[:, 4:]) and torch.equal(fast.last_features, whole_feats[:, 4:])


def one_shot_feature(model, committed: list[int]) -> torch.Tensor:
    """The EAGLE head's feature after the pairs of ``committed`` (``[hidden]``), from one forward over
    the target's features of all of them (a fresh target with the same weights records them at once)."""
    from verispec.distill.eagle import unrolled_forward

    _, fresh = _fast_target()
    fresh.record_hidden = True
    fresh.forward(torch.tensor([committed[:-1]]), rows=[0], logits="none")
    feats = torch.cat([fresh.last_hidden, fresh.last_hidden[:, -1:]], dim=1)  # [1, n, hidden]
    with torch.no_grad():
        f1, _ = unrolled_forward(model, torch.tensor([committed]), feats, unroll=False)
    return f1[0, len(committed) - 2]


def test_eagle_sampled_run_completes_and_is_seeded():
    from verispec.distill.eagle import EagleProposer

    _, target = _fast_target()
    _, draft = _eagle(target)
    proposer = _uncut(EagleProposer(target, draft, max_batch_size=2))
    runs = [
        speculative_generate(
            target,
            proposer,
            [5, 6, 7, 8],
            max_new_tokens=24,
            num_speculative_tokens=3,
            temperature=0.8,
            seed=3,
            ignore_eos=True,  # the length must not hang on whether this seed's draw ends early
        )
        for _ in range(2)
    ]
    assert len(runs[0].token_ids) == 24 and runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.draft_tokens > 0


def test_eagle_needs_a_target_that_records_features():
    from verispec.distill.eagle import EagleProposer
    from verispec.models.loading import wrap

    hf, target = _fast_target()
    kv = wrap(hf, backend="hf")  # the generic transformers wrapper: no recorded features
    _, draft = _eagle(target)
    with pytest.raises(ConfigError, match="hidden states"):
        EagleProposer(kv, draft)


def test_eagle_draft_round_trips_and_refuses_another_target(tmp_path):
    from verispec.distill.eagle import EagleProposer
    from verispec.distill.shipped import load_proposer

    _, target = _fast_target(seed=0)
    model, _ = _eagle(target)
    with torch.no_grad():
        model.fc.weight.normal_()
    save_draft(tmp_path, model, {"target_name": "tiny", "target_id": target_id(target)})
    proposer = load_proposer(tmp_path, target)
    assert isinstance(proposer, EagleProposer)
    torch.testing.assert_close(proposer.draft.model.fc.weight, model.fc.weight.half().float())
    _, other = _fast_target(seed=1)
    with pytest.raises(ConfigError, match="trained for target 'tiny'"):
        load_proposer(tmp_path, other)


def test_eagle_loss_trains_and_unrolls():
    from verispec.distill.eagle import eagle_loss, unrolled_forward

    _, target = _fast_target()
    model, _ = _eagle(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 48, (2, 12), generator=g)
    feats = torch.randn(2, 12, 32, generator=g)
    f1, f2 = unrolled_forward(model, ids, feats)
    assert f1.shape == (2, 11, 32) and f2.shape == (2, 10, 32)
    # The unrolled step at position t + 1 equals a cached forward that fed f1_t after the teacher pairs.
    from verispec.distill.model import DraftKV

    kv = DraftKV(model, max_length=64)
    kv.forward(ids[:1, 1:5], features=feats[:1, :4], logits="none")  # pairs at positions 0..3
    kv.forward(ids[:1, 5:6], features=f1[:1, 3:4].detach(), logits="none")  # position 4 from f1_3
    torch.testing.assert_close(kv.last_features[0, -1], f2[0, 3].detach(), rtol=1e-4, atol=1e-4)
    lab = torch.randint(0, 48, (2, 12, 4), generator=g)
    prob = torch.softmax(torch.randn(2, 12, 4, generator=g), -1)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(15):
        loss, _ = eagle_loss(model, ids, feats, lab, prob)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first


def test_default_draft_is_the_measured_best_shipped_one(tmp_path, monkeypatch):
    """``--draft-model default`` picks, among the drafts shipped for a target, the one whose recorded
    held-out mean accepted length is highest."""
    from verispec.distill import shipped
    from verispec.distill.eagle import EagleProposer

    _, target = _fast_target()
    eagle_model, _ = _eagle(target)
    plain = build_draft(target, new_config(target.hf_model, [0], 16), torch.arange(16))
    for name, model, mal in (("a-standalone", plain, 1.4), ("b-eagle", eagle_model, 2.1)):
        meta = {
            "target_id": target_id(target),
            "acceptance_after": {"overall": {"mean_accepted_length": mal}},
        }
        save_draft(tmp_path / name, model, meta)
    monkeypatch.setattr(shipped, "SHIPPED", tmp_path)
    assert isinstance(shipped.load_shipped_draft(target), EagleProposer)
    meta_file = tmp_path / "a-standalone" / "draft.json"
    meta = json.loads(meta_file.read_text())
    meta["acceptance_after"]["overall"]["mean_accepted_length"] = 2.5
    meta_file.write_text(json.dumps(meta))
    assert isinstance(shipped.load_shipped_draft(target), DraftModelProposer)


@pytest.mark.slow
def test_shipped_eagle_draft_is_exact_on_the_default_model(default_model):
    """The shipped EAGLE head loads for the default model and greedy output is plain greedy's."""
    from verispec.distill.eagle import EagleProposer
    from verispec.distill.shipped import SHIPPED, load_proposer
    from verispec.tokenizers import encode_prompt

    proposer = load_proposer(SHIPPED / "smollm2-135m-eagle", default_model)
    assert isinstance(proposer, EagleProposer)
    ids = encode_prompt(default_model.tokenizer, "Name three prime numbers and explain why.", chat=True)
    plain = speculative_generate(
        default_model, None, ids, max_new_tokens=32, num_speculative_tokens=0, temperature=0
    )
    spec = speculative_generate(
        default_model, proposer, ids, max_new_tokens=32, num_speculative_tokens=3, temperature=0
    )
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0
