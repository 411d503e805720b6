"""Losslessness end to end: the law of the first emitted tokens equals the target's, analytically.

Toy bigram models (logits depend on the previous token) have a known law, so the exact probability of
every 3-token continuation is a product of three transformed rows. We draw many sequences through
the full engine (draft model proposer, caches, rollback, bonus tokens) and compare. The same test
with a deliberately broken residual must fail, which shows it has the power to catch such bugs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import verispec
import verispec.engine
import verispec.rejection
import verispec.sampling
from verispec.models import fast_llama
from verispec.models.fast_llama import kernel_available
from verispec.proposers import Proposal, expected_acceptance
from verispec.rejection import Verdict, inverse_cdf, uniforms
from verispec.sampling import logits_to_probs

V = 4
N = 20_000
STEPS = 3


class Bigram:
    """``logits(ids)[i] = table[ids[i]]``: the next token depends only on the current one."""

    def __init__(self, table: np.ndarray):
        self.table = torch.tensor(table)
        self.vocab_size = table.shape[1]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]


def reference_transform(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None):
    """An independent numpy implementation of temperature -> top-k -> top-p -> softmax."""
    z = logits / temperature
    if top_k:
        kth = np.sort(z)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    if top_p is not None:
        order = np.argsort(-z)
        probs = np.exp(z[order] - z[order][0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        drop = order[before >= top_p]
        z = z.copy()
        z[drop] = -np.inf
    e = np.exp(z - z.max())
    return e / e.sum()


def exact_law(table: np.ndarray, start: int, **sampling) -> dict[tuple[int, ...], float]:
    rows = [reference_transform(table[i], **sampling) for i in range(V)]
    law = {}
    for seq in itertools.product(range(V), repeat=STEPS):
        p, prev = 1.0, start
        for tok in seq:
            p *= rows[prev][tok]
            prev = tok
        law[seq] = p
    return law


TARGET = np.array(
    [[2.0, 0.5, -1.0, 0.3], [0.1, 1.5, 0.2, -0.5], [1.0, -1.0, 1.2, 0.0], [0.0, 0.4, -0.3, 1.1]]
)
DRAFT = np.array([[-1.0, 1.5, 0.5, 0.0], [1.2, -0.4, 0.6, 0.1], [0.0, 0.9, -0.5, 1.0], [1.3, 0.2, 0.2, -0.8]])


def first_tokens(draft, temperature=1.0, top_k=None, top_p=None, k=2, seed=0, dtype=np.float64):
    """N sequences of STEPS tokens after the prompt [0] through the engine with ``draft``, the target
    giving ``dtype`` logits: ``(counts of each continuation, draft tokens verified in all)``."""
    results = verispec.speculative_generate(
        Bigram(TARGET.astype(dtype)),
        draft,
        torch.zeros(N, 1, dtype=torch.int64),
        max_new_tokens=STEPS,
        num_speculative_tokens=k,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        assert len(r.token_ids) == STEPS
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts, sum(r.stats.draft_tokens for r in results)


def empirical_law(temperature, top_k, top_p, k=2, seed=0, dtype=np.float64):
    return first_tokens(Bigram(DRAFT.astype(dtype)), temperature, top_k, top_p, k=k, seed=seed, dtype=dtype)[
        0
    ]


def max_z(counts, law) -> float:
    worst = 0.0
    for seq, p in law.items():
        emp = counts.get(seq, 0) / N
        if p == 0:
            assert emp == 0, f"{seq} has probability 0 but was emitted"
            continue
        se = np.sqrt(p * (1 - p) / N)
        worst = max(worst, abs(emp - p) / se)
    return worst


# 64 cells: 5 standard errors keeps the family-wise false-alarm rate below 1e-4.
SIGMAS = 5.0
SETTINGS = [
    pytest.param(1.0, None, None, id="temperature-1"),
    pytest.param(0.7, None, None, id="temperature-0.7"),
    pytest.param(1.0, 2, None, id="top-k-2"),
    pytest.param(1.0, None, 0.7, id="top-p-0.7"),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_first_three_tokens_follow_target_law(temperature, top_k, top_p):
    law = exact_law(TARGET, 0, temperature=temperature, top_k=top_k, top_p=top_p)
    counts = empirical_law(temperature, top_k, top_p)
    assert max_z(counts, law) < SIGMAS


class Counting:
    """The kernel module with a count of calls to each of its functions."""

    def __init__(self, module):
        self.module = module
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.module, name)(*args, **kwargs)

        return call


@pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS[2:])  # the filters: 6 s each
def test_kernel_transform_and_draws_follow_target_law(monkeypatch, temperature, top_k, top_p):
    """Float32 logits with the kernel loaded: both models' transforms and every draw are the
    kernel's one-pass ones (``sampling_probs``, ``draw_rows``), and the law still holds."""
    kernel = Counting(fast_llama._load_kernel())
    chooser = lambda values: kernel if values.dtype == torch.float32 else None  # noqa: E731
    monkeypatch.setattr(verispec.sampling, "sampling_kernel", chooser)
    monkeypatch.setattr(verispec.rejection, "sampling_kernel", chooser)
    law = exact_law(TARGET, 0, temperature=temperature, top_k=top_k, top_p=top_p)
    counts = empirical_law(temperature, top_k, top_p, dtype=np.float32)
    assert kernel.calls.get("sampling_probs", 0) >= 2 * STEPS and kernel.calls.get("draw_rows", 0) >= STEPS
    assert max_z(counts, law) < SIGMAS


