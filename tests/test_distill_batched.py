"""The batched EAGLE trainer (verispec.distill.batched) on a tiny random Llama, on the CPU."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import tiny_llama

from verispec.distill import batched
from verispec.distill.shipped import build_draft
from verispec.distill.train import choose_vocab, new_config


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=64, seed=0, layers=2, hidden=32, dtype=torch.float32)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 64, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_answer_label_batches_train(tiny):
    prompts = _prompts(6)
    pairs = batched.answer(
        tiny, prompts, [0], temperature=0.0, max_new_tokens=5, batch_size=4, seed=0, deadline=time.time() + 60
    )
    assert sorted(p for p, _ in pairs) == sorted(prompts)  # every prompt answered once (left padding)
    for p, a in pairs:  # greedy answers are what the model generates for the prompt alone
        alone = tiny.generate(
            torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=0, pad_token_id=0
        )
        want = alone[0, len(p) :].tolist()
        assert a == want[: len(a)] and 1 <= len(a) <= 5
    corpus = batched.label(tiny, pairs, batch_tokens=24)
    assert len(corpus) == len(pairs)
    for seq, (p, a) in zip(corpus, pairs):
        ids = torch.tensor(p + a)
        assert seq["ids"].tolist() == ids.tolist() and seq["start"] == len(p)
        assert seq["top_ids"].shape == (len(a), batched.TOP) and seq["feats"].shape == (len(ids), 32)
        with torch.no_grad():  # labels and features as one unpadded forward gives them
            out = tiny(ids[None], output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0, len(p) - 1 : -1], -1)
        assert torch.equal(seq["top_ids"][:, 0], logp.argmax(-1))
        torch.testing.assert_close(
            seq["top_logp"].float(), logp.topk(batched.TOP).values, atol=2e-3, rtol=1e-3
        )
    vocab = choose_vocab(corpus, 48, 64, always=[0])
    cfg = new_config(tiny, [1], len(vocab), trained_head=True, features=True)
    model = build_draft(tiny, cfg, vocab)
    train_b = batched.batches(corpus, vocab, 64, batch_tokens=40, max_len=32, seed=0)
    assert sum(int((b[2].sum(-1) > 0).sum()) for b in train_b) == sum(len(a) for _, a in pairs)
    before = batched.held_out_top1(model, train_b)
    result = batched.train(model, train_b, train_b, steps=60, lr=3e-3, seconds=600, reg_weight=1.0, noise=0.0)
    assert result["steps"] == 60 and result["held_out_top1"] >= before
    assert result["held_out_top1"] > 0.3  # it fits the few answers it trained on


def test_spec_bench_split_holds_out_the_bench_prompts(tmp_path):
    rows = [
        {"question_id": 100 - i if cat == "b" else i, "category": cat, "turns": [f"{cat}{i}"]}
        for cat in ("a", "b")
        for i in range(8)
    ]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    evaluation, training = batched.spec_bench_split(path)
    first = {r["question_id"] for cat in "ab" for r in [x for x in rows if x["category"] == cat][:5]}
    assert first <= {r["question_id"] for r in evaluation}
    assert not {r["question_id"] for r in evaluation} & {r["question_id"] for r in training}
    assert len(training) == 16 - len(evaluation) == 3  # "b" lists its ids backwards: all 8 held out
