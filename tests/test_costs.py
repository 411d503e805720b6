"""Cost-aware draft length: measured step costs, the length rule, and prompt lookup learning its
acceptance, alone and through the engine (whose greedy output must not change)."""

from __future__ import annotations

import pytest
import torch

from verispec.config import GenerationConfig, SamplingConfig
from verispec.costs import (
    PRIOR_EXTRA_TOKEN_COST,
    StepCosts,
    best_draft_length,
    context_bucket,
    costs_for,
    fixed_ratios,
)
from verispec.engine import Engine
from verispec.models.toy import LogitsModel
from verispec.proposers import LOOKUP_ACCEPTANCE_PRIOR, PromptLookup
from verispec.sampling import SamplingTensors

V = 32


class FixedCosts(StepCosts):
    """A step of w tokens costs ``1 + per_token * (w - 1)``; records nothing."""

    def __init__(self, per_token: float):
        super().__init__()
        self.per_token = per_token

    def record(self, batch: int, width: int, seconds: float, context: int = 0) -> None:
        pass

    def ratio(self, width: int, batch: int = 1, context: int = 0) -> float:
        return 1.0 + self.per_token * max(width - 1, 0)


class Scrambled:
    """Greedy next token: a hash of the token and its position, so copies from earlier rarely hold."""

    vocab_size = V

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        nxt = (ids * 7 + torch.arange(len(ids)) ** 2 * 5 + 1) % V
        out = torch.full((len(ids), V), -20.0)
        out[torch.arange(len(ids)), nxt] = 20.0
        return out


class Successor:
    """Greedy next token = ``(token * step + 1) % V``, from +20/-20 logits."""

    def __init__(self, step: int):
        self.vocab_size = V
        nxt = (torch.arange(V) * step + 1) % V
        self.table = torch.full((V, V), -20.0)
        self.table[torch.arange(V), nxt] = 20.0

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def generate(model, prompt, costs: StepCosts | None, k: int = 8, n: int = 40, temperature=0.0, seed=None):
    """Run one sequence through the engine; ``costs`` None is plain decoding."""
    engine = Engine(LogitsModel(model), None if costs is None else PromptLookup(), costs=costs)
    config = GenerationConfig(
        max_new_tokens=n,
        num_speculative_tokens=0 if costs is None else k,
        sampling=SamplingConfig(temperature=temperature),
        seed=seed,
        ignore_eos=True,
    )
    seq = engine.new_sequence(prompt, config)
    for _ in engine.run([seq]):
        pass
    return seq


def test_length_rule_trades_expected_tokens_against_cost() -> None:
    free = [1.0] * 9
    assert best_draft_length([0.3] * 8, free) == 8  # verification free: every draft token is a gain
    assert best_draft_length([0.0] * 8, free) == 0
    int8 = [1.0 + 0.17 * n for n in range(9)]  # measured int8: 5 tokens cost 1.68 steps
    assert best_draft_length([0.15] * 8, int8) == 0  # 1.15 tokens for 1.17: not worth it
    assert best_draft_length([0.99] * 8, int8) == 8
    # A confident first token then a doubtful rest: draft only the first.
    assert best_draft_length([0.95, 0.1, 0.1, 0.1], int8[:5]) == 1
    assert best_draft_length([0.5, 0.5], [1.0]) == 0  # no cost known past 0 drafts: draft nothing


def test_a_draft_must_beat_break_even_by_the_weight_on_extra_cost() -> None:
    int8 = [1.0, 1.17, 1.25]  # a 2-token step: 1.17, so one copied token breaks even at 17%
    assert best_draft_length([0.2], int8) == 1  # 1.2 tokens for 1.17 (the default weight is 1)
    assert best_draft_length([0.2], int8, extra_cost_weight=1.5) == 0  # 1.2 for 1 + 1.5 * 0.17
    assert best_draft_length([0.25], int8, extra_cost_weight=1.5) == 0
    assert best_draft_length([0.27], int8, extra_cost_weight=1.5) == 1  # 1.5 times break-even
    # The margin scales with the extra cost: float32's 5% a token needs only 7.5%.
    assert best_draft_length([0.08], [1.0, 1.05], extra_cost_weight=1.5) == 1
    assert best_draft_length([0.07], [1.0, 1.05], extra_cost_weight=1.5) == 0


