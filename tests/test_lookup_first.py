"""LookupFirst (prompt lookup, else a trained draft): exact, and it really mixes the two drafters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_distill import _eagle, _fast_target, one_shot_feature
from test_exactness import DRAFT, SIGMAS, TARGET, Bigram, exact_law, max_z

import verispec
from verispec.api import as_kvmodel
from verispec.costs import StepCosts
from verispec.costs import best_rate as _best_rate
from verispec.distill.eagle import EagleProposer
from verispec.lookup_first import DRAFT_COST_PRIOR, LookupFirst
from verispec.proposers import DraftModelProposer, PromptLookup

N = 20_000


def test_sampled_law_is_the_targets():
    """Half the rows start from a prompt lookup can continue ("1 0 1 0"), half from one it cannot
    ("2 3 1 0"): lookup's point masses and the draft model's distributions meet in one batch, and the
    first three tokens still follow the target's law (bigram: it depends on the last token only)."""
    prompts = [[1, 0, 1, 0], [2, 3, 1, 0]]
    proposer = LookupFirst(
        DraftModelProposer(as_kvmodel(Bigram(DRAFT)), max_batch_size=N),
        draft_tokens=2,
        draft_cost=0.0,
        prior=0.15,
    )
    results = verispec.speculative_generate(
        Bigram(TARGET),
        proposer,
        torch.tensor(prompts * (N // 2)),
        max_new_tokens=3,
        num_speculative_tokens=3,
        temperature=1.0,
        seed=0,
    )
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert proposer.chosen["lookup"] > 1000 and proposer.chosen["draft"] > 1000
    law = exact_law(TARGET, 0, temperature=1.0, top_k=None, top_p=None)
    assert max_z(counts, law) < SIGMAS


@pytest.mark.parametrize("k", [2, 6])
def test_greedy_with_eagle_equals_plain(k):
    _, target = _fast_target()
    _, draft = _eagle(target)
    proposer = LookupFirst(EagleProposer(target, draft, max_batch_size=2), draft_cost=0.0, prior=0.3)
    prompts = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 14, 15, 9, 26], [2, 7, 2, 7, 2]]
    plain = verispec.speculative_generate(target, None, prompts, max_new_tokens=40, temperature=0)
    spec = verispec.speculative_generate(
        target, proposer, prompts, max_new_tokens=40, num_speculative_tokens=k, temperature=0
    )
    for got, want in zip(spec, plain):
        assert got.token_ids == want.token_ids
    assert proposer.chosen["lookup"] > 0 and proposer.chosen["draft"] > 0


def test_a_draft_that_keeps_failing_gives_way_to_lookup():
    """The draft's acceptance is learned per sequence: one that is never accepted stops being chosen."""

    class Wrong:
        """Proposes a token the sequence never continues with."""

        def start(self, slot, tokens):
            pass

        def propose(self, slots, committed, num_tokens, params, generators):
            k = int(num_tokens.max())
            return verispec.proposers.Proposal(
                tokens=torch.full((len(slots), k), 63), probs=None, num_draft=num_tokens.clone()
            )

    proposer = LookupFirst(Wrong(), PromptLookup(), draft_tokens=1, draft_cost=0.0, prior=0.9)
    seq = [1, 2, 3, 4]
    proposer.start(0, seq)
    for step in range(16):  # a repeating text: lookup's matches grow and hold
        proposer.propose([0], [seq], torch.tensor([2]), _greedy(), [None])
        seq = seq + [1 + step % 4]
    assert proposer.acceptance(0)[0] < 0.75  # learned from 0.9: the draft's tokens failed
    assert proposer.chosen["draft"] >= 1 and proposer.chosen["lookup"] >= 8


