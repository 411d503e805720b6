"""The rejection sampler as a pure function: exact greedy cases and its output law."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.rejection import ACCEPT_STREAM, TOKEN_STREAM, inverse_cdf, position_uniforms, rejection_sample

V = 6


def rand(batch: int, count: int, seed: int = 0) -> torch.Tensor:
    """``[batch, count]`` float64 uniforms."""
    return torch.rand(batch, count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """``[1, len, V]`` logits of +100 at each token and -100 elsewhere."""
    out = torch.full((1, len(tokens), V), -100.0)
    for i, t in enumerate(tokens):
        out[0, i, t] = 100.0
    return out


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


@pytest.mark.parametrize(
    ("draft", "target", "accepted", "emitted"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [1, 5, 3, 4], 1, [1, 5]),  # rejected at 1: recovered = target's token
        ([0, 2, 3], [1, 2, 3, 4], 0, [1]),  # rejected at once
        ([1], [1, 0], 1, [1, 0]),
    ],
)
def test_greedy_cases(draft, target, accepted, emitted):
    draft_tokens = torch.tensor([draft])
    draft_probs = greedy(one_hot_logits(draft))
    target_probs = greedy(one_hot_logits(target))
    k = len(draft)
    verdict = rejection_sample(
        draft_tokens, draft_probs, target_probs, torch.tensor([k]), rand(1, k + 1), rand(1, k, seed=1)
    )
    assert int(verdict.num_accepted[0]) == accepted
    assert verdict.tokens[0, : accepted + 1].tolist() == emitted
    assert (verdict.tokens[0, accepted + 1 :] == -1).all()


def test_point_mass_draft_greedy_and_partial_rows():
    """Point-mass drafts (None probs) and rows with fewer real drafts than k."""
    draft_tokens = torch.tensor([[1, 2, 3], [1, 2, 3]])
    target_probs = greedy(torch.cat([one_hot_logits([1, 2, 3, 4]), one_hot_logits([1, 2, 0, 4])]))
    verdict = rejection_sample(draft_tokens, None, target_probs, torch.tensor([3, 1]), rand(2, 4))
    assert verdict.num_accepted.tolist() == [3, 1]
    assert verdict.tokens[0].tolist() == [1, 2, 3, 4]
    assert verdict.tokens[1].tolist() == [1, 2, -1, -1]  # only one real draft: bonus after it


def first_token_law(draft_probs: torch.Tensor, target_probs: torch.Tensor, n: int, point_mass: bool = False):
    """Empirical law of the first emitted token over ``n`` independent rows (draft token ~ draft_probs)."""
    torch.manual_seed(1234)
    draft_tokens = torch.multinomial(draft_probs, n, replacement=True)[:, None]  # [n, 1]
    dp = None if point_mass else draft_probs.expand(n, 1, V)
    tp = target_probs.expand(n, 2, V)
    verdict = rejection_sample(
        draft_tokens, dp, tp, torch.ones(n, dtype=torch.int64), rand(n, 2), rand(n, 1, seed=1)
    )
    return torch.bincount(verdict.tokens[:, 0], minlength=V).double() / n


def assert_law(empirical: torch.Tensor, exact: torch.Tensor, n: int, sigmas: float = 5.0) -> None:
    """Each cell within ``sigmas`` standard errors (Bonferroni-safe for a handful of cells)."""
    se = torch.sqrt(exact * (1 - exact) / n).clamp_min(1.0 / n)
    z = ((empirical - exact).abs() / se).max().item()
    assert z < sigmas, f"max z-score {z:.1f}: empirical {empirical.tolist()} vs exact {exact.tolist()}"


def test_first_token_follows_target_law():
    n = 200_000
    draft = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
    target = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3, 0.0], dtype=torch.float64)
    emp = first_token_law(draft, torch.stack([target, target]), n)
    assert_law(emp, target, n)


def test_point_mass_first_token_follows_target_law():
    """A drafter without probabilities is a point mass at its token: still exact."""
    n = 200_000
    target = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3, 0.0], dtype=torch.float64)
    draft = torch.zeros(V, dtype=torch.float64)
    draft[3] = 1.0
    emp = first_token_law(draft, torch.stack([target, target]), n, point_mass=True)
    assert_law(emp, target, n)


def test_inverse_cdf_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 4, dtype=torch.float64)
    u = torch.tensor([0.0, 0.4999, 0.5, 0.999999], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]


def test_one_hot_draft_probs_follow_target_law():
    """A drafter that gives distributions may still give a point mass at some positions (lookup's
    rows beside a draft model's); those positions take the point-mass form, and the law holds."""
    n = 200_000
    target = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3, 0.0], dtype=torch.float64)
    draft = torch.zeros(V, dtype=torch.float64)
    draft[2] = 1.0
    emp = first_token_law(draft, torch.stack([target, target]), n)
    assert_law(emp, target, n)