def broken_rejection_sample(
    draft_tokens, draft_probs, target_probs, num_draft, token_uniforms, accept_uniforms=None
):
    """The classic bug: after a rejection, resample from the target instead of the residual."""
    batch, k = draft_tokens.shape
    rand = token_uniforms
    p_t = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
    p_d = (
        torch.ones_like(p_t)
        if draft_probs is None
        else draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    )
    tested = token_uniforms[:, :k] if accept_uniforms is None else accept_uniforms
    accept = (tested * p_d < p_t) & (torch.arange(k)[None] < num_draft[:, None])
    num_accepted = accept.long().cumprod(1).sum(1)
    final = target_probs.gather(1, num_accepted.view(batch, 1, 1).expand(-1, 1, target_probs.shape[-1]))[:, 0]
    tokens = torch.full((batch, k + 1), -1, dtype=torch.int64)
    keep = torch.arange(k)[None] < num_accepted[:, None]
    tokens[:, :k] = torch.where(keep, draft_tokens, tokens[:, :k])
    tokens.scatter_(
        1, num_accepted[:, None], inverse_cdf(final, rand.gather(1, num_accepted[:, None])[:, 0])[:, None]
    )
    return Verdict(tokens=tokens, num_accepted=num_accepted)


def test_broken_residual_is_detected(monkeypatch):
    def broken_from_logits(draft_tokens, draft_probs, target_logits, params, *rest):
        return broken_rejection_sample(
            draft_tokens, draft_probs, logits_to_probs(target_logits, params), *rest
        )

    monkeypatch.setattr(verispec.engine, "rejection_sample_logits", broken_from_logits)
    law = exact_law(TARGET, 0, temperature=1.0, top_k=None, top_p=None)
    counts = empirical_law(1.0, None, None)
    assert max_z(counts, law) > SIGMAS


class EstimatingDraft:
    """The bigram draft as a proposer that also reports each token's chance of acceptance, so the
    engine cuts drafts to the length worth their cost (as it does for the EAGLE head):
    ``estimate(draft_probs [B, V], previous_tokens [B], tokens [B]) -> [B]``."""

    def __init__(self, table: np.ndarray, estimate):
        self.table = torch.tensor(table)
        self.estimate = estimate

    def start(self, slot, tokens) -> None:
        pass

    def propose(self, slots, committed, num_tokens, params, generators) -> Proposal:
        k = int(num_tokens.max())
        prev = torch.tensor([c[-1] for c in committed])  # [B]
        tokens, probs, accept = [], [], []
        for _ in range(k):
            q = logits_to_probs(self.table[prev], params)  # [B, V]
            tok = inverse_cdf(q, uniforms(generators, 1)[:, 0])
            tokens.append(tok)
            probs.append(q)
            accept.append(self.estimate(q, prev, tok))
            prev = tok
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            probs=torch.stack(probs, dim=1),
            num_draft=num_tokens.clone(),
            accept_probs=torch.stack(accept, dim=1).float(),
        )


@pytest.mark.parametrize(
    ("estimate", "lossless"),
    [
        pytest.param(lambda q, prev, tok: expected_acceptance(q), True, id="expected-acceptance"),
        pytest.param(
            lambda q, prev, tok: q.gather(1, tok[:, None])[:, 0], False, id="drawn-token-probability"
        ),
    ],
)
def test_drafts_cut_by_their_estimates_keep_the_law(monkeypatch, estimate, lossless):
    """Cutting a sampled draft by an estimate that depends on the drawn token breaks losslessness
    (a token verified only when the draft liked it is emitted too often); the estimate drafters
    report must not. A steep cost curve makes the cuts frequent."""
    monkeypatch.setattr(
        verispec.engine, "fixed_ratios", lambda widths: [1.0 + 0.3 * w for w in range(widths)]
    )
    law = exact_law(TARGET, 0, temperature=1.0, top_k=None, top_p=None)
    counts, drafted = first_tokens(EstimatingDraft(DRAFT, estimate))
    assert drafted > N // 2  # drafts were verified, and cut
    assert (max_z(counts, law) < SIGMAS) == lossless