def test_step_costs_are_ratios_to_the_one_token_step() -> None:
    costs = StepCosts()
    assert costs.ratio(1) == 1.0
    assert costs.ratio(5) == pytest.approx(1 + 4 * PRIOR_EXTRA_TOKEN_COST)  # nothing measured: prior
    costs.record(1, 5, 0.05)  # no one-token figure yet to compare with: ignored
    for _ in range(5):
        costs.record(1, 1, 0.010)
    costs.record(1, 5, 0.016)
    costs.record(1, 5, 0.017)
    assert costs.ratio(5) == pytest.approx(1 + 4 * PRIOR_EXTRA_TOKEN_COST)  # 2 samples: not enough
    costs.record(1, 5, 0.90)  # an outlier (another process ran)
    costs.record(1, 5, 0.017)
    assert costs.ratio(5) == pytest.approx(1.7)
    # Unmeasured widths extrapolate the measured cost per extra token (0.175), not the prior's.
    assert costs.ratio(9) == pytest.approx(1.7 + 4 * 0.175)
    assert costs.ratio(3) == pytest.approx(1 + 2 * PRIOR_EXTRA_TOKEN_COST)
    assert costs.ratio(5, batch=2) == pytest.approx(1 + 4 * PRIOR_EXTRA_TOKEN_COST)  # per batch size
    assert costs.ratios(3) == [1.0, costs.ratio(2), costs.ratio(3)]


def test_a_measured_prior_stands_in_until_the_process_measures_a_width() -> None:
    """A curve measured once on this machine replaces the 5% guess, and this process's own figures
    replace it in turn."""
    costs = StepCosts(prior=[1.0, 1.2, 1.5, 1.9])
    assert [costs.ratio(w) for w in (1, 2, 3, 4)] == pytest.approx([1.0, 1.2, 1.5, 1.9])
    assert costs.ratio(6) == pytest.approx(1.9 + 2 * 0.3)  # past it: its mean cost per extra token
    assert costs.ratio(3, batch=2, context=2000) == pytest.approx(1.5)  # no figures anywhere yet
    for _ in range(3):
        costs.record(1, 1, 0.010)
        costs.record(1, 3, 0.013)
    assert costs.ratio(3) == pytest.approx(1.3)  # measured here
    assert costs.ratio(4) == pytest.approx(1.45)  # extrapolated from this process's width 3
    assert StepCosts(prior=[1.0]).ratio(3) == pytest.approx(1 + 2 * PRIOR_EXTRA_TOKEN_COST)
    cheap = StepCosts(prior=[1.0, 1.01])  # past the curve, never cheaper than the constant prior
    assert cheap.ratio(4) == pytest.approx(1.01 + 2 * PRIOR_EXTRA_TOKEN_COST)


def test_a_rarely_seen_context_keeps_its_figures_until_it_comes_back() -> None:
    """Samples expire after ``horizon`` steps in their own bucket: long prompts among many short
    ones keep what their wide steps cost, while short contexts' figures still expire."""
    costs = StepCosts()
    for _ in range(3):
        costs.record(1, 1, 0.010, context=1000)
        costs.record(1, 9, 0.022, context=1000)
        costs.record(1, 1, 0.010, context=100)
        costs.record(1, 9, 0.018, context=100)
    for _ in range(costs.horizon):  # many short requests meanwhile
        costs.record(1, 1, 0.010, context=100)
    assert costs.ratio(9, context=1000) == pytest.approx(2.2)  # kept
    assert costs.ratio(9, context=100) == pytest.approx(1 + 8 * PRIOR_EXTRA_TOKEN_COST)  # expired


def test_a_width_judged_too_dear_is_measured_again_later() -> None:
    costs = StepCosts()
    for _ in range(5):
        costs.record(1, 1, 0.010)
    for _ in range(3):
        costs.record(1, 2, 0.030)  # a burst of load while width 2 was tried
    assert costs.ratio(2) == pytest.approx(3.0)
    for _ in range(costs.horizon):
        costs.record(1, 1, 0.010)  # width 2 is never drafted again, so never remeasured
    assert costs.ratio(2) == pytest.approx(1 + PRIOR_EXTRA_TOKEN_COST)  # expired: tried again


def test_kept_medians_equal_medians_computed_afresh() -> None:
    """``ratio`` keeps each width's median between samples: a random stream of steps (widths 1-4,
    with long gaps so samples expire) must give what a fresh median over the unexpired window
    gives, at every step."""
    import random
    import statistics

    rng = random.Random(0)
    costs = StepCosts()
    costs.horizon = 40
    for _ in range(600):
        width = rng.choice([1, 1, 1, 2, 3, 4]) if rng.random() < 0.7 else 1
        costs.record(1, width, rng.uniform(0.005, 0.02))
        for w in range(2, 5):
            now = costs._steps[1, 0]
            window = [r for step, r in costs._ratios.get((1, 0, w), []) if step > now - costs.horizon]
            fresh = statistics.median(window) if len(window) >= costs.min_samples else None
            assert costs._measured(1, 0, w) == fresh