def _greedy():
    from verispec.config import SamplingConfig
    from verispec.sampling import SamplingTensors

    return SamplingTensors.from_configs([SamplingConfig(temperature=0)])


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        LookupFirst(PromptLookup(), draft_tokens=0)
    with pytest.raises(ValueError):
        LookupFirst(PromptLookup(), prior=1.5)
    assert np.isclose(LookupFirst(PromptLookup(), prior=0.25).acceptance(7)[0], 0.25)


def test_eagle_reads_the_targets_features_after_steps_it_did_not_draft():
    """Steps drafted by lookup only: the head's later catch-up still feeds every committed pair with
    the target's own feature (kept by observe), as a one-shot forward over them gives."""
    from test_distill import _greedy_params

    from verispec.config import GenerationConfig, SamplingConfig
    from verispec.engine import Engine

    _, target = _fast_target()
    model, draft = _eagle(target)
    eagle = EagleProposer(target, draft, max_batch_size=2)
    proposer = LookupFirst(eagle, draft_cost=0.0, prior=0.0)  # the head is never chosen
    engine = Engine(target, proposer)
    config = GenerationConfig(
        max_new_tokens=40, num_speculative_tokens=3, sampling=SamplingConfig(temperature=0)
    )
    seq = engine.new_sequence([3, 14, 15, 9, 26, 3, 14, 15, 9, 26, 3, 14], config)
    target.reset(1)
    engine.add(seq, 0)
    for _ in range(6):
        engine.step([seq])
    assert proposer.chosen["draft"] == 0 and seq.stats.draft_tokens > 0
    committed = list(seq.tokens)
    eagle.propose([0], [committed], torch.tensor([2]), _greedy_params(), [None])  # catch up
    n = len(committed)
    assert eagle._agreed[0] == n - 1
    torch.testing.assert_close(eagle._feature[0], one_shot_feature(model, committed), rtol=1e-4, atol=1e-4)


def test_default_drafter_is_lookup_first_over_the_shipped_draft(tmp_path, monkeypatch):
    """No drafter named: LookupFirst over the target's shipped draft where the target's steps are
    slow (the fast path without its kernel); prompt lookup alone when no draft is shipped for it,
    when --prompt-lookup is asked for, for an int8 target, and for a target on the kernel."""
    from verispec.commands.drafters import build_proposer
    from verispec.distill import shipped
    from verispec.distill.shipped import save_draft, target_id
    from verispec.models.fast_llama import FastLlama

    hf, target = _fast_target()
    model, _ = _eagle(target)
    slow = FastLlama.from_hf(hf, max_batch_size=2, max_length=256, use_kernel=False)
    slow.hf_model, slow.tokenizer = hf, None  # as `wrap` sets them
    monkeypatch.setattr(shipped, "SHIPPED", tmp_path)
    assert type(build_proposer(slow, None, False)) is PromptLookup  # nothing shipped yet
    save_draft(tmp_path / "eagle", model, {"target_id": target_id(target)})
    chosen = build_proposer(slow, None, False)
    assert isinstance(chosen, LookupFirst) and isinstance(chosen.draft, EagleProposer)
    assert type(build_proposer(slow, None, True)) is PromptLookup
    if target.uses_kernel:  # the kernel's steps are too cheap for the head to pay
        assert type(build_proposer(target, None, False)) is PromptLookup
        named = build_proposer(target, "default", False)  # still there when asked for
        assert isinstance(named, EagleProposer)
    _, other = _fast_target(seed=1)  # another target: the draft is not its own
    assert type(build_proposer(other, None, False)) is PromptLookup
    from verispec.models.loading import wrap

    int8 = wrap(hf, backend="fast", dtype="int8", max_batch_size=2, max_length=256)
    assert target_id(int8) == target_id(target)  # the draft is its own, yet lookup alone pays more
    assert type(build_proposer(int8, None, False)) is PromptLookup
    named = build_proposer(int8, "default", False)  # still there when asked for, in int8 itself
    assert isinstance(named, EagleProposer) and named.draft.weights == "int8"


