"""Trees of drafts (greedy): alternatives verified beside the chain keep the output exact."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import FreeCosts, tiny_llama

import verispec
import verispec.engine
from verispec.config import GenerationConfig, SamplingConfig
from verispec.costs import best_draft_length, best_tree
from verispec.engine import Engine
from verispec.models.fast_llama import kernel_available
from verispec.models.loading import wrap
from verispec.proposers import Proposal
from verispec.rejection import greedy_verify_tree
from verispec.sampling import SamplingTensors


@pytest.fixture(autouse=True)
def free_verification(monkeypatch):
    """Verify whatever is drafted, whatever this machine's timings (as in test_greedy)."""
    monkeypatch.setattr(verispec.engine, "costs_for", lambda target: FreeCosts())


def test_best_tree_without_alternatives_is_best_draft_length() -> None:
    costs = [1.0, 1.02, 1.05, 1.3, 1.6, 2.0]
    for accept in ([0.9, 0.8, 0.7, 0.2, 0.1], [0.1, 0.9], [0.5] * 5, [0.0, 1.0]):
        assert best_tree(accept, [[] for _ in accept], costs) == (best_draft_length(accept, costs), [])


def test_best_tree_takes_nodes_by_expected_tokens_per_cost() -> None:
    flat = [1.0] * 8
    # Free nodes: everything with a chance is taken; an alternative only beside its chain token.
    assert best_tree([0.5, 0.5], [[0.3, 0.0], [0.2]], flat) == (2, [(0, 0), (1, 0)])
    # Room for three nodes: values 0.5 (chain 0), 0.3 (alt 0.0), 0.25 (chain 1), 0.1 (alt 1.0).
    three = [1.0, 1.0, 1.0, 1.0, 9.0, 9.0]
    assert best_tree([0.5, 0.5], [[0.3], [0.2]], three) == (2, [(0, 0)])
    # An alternative the drafter rates above its own choice is dropped, never verified alone.
    assert best_tree([0.1], [[0.6]], [1.0, 1.0, 1.0]) == (1, [])
    assert best_tree([0.1, 0.9], [[0.6], [0.05]], flat) == (2, [(1, 0)])