def test_context_buckets_double_from_256_tokens() -> None:
    assert [context_bucket(c) for c in (0, 255, 256, 511, 512, 1023, 1024, 2047, 2048)] == [
        0, 0, 1, 1, 2, 2, 3, 3, 4
    ]  # fmt: skip


def test_step_costs_are_kept_per_context_bucket() -> None:
    """A wide step costs more at a long context (its attention reads the cache per token): each
    bucket keeps its own ratio, against its own one-token time; a bucket with nothing measured
    borrows the nearest shorter one, else takes the (optimistic) prior, never a longer one's."""
    costs = StepCosts()
    for _ in range(3):  # only a long context measured so far: longer ones read it, shorter ones not
        costs.record(1, 1, 0.011, context=1000)
        costs.record(1, 5, 0.0165, context=1000)
    assert costs.ratio(5, context=5000) == pytest.approx(1.5)
    assert costs.ratio(5, context=100) == pytest.approx(1 + 4 * PRIOR_EXTRA_TOKEN_COST)
    for _ in range(3):
        costs.record(1, 1, 0.010, context=100)
        costs.record(1, 5, 0.012, context=100)
    assert costs.ratio(5, context=100) == pytest.approx(1.2)
    assert costs.ratio(5, context=600) == pytest.approx(1.5)  # the same bucket as 1000
    assert costs.ratio(5, context=1000) == pytest.approx(1.5)
    assert costs.ratio(5, context=300) == pytest.approx(1.2)  # nothing at 256-511: the shorter bucket
    assert costs.ratio(5, context=5000) == pytest.approx(1.5)  # nothing past 2048: the nearest below
    # A wide step where no one-token step was timed has nothing to be compared with: not recorded.
    for _ in range(3):
        costs.record(1, 5, 0.100, context=5000)
    assert costs.ratio(5, context=5000) == pytest.approx(1.5)
    # Within a bucket, an unmeasured width extrapolates that bucket's own widths.
    assert costs.ratio(9, context=100) == pytest.approx(1.2 + 4 * 0.05)
    assert costs.ratio(9, context=1000) == pytest.approx(1.5 + 4 * 0.125)
    assert costs.ratios(3, context=1000) == [1.0, costs.ratio(2, context=1000), costs.ratio(3, context=1000)]


