"""Rollback belongs to the cache: after any accepts and rejects, caches hold exactly the committed tokens.

Invariant (``verispec/models/base.py``): ``lengths[row] == len(committed[row]) - 1``, and the logits the
cache produces for the next token equal a fresh forward pass over the committed tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

import verispec
from verispec.api import as_kvmodel, stream_generate
from verispec.config import GenerationConfig, SamplingConfig
from verispec.models.hf import HFModel
from verispec.models.loading import wrap
from verispec.proposers import DraftModelProposer


def backends():
    """(name, factory) pairs: every KVModel implementation over the same tiny float32 weights."""
    out = [("hf", lambda m: HFModel(m))]
    try:
        from verispec.models.fast_llama import FastLlama

        out.append(("fast", lambda m: FastLlama.from_hf(m, max_batch_size=2)))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize(("name", "factory"), backends(), ids=[n for n, _ in backends()])
def test_random_accepts_and_rejects_match_fresh_forward(name, factory):
    model = tiny_llama(vocab_size=64, seed=3, dtype=torch.float32)
    kv = factory(model)
    kv.reset(2)
    g = torch.Generator().manual_seed(0)
    committed = [
        torch.randint(0, 64, (9,), generator=g).tolist(),
        torch.randint(0, 64, (5,), generator=g).tolist(),
    ]
    for row, toks in enumerate(committed):
        kv.forward(torch.tensor([toks[:-1]]), rows=[row], logits="none")
    for _ in range(12):
        # A verification step: pending token + 4 drafts, then keep a random number of them.
        drafts = torch.randint(0, 64, (2, 4), generator=g)
        inputs = torch.cat([torch.tensor([[c[-1]] for c in committed]), drafts], dim=1)
        logits = kv.forward(inputs, logits="all")  # [2, 5, V]
        for row in range(2):
            fresh = model(torch.tensor([committed[row] + drafts[row].tolist()])).logits[
                0, len(committed[row]) - 1 :
            ]
            torch.testing.assert_close(logits[row], fresh, rtol=1e-4, atol=1e-4)
        kept = torch.randint(0, 5, (2,), generator=g)
        for row in range(2):
            committed[row] += drafts[row, : int(kept[row])].tolist() + [
                int(torch.randint(0, 64, (1,), generator=g))
            ]
        kv.truncate(torch.tensor([len(c) - 1 for c in committed]))
        assert kv.lengths.tolist() == [len(c) - 1 for c in committed]


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_engine_keeps_invariant_every_step(drafter):
    target = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    draft_hf = tiny_llama(vocab_size=64, seed=1, layers=1, dtype=torch.float32)
    target_kv = wrap(target)
    proposer = (
        DraftModelProposer(wrap(draft_hf), max_batch_size=2)
        if drafter == "draft-model"
        else verispec.PromptLookup()
    )
    config = GenerationConfig(
        max_new_tokens=25, num_speculative_tokens=4, sampling=SamplingConfig(temperature=1.0), seed=5
    )
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9]]
    steps = 0
    for events in stream_generate(target_kv, proposer, prompts, config):
        for ev in events:
            seq = ev.seq
            if seq.finished:
                continue
            assert int(target_kv.lengths[seq.slot]) == len(seq.tokens) - 1
            # The cache's next-token logits equal a fresh pass over the committed tokens.
            nxt = target_kv.forward(torch.tensor([[seq.tokens[-1]]]), rows=[seq.slot], logits="last")[0]
            fresh = target(torch.tensor([seq.tokens])).logits[0, -1]
            torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4)
            target_kv.truncate(torch.tensor([len(seq.tokens) - 1]), rows=[seq.slot])
            if drafter == "draft-model":
                n = int(proposer.model.lengths[seq.slot])
                assert n == proposer.cached_length(seq.slot)  # the draft's bookkeeping matches its cache
        steps += 1
    assert steps > 3


def test_same_model_as_target_and_draft_gets_two_caches():
    model = tiny_llama(vocab_size=64, seed=0)
    a = as_kvmodel(model)
    b = as_kvmodel(model, fresh=True)
    assert a is as_kvmodel(model) and a is not b