def _plain(target, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of plain decoding, EOS or not."""
    return verispec.speculative_generate(
        target, None, prompt, max_new_tokens=n, temperature=0, ignore_eos=True
    ).token_ids


def _one_hot_logits(best: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """``[B, T, vocab]`` logits of +100 at each ``best[b][t]``, -100 elsewhere."""
    out = torch.full((len(best), len(best[0]), vocab), -100.0)
    for b, row in enumerate(best):
        for t, tok in enumerate(row):
            out[b, t, tok] = 100.0
    return out


def test_greedy_verify_tree_accepts_the_alternative_that_is_the_targets_token() -> None:
    chain = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 0, 0]])  # [B, k]
    num_draft = torch.tensor([3, 3, 3, 1])
    alt_tokens = torch.tensor([[7, 5], [7, 5], [6, 6], [8, 0]])  # [B, A]
    alt_positions = torch.tensor([[0, 1], [0, 1], [1, 1], [1, -1]])
    # Target argmax after: pending, chain 0..2, alternative 0, alternative 1.
    best = [
        [1, 5, 9, 9, 9, 4],  # chain misses at 1 with 5; alternative 1 (5 at position 1) hits, then 4
        [1, 2, 3, 8, 9, 9],  # the whole chain accepted, bonus 8; no alternative at position 3
        [1, 6, 9, 9, 3, 2],  # both alternatives are 6 at position 1: the first is taken, then 3
        [4, 8, 9, 9, 7, 9],  # chain [4] accepted; the alternative beside position 1 hits, then 7
    ]
    verdict = greedy_verify_tree(chain, num_draft, alt_tokens, alt_positions, _one_hot_logits(best))
    assert verdict.num_accepted.tolist() == [2, 3, 2, 2]
    assert verdict.alternative.tolist() == [1, -1, 0, 0]
    assert verdict.tokens.tolist() == [
        [1, 5, 4, -1, -1],
        [1, 2, 3, 8, -1],
        [1, 6, 3, -1, -1],
        [4, 8, 7, -1, -1],
    ]
    # Padding alternatives (position -1) never hit, even with the target's token.
    pad = greedy_verify_tree(
        chain[:1],
        num_draft[:1],
        torch.tensor([[5]]),
        torch.tensor([[-1]]),
        _one_hot_logits([[1, 5, 9, 9, 9]]),
    )
    assert pad.alternative.tolist() == [-1] and pad.tokens.tolist() == [[1, 5, -1, -1, -1]]


class NoisyOracle:
    """Drafts the target's known greedy continuation with mistakes: at each position the chain
    token is wrong with probability 0.4, and then the right one is among the alternatives half the
    time. Greedy only; estimates are fixed."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], alternatives: bool, seed: int = 0):
        self.continuations = continuations
        self.alternatives = alternatives
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = 64

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        pass

    def _truth(self, committed: list[int]) -> list[int]:
        for prompt, full in self.continuations.items():  # full: prompt, greedy output, padding
            if tuple(committed[: len(prompt)]) == prompt:
                return full[len(committed) :]
        raise AssertionError("unknown prompt")

    def propose(self, slots, committed, num_tokens, params: SamplingTensors, generators) -> Proposal:
        batch, k = len(slots), int(num_tokens.max())
        tokens = torch.zeros(batch, k, dtype=torch.int64)
        alts = torch.full((batch, k, 2), -1, dtype=torch.int64)
        for row, toks in enumerate(committed):
            truth = self._truth(toks) + [0] * k
            for i in range(k):
                u = torch.rand(3, generator=self.gen)
                shift = int(torch.randint(1, self.vocab, (1,), generator=self.gen))
                wrong = (truth[i] + shift) % self.vocab
                tokens[row, i] = wrong if u[0] < 0.4 else truth[i]
                alts[row, i, 0] = truth[i] if (u[0] < 0.4 and u[1] < 0.5) else (truth[i] + 7) % self.vocab
                alts[row, i, 1] = (truth[i] + 3) % self.vocab
        return Proposal(
            tokens=tokens,
            probs=None,
            num_draft=num_tokens.clone(),
            accept_probs=torch.full((batch, k), 0.6),
            alternatives=alts if self.alternatives else None,
            alternative_probs=torch.full((batch, k, 2), 0.2) if self.alternatives else None,
        )


@pytest.mark.skipif(not kernel_available(), reason="bitwise T-independence is the kernel's")
def test_greedy_tree_output_is_plain_output_and_accepts_more() -> None:
    target = wrap(tiny_llama(vocab_size=64, seed=0, layers=2, hidden=32, dtype=torch.float32))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 14)]
    plain = [_plain(target, p, 40) for p in prompts]
    truth = {tuple(p): p + out + [0] * 16 for p, out in zip(prompts, plain)}
    config = GenerationConfig(
        max_new_tokens=40, num_speculative_tokens=4, sampling=SamplingConfig(temperature=0), ignore_eos=True
    )
    per_call = {}
    for alternatives in (False, True):
        engine = Engine(target, NoisyOracle(truth, alternatives))
        seqs = [engine.new_sequence(p, config) for p in prompts]
        for _ in engine.run(seqs):
            pass
        assert [s.output_ids for s in seqs] == plain, alternatives  # both rows in one batch
        stats = [s.stats for s in seqs]
        per_call[alternatives] = sum(s.new_tokens for s in stats) / sum(s.target_calls for s in stats)
        if alternatives:
            assert all(s.draft_tokens > 4 * s.target_calls for s in stats)  # alternatives verified
            for s in stats:
                assert all(a <= d for a, d in zip(s.accepted_per_position, s.drafted_per_position))
    assert per_call[True] > per_call[False] + 0.1, per_call


@pytest.mark.skipif(not kernel_available(), reason="bitwise T-independence is the kernel's")
def test_sampled_rows_ignore_alternatives() -> None:
    target = wrap(tiny_llama(vocab_size=64, seed=0, layers=2, hidden=32, dtype=torch.float32))
    prompt = list(range(5, 17))
    out = _plain(target, prompt, 20)
    oracle = NoisyOracle({tuple(prompt): prompt + out + [0] * 16}, alternatives=True)
    engine = Engine(target, oracle)
    config = GenerationConfig(
        max_new_tokens=20,
        num_speculative_tokens=3,
        sampling=SamplingConfig(temperature=0.8),
        seed=1,
        ignore_eos=True,
    )
    seqs = [engine.new_sequence(prompt, config)]
    for _ in engine.run(seqs):
        pass
    stats = seqs[0].stats
    assert stats.new_tokens == 20 and stats.draft_tokens == sum(stats.drafted_per_position)


@pytest.mark.skipif(not kernel_available(), reason="bitwise T-independence is the kernel's")
def test_trees_stop_at_the_end_of_the_context() -> None:
    """Near the end of the context a step drops alternatives that would not fit, and still emits
    the plain greedy tokens up to the last position."""
    hf = tiny_llama(vocab_size=64, seed=0, layers=2, hidden=32, dtype=torch.float32)
    target = wrap(hf, max_length=21)
    prompt = list(range(3, 12))  # 9 tokens: 12 more fill the context
    plain = _plain(target, prompt, 12)
    engine = Engine(target, NoisyOracle({tuple(prompt): prompt + plain + [0] * 16}, alternatives=True))
    config = GenerationConfig(
        max_new_tokens=12, num_speculative_tokens=4, sampling=SamplingConfig(temperature=0), ignore_eos=True
    )
    seqs = [engine.new_sequence(prompt, config)]
    for _ in engine.run(seqs):
        pass
    assert seqs[0].output_ids == plain and len(plain) == 12