def test_shipped_drafts_run_in_int8_unless_told_otherwise(monkeypatch, tmp_path):
    """A shipped draft's kernel copy is int8 for a float32 target too (its token costs its reads);
    ``VERISPEC_DRAFT_WEIGHTS`` picks another format, and a format the kernel lacks is an error."""
    from verispec.config import ConfigError
    from verispec.distill import shipped
    from verispec.distill.shipped import draft_weights_for, save_draft, target_id

    _, target = _fast_target()
    model, _ = _eagle(target)
    monkeypatch.setattr(shipped, "SHIPPED", tmp_path)
    save_draft(tmp_path / "eagle", model, {"target_id": target_id(target)})
    monkeypatch.delenv("VERISPEC_DRAFT_WEIGHTS", raising=False)
    assert draft_weights_for(target) == "int8"
    assert shipped.load_draft(tmp_path / "eagle", target).weights == "int8"
    monkeypatch.setenv("VERISPEC_DRAFT_WEIGHTS", "bfloat16")
    assert shipped.load_draft(tmp_path / "eagle", target).weights == "bfloat16"
    monkeypatch.setenv("VERISPEC_DRAFT_WEIGHTS", "float16")
    with pytest.raises(ConfigError, match="VERISPEC_DRAFT_WEIGHTS"):
        draft_weights_for(target)


def test_eagle_token_seconds_leaves_the_proposer_alone():
    from verispec.bench.measure import eagle_token_seconds

    _, target = _fast_target()
    _, draft = _eagle(target)
    eagle = EagleProposer(target, draft, max_batch_size=2)
    before = draft.lengths.clone()
    seconds = eagle_token_seconds(eagle, reps=3)
    assert 0 < seconds < 1 and torch.equal(draft.lengths, before)


def test_memory_report_finds_the_draft_behind_lookup_first():
    from verispec.commands.generate import memory_report

    _, target = _fast_target()
    _, draft = _eagle(target)
    eagle = EagleProposer(target, draft, max_batch_size=2)
    for proposer in (eagle, LookupFirst(eagle)):
        report = memory_report(target, proposer)
        assert report["draft_total"] == draft.memory_bytes() > 0 and "target_kv_cache" in report
    assert not any(k.startswith("draft") for k in memory_report(target, PromptLookup()))
    small = DraftModelProposer(as_kvmodel(tiny_draft := _fast_target(seed=1)[1]))
    assert memory_report(target, small)["draft_kv_cache"] == tiny_draft.cache_bytes()


class _Counting:
    """A draft that proposes token 5 and records how many tokens it was asked for; each call takes
    at least ``sleep`` seconds."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.asked: list[list[int]] = []
        self.sleep = sleep

    def start(self, slot, tokens):
        pass

    def propose(self, slots, committed, num_tokens, params, generators):
        import time

        time.sleep(self.sleep)
        self.asked.append(num_tokens.tolist())
        k = max(1, int(num_tokens.max()))
        return verispec.proposers.Proposal(
            tokens=torch.full((len(slots), k), 5), probs=None, num_draft=num_tokens.clone()
        )


def _costs(step: float, per_extra_token: float) -> StepCosts:
    """Step costs measured as: one token ``step`` seconds, each further token ``per_extra_token``
    of a step more."""
    costs = StepCosts()
    for _ in range(5):
        costs.record(1, 1, step, context=10)
        for width in range(2, 10):
            costs.record(1, width, step * (1 + per_extra_token * (width - 1)), context=10)
    return costs


def test_best_rate_prices_verification_and_drafting() -> None:
    curve = [1.0, 1.2, 1.5, 1.9]
    rate, length = _best_rate([0.9, 0.8, 0.1], curve, 0.0)
    assert length == 2 and rate == pytest.approx((1 + 0.9 + 0.72) / 1.5)
    assert _best_rate([0.9, 0.8, 0.1], curve, 0.5) == (pytest.approx(1.9 / 1.7), 1)
    assert _best_rate([0.1, 0.1], curve, 0.0) == (1.0, 0)  # nothing pays: a plain step
    assert _best_rate([], curve, 0.0) == (1.0, 0)


def test_the_draft_is_asked_only_for_what_pays_at_the_measured_costs() -> None:
    """Cheap verification and a confident draft: it drafts both tokens. Dear verification: it
    drafts one, or none, and a row with nothing worth drafting takes lookup's proposal."""
    seq = list(range(10, 20))  # nothing repeats: lookup has no match
    for per_extra, prior, want in ((0.05, 0.9, [[2]]), (0.3, 0.6, [[1]]), (0.8, 0.4, [])):
        draft = _Counting()
        proposer = LookupFirst(
            draft, draft_tokens=2, draft_cost=0.0, costs=_costs(0.01, per_extra), prior=prior
        )
        proposer.start(0, seq)
        got = proposer.propose([0], [seq], torch.tensor([4]), _greedy(), [None])
        assert draft.asked == want, per_extra
        assert int(got.num_draft[0]) == (want[0][0] if want else 0)


