"""Token-level distillation of a small draft from a target (Leviathan et al., 2023; DistillSpec, Zhou
et al., 2024: train the draft on the target's own distributions over text the target generates).

The loss at every answer position is the cross-entropy of the draft's distribution against the
target's top-``TOP`` next-token probabilities (the soft labels stored in the corpus), which is the
forward KL up to a constant on the labelled mass. Only the draft's layers and final norm train; the
embeddings and head stay the target's, so the draft learns to land in the target's output space.
Checkpoints hold model, optimizer and step, so ``--resume`` continues a run exactly where it stopped.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from verispec.distill.model import DraftConfig, DraftKV, DraftLM
from verispec.proposers import DraftModelProposer, Proposer

log = logging.getLogger(__name__)


def choose_vocab(
    corpus: Sequence[dict], size: int, vocab_size: int, always: Sequence[int] = ()
) -> torch.Tensor:
    """The ``size`` token ids the draft's head scores: ``always`` (EOS...), then the tokens most often in
    the target's answers and top labels, then prompt tokens, then the lowest ids (BPE merges come
    roughly in order of frequency). Returns ``[size]`` int64, sorted."""
    counts: Counter[int] = Counter()
    prompt_counts: Counter[int] = Counter()
    for seq in corpus:
        ids = seq["ids"].tolist()
        counts.update(ids[seq["start"] :])
        counts.update(seq["top_ids"][:, 0].tolist())
        prompt_counts.update(ids[: seq["start"]])
    chosen: dict[int, None] = dict.fromkeys(int(t) for t in always)
    for source in (counts, prompt_counts):
        for tok, _ in source.most_common():
            if len(chosen) >= size:
                break
            chosen.setdefault(tok)
    tok = 0
    while len(chosen) < min(size, vocab_size):
        chosen.setdefault(tok)
        tok += 1
    return torch.tensor(sorted(chosen)[:size], dtype=torch.int64)


def make_batches(
    corpus: Sequence[dict],
    vocab_ids: torch.Tensor,
    vocab_size: int,
    *,
    batch_tokens: int,
    max_len: int,
    seed: int,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Padded batches ``(ids [B, T], label_idx [B, T, K], label_p [B, T, K], index [B])``.

    ``index`` holds the batch's positions in ``corpus`` (to fetch per-sequence extras such as features).

    ``label_idx[b, t]`` are positions in ``vocab_ids`` of the target's top next tokens after
    ``ids[b, : t + 1]`` (-1: outside the subset or no label), ``label_p`` their target probabilities.
    Batches are built on the device the corpus' tensors are on (``index`` stays on the CPU).
    """
    dev = corpus[0]["ids"].device
    to_sub = torch.full((vocab_size,), -1, dtype=torch.int64, device=dev)
    to_sub[vocab_ids.to(dev)] = torch.arange(len(vocab_ids), device=dev)
    order = sorted(range(len(corpus)), key=lambda i: len(corpus[i]["ids"]))
    groups: list[list[int]] = []
    for i in order:
        longest = min(len(corpus[i]["ids"]), max_len)
        if groups and longest * (len(groups[-1]) + 1) <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    random.Random(seed).shuffle(groups)
    batches = []
    for g in groups:
        t = min(max(len(corpus[i]["ids"]) for i in g), max_len)
        k = corpus[g[0]]["top_ids"].shape[1]
        ids = torch.zeros(len(g), t, dtype=torch.int64, device=dev)
        lab = torch.full((len(g), t, k), -1, dtype=torch.int64, device=dev)
        prob = torch.zeros(len(g), t, k, device=dev)
        for b, i in enumerate(g):
            seq = corpus[i]
            n = min(len(seq["ids"]), t)
            ids[b, :n] = seq["ids"][:n]
            s = seq["start"]
            m = min(len(seq["top_ids"]), n - s + 1)  # label j sits at position s - 1 + j
            if m > 0:
                lab[b, s - 1 : s - 1 + m] = to_sub[seq["top_ids"][:m].long()]
                prob[b, s - 1 : s - 1 + m] = seq["top_logp"][:m].float().exp()
        prob[lab < 0] = 0.0
        if prob.sum() > 0:  # prompts cut before their answers teach nothing (and give a NaN loss)
            batches.append((ids, lab.clamp(min=0), prob, torch.tensor(g)))
    return batches