def test_point_mass_rows_emit_the_targets_own_draws():
    """With point-mass drafts every emitted token, accepted or not, is the target's inverse-cdf draw
    at its position from that position's uniform: what plain sampling emits with the same uniforms."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        batch, k = 3, int(torch.randint(1, 6, (1,), generator=g))
        target_probs = torch.softmax(
            2 * torch.randn(batch, k + 1, V, generator=g, dtype=torch.float64), dim=-1
        )
        u = rand(batch, k + 1, seed=trial)
        own = inverse_cdf(target_probs.reshape(-1, V), u.reshape(-1)).view(batch, k + 1)
        # Drafts that follow the target's draws for a while, then guess.
        drafts = torch.where(
            torch.rand(batch, k, generator=g) < 0.7, own[:, :k], torch.randint(0, V, (batch, k), generator=g)
        )
        num_draft = torch.randint(0, k + 1, (batch,), generator=g)
        one_hot = torch.zeros(batch, k, V, dtype=torch.float64).scatter_(-1, drafts[..., None], 1.0)
        for draft_probs in (None, one_hot):
            verdict = rejection_sample(
                drafts, draft_probs, target_probs, num_draft, u, rand(batch, k, seed=1)
            )
            for b in range(batch):
                n = int(verdict.num_accepted[b])
                assert verdict.tokens[b, : n + 1].tolist() == own[b, : n + 1].tolist()
                assert n == num_draft[b] or int(drafts[b, n]) != int(own[b, n])  # stopped at a miss
                assert (verdict.tokens[b, n + 1 :] == -1).all()


def test_rows_without_drafts_take_the_targets_token_from_the_first_uniform():
    """A plain sampled step (nothing drafted in any row) takes its own short path; the token is the
    target's draw with the row's first uniform, as when another row's drafts send it down the
    general path."""
    k = 3
    target_probs = torch.softmax(torch.randn(2, k + 1, V, dtype=torch.float64), dim=-1)
    toks = torch.randint(0, V, (2, k))
    for seed in range(20):
        u = rand(2, k + 1, seed=seed)
        alone = rejection_sample(toks, None, target_probs, torch.zeros(2, dtype=torch.int64), u)
        assert torch.equal(alone.tokens[:, 0], inverse_cdf(target_probs[:, 0], u[:, 0]))
        assert torch.equal(alone.tokens[:, 1:], torch.full((2, k), -1))
        assert torch.equal(alone.num_accepted, torch.zeros(2, dtype=torch.int64))
        mixed = rejection_sample(toks, None, target_probs, torch.tensor([0, 2]), u)
        assert int(mixed.tokens[0, 0]) == int(alone.tokens[0, 0]) and int(mixed.num_accepted[0]) == 0


def test_sampled_drafts_need_accept_uniforms():
    draft_probs = torch.full((1, 2, V), 1.0 / V, dtype=torch.float64)
    target_probs = torch.full((1, 3, V), 1.0 / V, dtype=torch.float64)
    with pytest.raises(ValueError, match="accept_uniforms"):
        rejection_sample(torch.tensor([[1, 2]]), draft_probs, target_probs, torch.tensor([2]), rand(1, 3))


def test_position_uniforms_depend_only_on_key_stream_and_position():
    whole = position_uniforms([7, 8], [0, 0], 10, TOKEN_STREAM)  # [2, 10]
    assert whole.dtype == torch.float64 and whole.shape == (2, 10)
    assert ((whole >= 0) & (whole < 1)).all()
    assert torch.equal(
        position_uniforms([8, 7], [4, 2], 3, TOKEN_STREAM), torch.stack([whole[1, 4:7], whole[0, 2:5]])
    )
    assert torch.equal(whole, position_uniforms([7, 8], [0, 0], 10, TOKEN_STREAM))
    other = position_uniforms([7, 8], [0, 0], 10, ACCEPT_STREAM)
    assert not torch.isclose(whole, other).any()
    assert not torch.isclose(whole[0], whole[1]).any()  # neighbouring seeds: unrelated streams


def test_position_uniforms_look_uniform_and_independent():
    """Seeds 0..999 at positions 0..199 (how a batch of seeded requests uses them): each of 20 bins
    holds its share, and neighbouring positions and neighbouring seeds are uncorrelated."""
    u = position_uniforms(list(range(1000)), [0] * 1000, 200, TOKEN_STREAM).numpy()  # [1000, 200]
    n = u.size
    counts = torch.histc(torch.from_numpy(u).float(), bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 60.0  # 19 degrees of freedom: p < 1e-5 beyond 50
    z = u - 0.5
    for a, b in ((z[:, 1:], z[:, :-1]), (z[1:], z[:-1])):
        corr = float((a * b).mean() / (z * z).mean())
        assert abs(corr) < 5 / math.sqrt(a.size)


def test_greedy_verify_equals_rejection_sample_on_one_hot():
    from verispec.rejection import greedy_verify

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = int(torch.randint(0, 6, (1,), generator=g))  # k = 0: a plain step (its own fast path)
        logits = torch.randn(3, k + 1, V, generator=g, dtype=torch.float64)
        best = logits.argmax(-1)
        # Drafts agree with the argmax for a random prefix, then differ.
        draft = torch.where(
            torch.rand(3, k, generator=g) < 0.7, best[:, :k], torch.randint(0, V, (3, k), generator=g)
        )
        num_draft = torch.randint(0, k + 1, (3,), generator=g)
        one_hot = torch.zeros_like(logits).scatter_(-1, best[..., None], 1.0)
        draft_one_hot = torch.zeros(3, k, V, dtype=torch.float64).scatter_(-1, draft[..., None], 1.0)
        a = rejection_sample(draft, draft_one_hot, one_hot, num_draft, rand(3, k + 1), rand(3, k, seed=1))
        b = greedy_verify(draft, logits, num_draft)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


def test_argmax_last_is_torch_argmax_with_ties_and_nan() -> None:
    from verispec.rejection import argmax_last

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (3, 5, 50), generator=g).float()  # many ties
    x[0, 1, 7] = float("nan")
    x[2, 0, 3] = float("nan")
    x[2, 0, 9] = float("nan")
    for t in (x, x.double(), x[:, 1:4], x.transpose(0, 1)):
        got = argmax_last(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logits_walk_equals_the_verdict_on_the_whole_transform(dtype):
    """``rejection_sample_logits`` transforms a row's logits at a position only when the walk gets
    there; its verdict is ``rejection_sample``'s on the whole transform, token for token, with greedy,
    top-k and top-p rows in one batch and both kinds of draft."""
    from verispec.config import SamplingConfig
    from verispec.rejection import rejection_sample_logits
    from verispec.sampling import SamplingTensors, logits_to_probs

    g = torch.Generator().manual_seed(0)
    configs = [
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=0.8, top_k=3),
        SamplingConfig(temperature=1.0, top_p=0.7),
        SamplingConfig(temperature=0.5),
    ]
    params = SamplingTensors.from_configs(configs)
    batch = len(configs)
    for trial in range(100):
        k = int(torch.randint(0, 5, (1,), generator=g))
        logits = (2 * torch.randn(batch, k + 1, V, generator=g, dtype=torch.float64)).to(dtype)
        target_probs = logits_to_probs(logits, params)
        own = inverse_cdf(target_probs.reshape(-1, V), rand(batch, k + 1, seed=trial).reshape(-1)).view(
            batch, k + 1
        )
        guesses = torch.randint(0, V, (batch, k), generator=g)
        drafts = torch.where(torch.rand(batch, k, generator=g) < 0.6, own[:, :k], guesses)
        num_draft = torch.randint(0, k + 1, (batch,), generator=g)
        sampled = torch.softmax(torch.randn(batch, k, V, generator=g, dtype=torch.float64), dim=-1)
        for draft_probs in (None, sampled):
            args = (num_draft, rand(batch, k + 1, seed=trial), rand(batch, k, seed=trial + 1000))
            whole = rejection_sample(drafts, draft_probs, target_probs, *args)
            walked = rejection_sample_logits(drafts, draft_probs, logits, params, *args)
            assert torch.equal(whole.tokens, walked.tokens) and torch.equal(
                whole.num_accepted, walked.num_accepted
            )