def test_the_drafts_cost_is_measured_against_the_targets_step() -> None:
    costs = _costs(0.004, 0.05)
    draft = _Counting(sleep=0.004)  # a draft call costs at least one target step
    proposer = LookupFirst(draft, draft_tokens=1, costs=costs, prior=0.95)
    assert proposer.draft_cost(1, 10) == DRAFT_COST_PRIOR  # nothing timed yet
    seq = list(range(10, 20))
    proposer.start(0, seq)
    proposer.propose([0], [seq], torch.tensor([1]), _greedy(), [None])
    assert draft.asked == [[1]]
    assert proposer.draft_cost(1, 10) >= 0.9
    # At that cost a 95%-accepted token no longer pays for itself and its verification.
    proposer.propose([0], [seq], torch.tensor([1]), _greedy(), [None])
    assert draft.asked == [[1]]
    assert LookupFirst(draft, draft_cost=0.3).draft_cost() == 0.3  # a fixed cost stays fixed


def test_a_seeded_sampled_row_is_priced_without_the_clock() -> None:
    """Measured costs under which the draft never pays leave a greedy row and an unseeded sampled
    row to lookup, but a seeded sampled row (the engine gives it a ``SeededGenerator``) is priced by
    the prior curve and the prior draft cost, whatever was measured, so its seed reproduces the
    response."""
    from verispec.config import SamplingConfig
    from verispec.sampling import SamplingTensors, SeededGenerator

    seq = list(range(10, 20))
    sampled = SamplingTensors.from_configs([SamplingConfig(temperature=0.7)])
    for params, gens, want in (
        (_greedy(), [None], []),
        (sampled, [torch.Generator()], []),
        (sampled, [SeededGenerator()], [[2]]),
    ):
        draft = _Counting()
        proposer = LookupFirst(draft, draft_tokens=2, costs=_costs(0.01, 0.8), prior=0.9)
        proposer._draft_times.record(1.0, 1)  # measured: a draft token costs 100 target steps
        proposer.start(0, seq)
        proposer.propose([0], [seq], torch.tensor([4]), params, gens)
        assert draft.asked == want


@pytest.mark.parametrize("seed", [None, 3])
def test_the_engine_marks_a_seeded_requests_generator(seed) -> None:
    from verispec.api import speculative_generate
    from verispec.sampling import is_seeded

    _, target = _fast_target()
    seen: list[bool] = []

    class Spy(PromptLookup):
        def propose(self, slots, committed, num_tokens, params, generators):
            seen.extend(is_seeded(g) for g in generators)
            return super().propose(slots, committed, num_tokens, params, generators)

    speculative_generate(
        target, Spy(), [3, 14, 15, 9], max_new_tokens=4, temperature=0.7, seed=seed, num_speculative_tokens=2
    )
    assert seen and all(s == (seed is not None) for s in seen)