class RecordingCosts(StepCosts):
    """Step costs that remember each step's (width, context) and cost nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, int]] = []
        self.asked: list[int] = []

    def record(self, batch: int, width: int, seconds: float, context: int = 0) -> None:
        self.steps.append((width, context))

    def ratio(self, width: int, batch: int = 1, context: int = 0) -> float:
        self.asked.append(context)
        return 1.0


def test_the_engine_times_each_step_at_its_context() -> None:
    """Every step is recorded, and its costs read, at the tokens cached before it."""
    costs = RecordingCosts()
    prompt = list(range(V)) + [0, 1, 2]
    seq = generate(Successor(1), prompt, costs, k=4, n=30)
    assert any(width > 1 for width, _ in costs.steps)
    contexts = [context for _, context in costs.steps] + [len(seq.tokens) - 1]
    assert contexts[0] == len(prompt) - 1
    # Each step moves the context on by the tokens it emitted: at least 1, at most its width.
    for (width, _), before, after in zip(costs.steps, contexts, contexts[1:]):
        assert 1 <= after - before <= width
    assert set(costs.asked) <= set(contexts[:-1]) and costs.asked


def test_costs_stay_with_the_target() -> None:
    a, b = LogitsModel(Successor(1)), LogitsModel(Successor(1))
    assert costs_for(a) is costs_for(a)
    assert costs_for(a) is not costs_for(b)
    assert Engine(a, PromptLookup()).costs is costs_for(a)


def test_lookup_learns_its_acceptance_from_what_was_committed() -> None:
    pl = PromptLookup()
    params = SamplingTensors.from_configs([SamplingConfig(temperature=0.0)])
    seq = [7, 3, 9, 1, 5, 2, 3]  # "3" recurs: a 1-token match proposing 9, 1, 5, ...
    pl.start(0, seq)
    prior = pl.acceptance(0, 1)
    assert prior == pytest.approx(LOOKUP_ACCEPTANCE_PRIOR[0])
    prop = pl.propose([0], [seq], torch.tensor([4]), params, [None])
    assert prop.tokens[0].tolist() == [9, 1, 5, 2]
    assert prop.accept_probs[0].tolist() == pytest.approx([pl.acceptance(0, n) for n in (1, 2, 3, 4)])
    for new in range(20, 28):  # after each "3" comes a token never seen: the copy always fails
        seq = seq + [new, 3]
        pl.propose([0], [seq], torch.tensor([4]), params, [None])
    assert pl.acceptance(0, 1) < prior / 2
    pl.start(0, seq)  # a new sequence starts from the prior again
    assert pl.acceptance(0, 1) == pytest.approx(prior)


def test_lookup_counts_every_copied_token_the_target_confirmed() -> None:
    pl = PromptLookup(prior_weight=1.0)
    params = SamplingTensors.from_configs([SamplingConfig(temperature=0.0)])
    seq = [1, 2, 3, 4, 5, 6, 9, 1]  # match "1" proposes 2, 3, 4, 5
    pl.start(0, seq)
    pl.propose([0], [seq], torch.tensor([4]), params, [None])
    pl.propose([0], [seq + [2, 3, 8]], torch.tensor([4]), params, [None])  # two held, the third not
    p = LOOKUP_ACCEPTANCE_PRIOR
    assert pl.acceptance(0, 1) == pytest.approx((p[0] + 1) / 2)
    assert pl.acceptance(0, 2) == pytest.approx((p[1] + 1) / 2)
    assert pl.acceptance(0, 3) == pytest.approx(p[2] / 2)


def test_costly_verification_drafts_nothing_on_short_matches_and_stays_exact() -> None:
    model = Scrambled()  # 1-token matches whose copies fail
    prompt = [3, 5, 3, 9, 11]
    plain = generate(model, prompt, None)
    costly = generate(model, prompt, FixedCosts(0.7))
    free = generate(model, prompt, FixedCosts(0.0))
    assert costly.output_ids == free.output_ids == plain.output_ids
    assert costly.stats.draft_tokens == 0
    assert free.stats.draft_tokens > 0


def test_long_copies_are_drafted_even_at_int8_cost() -> None:
    model = Successor(1)  # counts up: the prompt's run of the cycle is copied and accepted
    prompt = list(range(V)) + [0, 1, 2]
    plain = generate(model, prompt, None)
    spec = generate(model, prompt, FixedCosts(0.17))
    assert spec.output_ids == plain.output_ids
    assert spec.stats.mean_accepted_length > 4


def test_seeded_sampled_lookup_follows_the_clock_and_the_seed_still_decides() -> None:
    """Prompt lookup's drafts are point masses: a seeded sampled request emits the target's own draw
    at each position whatever was drafted, so its drafts are priced by measured costs like any
    other row's, and the seed still gives one response, the plain one."""
    model = Successor(1)
    prompt = list(range(V)) + [0, 1, 2]
    costly = generate(model, prompt, FixedCosts(50.0), n=20, temperature=0.5, seed=3)
    free = generate(model, prompt, FixedCosts(0.0), n=20, temperature=0.5, seed=3)
    plain = generate(model, prompt, None, n=20, temperature=0.5, seed=3)
    assert costly.stats.draft_tokens == 0
    assert free.stats.draft_tokens > 0 and free.stats.accepted_tokens > 0
    assert costly.output_ids == free.output_ids == plain.output_ids


def test_engine_marks_rows_whose_drafts_it_cut_by_cost() -> None:
    seq = generate(Successor(1), list(range(V)) + [0, 1, 2], FixedCosts(0.17), n=8)
    assert seq.cut_by_cost


def test_seeded_sampled_rows_are_priced_by_a_fixed_curve_that_skips_long_shots() -> None:
    """Rows priced without the clock (a seeded sampled request) are never measured, so their curve
    is not the optimistic exploration prior: at 1.1 for two tokens a copied token must be accepted
    more than a tenth of the time to be drafted (at the prior's 1.05, a twentieth)."""
    assert fixed_ratios(5) == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])
    assert best_draft_length([0.08], fixed_ratios(2)) == 0
    assert best_draft_length([0.08], [1.0, 1 + PRIOR_EXTRA_TOKEN_COST]) == 1
    assert best_draft_length([0.3, 0.9], fixed_ratios(3)) == 2