def distill_loss(
    model: DraftLM, ids: torch.Tensor, lab: torch.Tensor, prob: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy per labelled position, and the draft's top-1 agreement with the target."""
    logp = torch.log_softmax(model(ids), dim=-1)  # [B, T, Vd]
    picked = logp.gather(-1, lab)  # [B, T, K]
    has = prob.sum(-1) > 0  # [B, T]
    loss = -(picked * prob).sum(-1)[has].mean()
    with torch.no_grad():
        agree = (logp.argmax(-1) == lab[..., 0])[has & (prob[..., 0] > 0)].float().mean().item()
    return loss, agree


def train(
    model: DraftLM,
    corpus: Sequence[dict],
    out: Path,
    *,
    steps: int,
    lr: float = 3e-4,
    batch_tokens: int = 3072,
    max_len: int = 640,
    resume: bool = False,
    checkpoint_every: int = 25,
    seed: int = 0,
    progress: bool = True,
    time_budget_s: float | None = None,
    features: Sequence[torch.Tensor] | None = None,
    reg_weight: float = 1.0,
    noise: float = 0.0,
) -> dict:
    """Distill for ``steps`` optimizer steps (cosine schedule), checkpointing to ``out/checkpoint.pt``.

    With ``time_budget_s``, stops after the step that exhausts it (checkpointed, so ``resume`` with
    the same ``steps`` finishes the schedule later). An EAGLE draft (``model.cfg.features``) needs the
    target's ``features`` ``[T, hidden]`` per corpus sequence and trains with
    :func:`verispec.distill.eagle.eagle_loss` (``reg_weight``, ``noise``).
    """
    from verispec.distill.eagle import batch_features, eagle_loss

    if model.cfg.features and features is None:
        raise ValueError("an EAGLE draft trains on the target's features: pass features=")
    from tqdm import tqdm

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    start, history = 0, []
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.is_file():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, history = state["step"], state["history"]
    batches = make_batches(
        corpus, model.vocab_ids, model.cfg.vocab_size, batch_tokens=batch_tokens, max_len=max_len, seed=seed
    )
    warmup = min(20, steps // 10 + 1)
    model.train()
    bar = tqdm(total=steps, initial=start, desc="distilling", unit="step", disable=not progress)
    t0 = time.time()
    for step in range(start, steps):
        scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        )
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.05)
        ids, lab, prob, index = batches[step % len(batches)]
        if model.cfg.features:
            feats = batch_features(features, index, ids.shape[1])  # [B, T, hidden]
            loss, agree = eagle_loss(model, ids, feats, lab, prob, reg_weight=reg_weight, noise=noise)
        else:
            loss, agree = distill_loss(model, ids, lab, prob)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append({"step": step + 1, "loss": round(loss.item(), 4), "top1": round(agree, 4)})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree:.3f}")
        over = time_budget_s is not None and time.time() - t0 > time_budget_s
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps or over:
            tmp = out / "checkpoint.pt.tmp"
            state = {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step + 1,
                "history": history,
            }
            torch.save({**state, "vocab_ids": model.vocab_ids}, tmp)
            tmp.replace(ckpt)
        if over:
            break
    bar.close()
    model.eval()
    done = history[-1]["step"] if history else 0
    return {"steps": done, "of_steps": steps, "seconds": round(time.time() - t0, 1), "history": history[-5:]}


def eval_prompts(count_per_category: int, path: str | Path | None = None) -> list[tuple[str, str]]:
    """Held-out ``(category, prompt)`` pairs: Spec-Bench's first turns (never used for training) when
    the file is there, the first ``count_per_category`` of each category by question_id."""
    path = Path(path) if path else Path("/work/shared/data/spec_bench/question.jsonl")
    if not path.is_file():
        from verispec.distill.prompts import prompts_for

        return [("self-written", p) for p in prompts_for(13 * count_per_category, [], seed=12345)]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["question_id"]):
        by_cat.setdefault(r["category"], []).append(r)
    return [(c, r["turns"][0]) for c, rs in by_cat.items() for r in rs[:count_per_category]]


def measure_acceptance(
    target,
    draft: DraftKV | Proposer,
    prompts: Sequence[tuple[str, str]],
    *,
    max_new_tokens: int = 64,
    k: int = 4,
    temperature: float = 0.0,
) -> dict:
    """Acceptance rate and mean accepted length (tokens per target call) by category and overall."""
    from verispec.api import speculative_generate
    from verispec.stats import GenerationStats
    from verispec.tokenizers import encode_prompt

    proposer = draft if hasattr(draft, "propose") else DraftModelProposer(draft)
    chat = bool(getattr(target, "instruct", False))
    per: dict[str, GenerationStats] = {}
    for cat, text in prompts:
        ids = encode_prompt(target.tokenizer, text, chat=chat)[
            -(target.max_length - max_new_tokens - k - 2) :
        ]
        res = speculative_generate(
            target,
            proposer,
            ids,
            max_new_tokens=max_new_tokens,
            num_speculative_tokens=k,
            temperature=temperature,
            seed=0,
        )
        per.setdefault(cat, GenerationStats()).merge(res.stats)
    total = GenerationStats()
    for s in per.values():
        total.merge(s)

    def fig(s: GenerationStats) -> dict:
        return {
            "acceptance": round(s.acceptance_rate, 3),
            "mean_accepted_length": round(s.mean_accepted_length, 3),
        }

    return {"overall": fig(total), "by_category": {c: fig(s) for c, s in per.items()}}


def new_config(
    target_hf, layers: Sequence[int], draft_vocab: int, trained_head: bool = False, features: bool = False
) -> DraftConfig:
    """A DraftConfig for ``target_hf`` with layers copied from the target's ``layers``."""
    c = target_hf.config
    return DraftConfig(
        hidden_size=c.hidden_size,
        num_layers=len(layers),
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=float(c.rms_norm_eps),
        vocab_size=int(target_hf.get_output_embeddings().weight.shape[0]),
        draft_vocab=draft_vocab,
        init_layers=tuple(layers),
        trained_head=trained_head,
        features=features,
    )