ESTIMATE_AFTER = torch.tensor([0.5, 0.9, 0.05, 0.05])


@pytest.mark.parametrize(
    "lookahead", [pytest.param(False, id="stopping-rule"), pytest.param(True, id="lookahead")]
)
def test_sampled_draft_lengths_never_look_at_later_tokens(monkeypatch, lookahead):
    """A sampled draft's estimate for token i + 1 may depend on token i (the draft's distribution
    there follows from it; here the estimate is 0.5 after token 0, the prompt, 0.9 after token 1
    and 0.05 after the others). Choosing the length by looking ahead (one token not worth its cost,
    two worth it after a 0 or a 1) would verify the first token only when it is 0 or 1, and break
    the law; the engine cuts sampled drafts by a stopping rule instead, which drafts only where the
    first token pays by itself (after a 1)."""
    from verispec.costs import best_draft_length

    monkeypatch.setattr(verispec.engine, "fixed_ratios", lambda widths: [1.0] + [1.6] * (widths - 1))
    if lookahead:  # the engine as it was: every row looks ahead
        monkeypatch.setattr(
            verispec.engine,
            "best_draft_length",
            lambda accept, costs, lookahead=True: best_draft_length(accept, costs),
        )
    law = exact_law(TARGET, 0, temperature=1.0, top_k=None, top_p=None)
    counts, drafted = first_tokens(EstimatingDraft(DRAFT, lambda q, prev, tok: ESTIMATE_AFTER[prev]))
    assert drafted > N // 10  # after a 1, one token pays
    assert (max_z(counts, law) < SIGMAS) != lookahead


def test_seed_reproduces_a_sampled_response():
    target, draft = Bigram(TARGET), Bigram(DRAFT)
    ids = torch.tensor([0, 1, 2])
    a = verispec.speculative_generate(target, draft, ids, max_new_tokens=20, temperature=0.8, seed=11)
    b = verispec.speculative_generate(target, draft, ids, max_new_tokens=20, temperature=0.8, seed=11)
    c = verispec.speculative_generate(target, draft, ids, max_new_tokens=20, temperature=0.8, seed=12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_reference_implementation_follows_target_law():
    """The readable oracle in verispec.reference obeys the same law (temperature 1)."""
    from verispec.reference import speculative_decode

    gen = torch.Generator().manual_seed(3)
    n = 4000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        out = speculative_decode(
            Bigram(TARGET), Bigram(DRAFT), torch.tensor([0]), max_new_tokens=2, k=2, generator=gen
        )
        key = tuple(out[1:].tolist())
        counts[key] = counts.get(key, 0) + 1
    rows = [reference_transform(TARGET[i], 1.0, None, None) for i in range(V)]
    for a, b in itertools.product(range(V), repeat=2):
        p = rows[0][a] * rows[a][b]
        se = np.sqrt(p * (1 - p) / n)
        assert abs(counts.get((a, b), 0) / n - p) < SIGMAS * se


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_point_mass_drafts_emit_the_plain_sampled_tokens(temperature, top_k, top_p):
    """Prompt lookup's drafts are point masses, so a seeded request's tokens are the plain seeded
    request's, token for token (the verdict emits the target's own draw at each position). That holds
    whatever the drafts and their lengths, which here follow the clock (the Bigram's measured step
    costs), and whichever rows share the batch."""
    prompts = torch.tensor([[0, 1, 2, 3, 0, 1, 3, 2, 0, 2]] * 300)  # [300, 10]
    settings = dict(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    target = Bigram(TARGET)
    plain = verispec.speculative_generate(target, None, prompts, num_speculative_tokens=0, **settings)
    for k in (2, 5):
        drafted = verispec.speculative_generate(
            target, verispec.PromptLookup(), prompts, num_speculative_tokens=k, **settings
        )
        assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
        assert sum(r.stats.accepted_tokens for r in drafted) > 0
        assert sum(r.stats.draft_tokens for r in drafted) > sum(r.stats.accepted_tokens for r in drafted)
    # A row alone: its seed in the batch was seed + 7.
    alone = verispec.speculative_generate(
        target, verispec.PromptLookup(), prompts[7], num_speculative_tokens=3, **{**settings, "seed": 18}
    )
    assert alone.token_ids == plain[7].token_ids
