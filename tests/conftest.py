"""Shared fixtures: tiny random models (fast) and the real default model (slow tests only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from verispec.costs import StepCosts

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def keeps_torch_threads():
    """Fail a test that leaves the process on another torch thread count (and restore it).

    Everything after such a test ran on one thread, and the real model, loaded afterwards, measured
    its kernel schedules again for one thread: about a minute of the suite (session 32).
    """
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch on {after} threads (was {before})")


class FreeCosts(StepCosts):
    """Step costs of a machine on which verifying more tokens costs nothing more; records nothing."""

    def record(self, batch: int, width: int, seconds: float, context: int = 0) -> None:
        pass

    def ratio(self, width: int, batch: int = 1, context: int = 0) -> float:
        return 1.0


def tiny_llama(
    vocab_size: int = 64, *, seed: int = 0, layers: int = 2, hidden: int = 32, dtype=torch.float64
):
    """A random Llama small enough for exhaustive tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def check_tree_forward(
    fast, prompt: torch.Tensor, gen: torch.Generator, vocab: int, same, after_keep=None
) -> None:
    """A tree call on ``fast`` (two rows, after ``prompt`` ``[2, n]``: a pending token and 3 drafts,
    then alternatives at chain offsets 1 and 2) gives every node the logits it would have in a
    chain, and ``keep_path`` moves an accepted alternative into place (row 0; row 1 keeps its chain)
    so that decoding goes on as if it had been fed in a chain. ``same(got, want)`` compares logits;
    ``after_keep(fast, n)`` runs right after ``keep_path``."""
    n = prompt.shape[1]
    chain = torch.randint(0, vocab, (2, 4), generator=gen)  # pending token then 3 drafts
    alt = torch.randint(0, vocab, (2, 2), generator=gen)  # alternatives at chain offsets 1 and 2
    after = torch.randint(0, vocab, (2, 3), generator=gen)

    def chain_logits(ids: torch.Tensor) -> torch.Tensor:  # one token at a time, as plain decoding
        fast.reset(2)
        fast.forward(prompt, logits="none")
        return torch.cat([fast.forward(ids[:, t : t + 1]) for t in range(ids.shape[1])], dim=1)

    tree = torch.cat([chain, alt], dim=1)  # [2, 6]
    offsets = torch.tensor([[0, 1, 2, 3, 1, 2]] * 2)
    fast.reset(2)
    fast.forward(prompt, logits="none")
    got = fast.forward(tree, offsets=offsets)  # [2, 6, V]
    same(got[:, :4], chain_logits(chain))
    same(got[:, 4], chain_logits(torch.cat([chain[:, :1], alt[:, :1]], dim=1))[:, 1])
    same(got[:, 5], chain_logits(torch.cat([chain[:, :2], alt[:, 1:]], dim=1))[:, 2])

    # Row 0 keeps the alternative at offset 2 (after pending and chain token 1); row 1 its chain.
    kept = torch.cat([chain[:1, :2], alt[:1, 1:]], dim=1)
    rows = [torch.cat([kept, after[:1]], dim=1), torch.cat([chain[1:], after[1:, :2]], dim=1)]
    want = chain_logits(torch.cat(rows))
    fast.reset(2)
    fast.forward(prompt, logits="none")
    fast.forward(tree, offsets=offsets)
    fast.keep_path(0, n, [0, 1, 5])
    if after_keep is not None:
        after_keep(fast, n)
    fast.truncate(torch.tensor([n + 3, n + 4]))
    same(fast.forward(after[:1], rows=[0]), want[:1, 3:])
    same(fast.forward(after[1:, :2], rows=[1]), want[1:, 4:])


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The packaged default model converted once to a HF folder (cached across runs)."""
    from verispec.models.loading import PACKAGED, converted_folder

    return converted_folder(PACKAGED["smollm2-135m"].path())


@pytest.fixture(scope="session")
def default_model():
    """The real default model as loaded by users (fast path where available)."""
    from verispec import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory, default_model_folder) -> Path:
    """A tiny random Llama with the default model's tokenizer (vocab 49152), saved as a HF folder.

    Lets CLI and server tests run end to end in seconds with a real tokenizer and chat template.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(default_model_folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
