"""EAGLE training in large batches on one accelerator: generate, label, extract features, train.

``verispec distill --arch eagle`` does the same on the CPU, one sequence at a time, resumable and
slow (the shipped head's first version saw 1184 answers and 650 steps in about 45 CPU-minutes).
This module does every stage batched on one device, for a machine with a GPU:

1. the target answers pre-tokenised prompts (``transformers`` ``generate``, left-padded batches,
   greedy and sampled rounds);
2. one forward per batch of whole sequences records the final residual stream (the feature an EAGLE
   head reads; a hook on the last decoder layer, before the final norm) and the target's top-32
   next-token distribution over each answer;
3. :func:`verispec.distill.eagle.eagle_loss` trains a fresh head (layer ``--layer`` of the target,
   ``fc`` as in :func:`verispec.distill.shipped.build_draft`) with AdamW and a cosine schedule;
4. the head's float16 weights, its vocabulary and a summary (answering rounds, held-out top-1 history)
   are written to ``--out``; ``python -m verispec.distill.batched package`` turns them into a draft folder
   on a machine that has the tokenizer.

Prompts come pre-tokenised (``--prompts``: a ``torch.save`` of ``{"prompts": [[ids]], "eos": [ids]}``),
so the device needs only the model's weights. Everything stays on the device; the run fits a time
budget per stage. It also runs on the CPU with tiny settings, which is how it is tested.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from verispec.distill.eagle import batch_features, eagle_loss
from verispec.distill.model import DraftLM
from verispec.distill.shipped import build_draft
from verispec.distill.train import choose_vocab, make_batches, new_config

TOP = 32
"""Labels per position: the target's top-32 tokens and their probabilities."""


def load_target(path: str, device: torch.device):
    """A float32 Hugging Face causal LM from a GGUF file or a folder, on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    return model.eval().to(device)


@torch.inference_mode()
def answer(
    model,
    prompts: list[list[int]],
    eos: list[int],
    *,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    deadline: float,
) -> list[tuple[list[int], list[int]]]:
    """``(prompt, answer)`` token lists; answers end at their first EOS (kept). Stops starting batches
    at ``deadline`` (``time.time()``)."""
    dev = next(model.parameters()).device
    pad = eos[0]
    import random

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    starts = list(range(0, len(order), batch_size))
    random.Random(seed).shuffle(starts)  # a deadline then drops batches of every prompt length alike
    out: list[tuple[list[int], list[int]]] = []
    for b0 in starts:
        if time.time() > deadline:
            break
        group = [prompts[i] for i in order[b0 : b0 + batch_size]]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad, dtype=torch.int64)
        mask = torch.zeros(len(group), width, dtype=torch.int64)
        for r, p in enumerate(group):  # left padding: every row's answer starts at column `width`
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        kwargs: dict = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if temperature > 0:
            torch.manual_seed(seed + b0)
            kwargs = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        gen = model.generate(
            ids.to(dev),
            attention_mask=mask.to(dev),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            **kwargs,
        )[:, width:].tolist()
        for p, g in zip(group, gen):
            cut = next((i + 1 for i, t in enumerate(g) if t in eos), len(g))
            if cut > 1:
                out.append((p, g[:cut]))
    return out


@torch.inference_mode()
def label(model, pairs: list[tuple[list[int], list[int]]], *, batch_tokens: int) -> list[dict]:
    """Per sequence ``{"ids" [T], "start", "top_ids" [R, 32], "top_logp" [R, 32], "feats" [T, hidden]}``
    on the model's device: the target's distribution of every answer token and its features."""
    dev = next(model.parameters()).device
    last = model.model.layers[-1]
    grabbed: list[torch.Tensor] = []

    def hook(_module, _inputs, output):  # the last layer's output: the residual stream before the norm
        grabbed.append(output[0] if isinstance(output, tuple) else output)

    handle = last.register_forward_hook(hook)
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    corpus: list[dict] = [{} for _ in pairs]
    try:
        i = 0
        while i < len(order):
            group = [order[i]]
            while i + len(group) < len(order):
                nxt = order[i + len(group)]
                if (len(group) + 1) * sum(map(len, pairs[nxt])) > batch_tokens:
                    break
                group.append(nxt)
            i += len(group)
            width = max(sum(map(len, pairs[g])) for g in group)
            ids = torch.zeros(len(group), width, dtype=torch.int64)
            for r, g in enumerate(group):  # right padding: causal attention never sees it
                seq = pairs[g][0] + pairs[g][1]
                ids[r, : len(seq)] = torch.tensor(seq)
            grabbed.clear()
            logits = model(input_ids=ids.to(dev)).logits  # [B, W, V]
            feats = grabbed[0]  # [B, W, hidden]
            for r, g in enumerate(group):
                p, a = pairs[g]
                s, t = len(p), len(p) + len(a)
                logp = torch.log_softmax(logits[r, s - 1 : t - 1].float(), dim=-1)  # [R, V]
                top = logp.topk(TOP, dim=-1)
                corpus[g] = {
                    "ids": ids[r, :t].to(dev),
                    "start": s,
                    "top_ids": top.indices,
                    "top_logp": top.values.half(),
                    "feats": feats[r, :t].half(),
                }
    finally:
        handle.remove()
    return corpus


def batches(
    corpus: list[dict],
    vocab_ids: torch.Tensor,
    vocab_size: int,
    *,
    batch_tokens: int,
    max_len: int,
    seed: int,
) -> list[tuple[torch.Tensor, ...]]:
    """Padded training batches ``(ids [B, T], lab [B, T, K], prob [B, T, K], feats [B, T, hidden])`` on
    the corpus' device: :func:`verispec.distill.train.make_batches` with each batch's features."""
    features = [seq["feats"] for seq in corpus]
    return [
        (ids, lab, prob, batch_features(features, index, ids.shape[1]))
        for ids, lab, prob, index in make_batches(
            corpus, vocab_ids, vocab_size, batch_tokens=batch_tokens, max_len=max_len, seed=seed
        )
    ]


def train(
    model: DraftLM,
    train_batches: list[tuple[torch.Tensor, ...]],
    held_out: list[tuple[torch.Tensor, ...]],
    *,
    steps: int,
    lr: float,
    seconds: float,
    reg_weight: float,
    noise: float,
    eval_every: int = 500,
) -> dict:
    """AdamW with warm-up and a cosine schedule, sized to the time budget: after 50 timed steps the
    schedule's length becomes what ``seconds`` allows (at most ``steps``). Held-out top-1 is measured
    every ``eval_every`` steps and the best state is kept. Returns the history and held-out top-1."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    history: list[dict] = []
    t0 = time.time()
    best, best_state = -1.0, None
    total = steps
    step = 0
    while step < total:
        if step == 50:  # size the schedule to the budget (the evaluations cost about 2% more)
            per_step = (time.time() - t0) / 50
            total = max(51, min(steps, int(seconds / per_step * 0.95)))
        warmup = min(200, total // 20 + 1)
        scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
        )
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.02)
        model.train()
        ids, lab, prob, feats = train_batches[step % len(train_batches)]
        loss, agree = eagle_loss(model, ids, feats, lab, prob, reg_weight=reg_weight, noise=noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % eval_every == 0 or step == total:
            model.eval()
            held = held_out_top1(model, held_out)
            entry = {
                "step": step,
                "of": total,
                "loss": round(loss.item(), 4),
                "top1": round(agree, 4),
                "held_out_top1": held,
                "s": round(time.time() - t0, 1),
            }
            history.append(entry)
            print(json.dumps(entry), flush=True)
            if held > best:
                best, best_state = held, {k: v.detach().clone() for k, v in model.state_dict().items()}
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return {
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "history": history,
        "held_out_top1": best,
        "best_step": next((h["step"] for h in history if h["held_out_top1"] == best), step),
    }


@torch.no_grad()
def held_out_top1(model: DraftLM, held: list[tuple[torch.Tensor, ...]]) -> float:
    """Teacher-forced top-1 agreement of the first draft token with the target's, over ``held``."""
    agree, count = 0.0, 0
    for ids, lab, prob, feats in held:
        _, a = eagle_loss(model, ids, feats, lab, prob, unroll=False)
        n = int((prob[:, 1:, 0] > 0).sum())
        agree += a * n
        count += n
    return round(agree / max(1, count), 4)


EVAL_PER_CATEGORY = 5
"""Spec-Bench's evaluation split: the first 5 questions of each category (in file order and in
question_id order; the bench's ``--per-category N`` takes the first N). Never used for training."""


def spec_bench_split(path: str | Path) -> tuple[list[dict], list[dict]]:
    """``(evaluation, training)`` rows of a Spec-Bench file: the first :data:`EVAL_PER_CATEGORY`
    questions of each category by file order or by question_id are evaluation, the rest training."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    held: set[int] = set()
    for ordered in (rows, sorted(rows, key=lambda r: r["question_id"])):
        seen: dict[str, int] = {}
        for r in ordered:
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            if seen[r["category"]] <= EVAL_PER_CATEGORY:
                held.add(r["question_id"])
    return [r for r in rows if r["question_id"] in held], [r for r in rows if r["question_id"] not in held]


def prepare(args: argparse.Namespace) -> int:
    """Write the pre-tokenised prompts: verispec's own (``prompts_for`` over offline passages) and the
    first turns of Spec-Bench's training split."""
    from verispec.distill.data import offline_passages
    from verispec.distill.prompts import prompts_for
    from verispec.models.loading import eos_ids, load_hf
    from verispec.tokenizers import encode_prompt

    hf, tok, _ = load_hf(args.target)
    texts = prompts_for(args.own, offline_passages(limit=4000), seed=args.seed)
    bench_train: list[str] = []
    if args.spec_bench and Path(args.spec_bench).is_file():
        evaluation, training = spec_bench_split(args.spec_bench)
        bench_train = [r["turns"][0] for r in training]
        print(f"Spec-Bench: {len(training)} training questions, {len(evaluation)} held out", flush=True)
    ids = [encode_prompt(tok, t, chat=True)[-args.max_prompt_tokens :] for t in texts + bench_train]
    sources = {"own": len(texts), "spec_bench_train": len(bench_train)}
    torch.save({"prompts": ids, "eos": eos_ids(hf, tok), "sources": sources}, args.out)
    print(f"{len(ids)} prompts, {sum(map(len, ids))} tokens -> {args.out}", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Answer, label and train on one device (see the module docstring)."""

    t_start = time.time()
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # features as the CPU target computes them
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = torch.load(args.prompts)
    prompts, eos = data["prompts"], [int(t) for t in data["eos"]]
    target = load_target(args.target, dev)
    print(f"target loaded on {dev} in {time.time() - t_start:.0f} s; {len(prompts)} prompts", flush=True)

    temps = [float(t) for t in args.temperatures.split(",")]
    deadline = time.time() + args.answer_minutes * 60
    pairs, rounds = [], []
    for r, temp in enumerate(temps):  # rounds share the budget: each gets its slice
        t0 = time.time()
        share = t0 + (deadline - t0) / (len(temps) - r)
        got = answer(
            target,
            prompts,
            eos,
            temperature=temp,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.gen_batch,
            seed=args.seed + 1000 * r,
            deadline=share,
        )
        pairs += got
        rounds.append(
            {
                "temperature": temp,
                "answers": len(got),
                "answer_tokens": sum(len(a) for _, a in got),
                "seconds": round(time.time() - t0, 1),
            }
        )
        print(json.dumps(rounds[-1]), flush=True)
    corpus = label(target, pairs, batch_tokens=args.label_tokens)
    n_tokens = sum(len(c["top_ids"]) for c in corpus)
    print(
        f"labelled {len(corpus)} sequences, {n_tokens} answer tokens, {time.time() - t_start:.0f} s",
        flush=True,
    )

    n_layers = target.config.num_hidden_layers
    layer = n_layers - 1 if args.layer is None else args.layer
    vocab_ids = choose_vocab(
        [{"ids": c["ids"].cpu(), "start": c["start"], "top_ids": c["top_ids"].cpu()} for c in corpus],
        args.draft_vocab,
        target.config.vocab_size,
        always=eos,
    )
    cfg = new_config(target, [layer], len(vocab_ids), trained_head=True, features=True)
    model = build_draft(target.to("cpu"), cfg, vocab_ids).move(dev)
    target.to(dev)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(corpus), generator=g).tolist()
    n_held = max(1, int(len(corpus) * args.held_out))
    held_seqs = [corpus[i] for i in perm[:n_held]]
    train_seqs = [corpus[i] for i in perm[n_held:]]
    kw = dict(vocab_size=target.config.vocab_size, batch_tokens=args.batch_tokens, max_len=args.max_len)
    train_b = batches(train_seqs, vocab_ids, seed=args.seed, **kw)
    held_b = batches(held_seqs, vocab_ids, seed=args.seed, **kw)
    del corpus, train_seqs, held_seqs
    before = held_out_top1(model, held_b)
    print(f"held-out top-1 before training: {before}", flush=True)
    result = train(
        model,
        train_b,
        held_b,
        steps=args.steps,
        lr=args.lr,
        seconds=args.train_minutes * 60,
        reg_weight=args.reg_weight,
        noise=args.feature_noise,
    )
    print(f"held-out top-1 after {result['steps']} steps: {result['held_out_top1']}", flush=True)

    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.trainable_state().items()}
    head = {k: v for k, v in state.items() if k == "head"}
    save_file(head, str(out / "head.safetensors"))  # split: each file stays small enough to move
    save_file({k: v for k, v in state.items() if k != "head"}, str(out / "layers.safetensors"))
    save_file({"vocab_ids": vocab_ids.cpu().contiguous()}, str(out / "vocab.safetensors"))
    summary = {
        "config": cfg.to_dict(),
        "args": vars(args),
        "rounds": rounds,
        "sequences": len(pairs),
        "answer_tokens": n_tokens,
        "held_out_sequences": n_held,
        "held_out_top1_before": before,
        "training": result,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "seconds": round(time.time() - t_start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        json.dumps({k: summary[k] for k in ("sequences", "answer_tokens", "held_out_top1_before", "seconds")})
    )
    return 0


def package(args: argparse.Namespace) -> int:
    """Turn ``run``'s output into a draft folder (:func:`verispec.distill.shipped.save_draft`): bind it
    to the target's id and record held-out acceptance as ``verispec distill`` does."""
    from safetensors.torch import load_file

    from verispec.distill import shipped
    from verispec.distill.eagle import EagleProposer
    from verispec.distill.model import DraftConfig
    from verispec.distill.train import eval_prompts, measure_acceptance
    from verispec.models.loading import load_model

    src = Path(args.source)
    summary = json.loads((src / "summary.json").read_text())
    target = load_model(args.target)
    cfg = DraftConfig.from_dict(summary["config"])
    vocab_ids = load_file(str(src / "vocab.safetensors"))["vocab_ids"]
    model = shipped.build_draft(target, cfg, vocab_ids)
    state = {**load_file(str(src / "layers.safetensors")), **load_file(str(src / "head.safetensors"))}
    model.load_state_dict({k: v.float() for k, v in state.items()})
    kv = shipped.DraftKV(model, target.tokenizer, max_length=target.max_length)
    after = measure_acceptance(target, EagleProposer(target, kv), eval_prompts(1), max_new_tokens=48)
    print(f"acceptance: {after['overall']}", flush=True)
    meta = {
        "target_name": target.name,
        "target_id": shipped.target_id(target),
        "command": args.command_line,
        "corpus": {
            "sequences": summary["sequences"],
            "labelled_tokens": summary["answer_tokens"],
            "source": "target answers (greedy and sampled rounds) to verispec's own prompts "
            "(verispec.distill.prompts) and to the first turns of Spec-Bench's training split "
            f"(all but the first {EVAL_PER_CATEGORY} questions of each category)",
            "rounds": summary["rounds"],
        },
        "training": {**summary["training"], "device": summary["device"], "seconds_total": summary["seconds"]},
        "held_out": "Spec-Bench first turns, 1 per category, 48 tokens, greedy, k=4 (not used in training)",
        "acceptance_after": after,
    }
    shipped.save_draft(args.out, model, meta)
    print(f"draft written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    a = sub.add_parser("prepare", help="pre-tokenise the training prompts (needs the tokenizer)")
    a.add_argument("--target", default="default")
    a.add_argument("--out", required=True)
    a.add_argument("--own", type=int, default=3000, help="how many of verispec's own prompts")
    a.add_argument(
        "--spec-bench",
        default=str(Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"),
    )
    a.add_argument("--max-prompt-tokens", type=int, default=768)
    a.add_argument("--seed", type=int, default=1)
    r = sub.add_parser("run", help="answer, label and train on one device")
    r.add_argument("--target", required=True, help="GGUF file or Hugging Face folder of the target")
    r.add_argument("--prompts", required=True, help='torch.save of {"prompts": [[ids]], "eos": [ids]}')
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--temperatures", default="0,0.7,1.0", help="one answering round per temperature")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--gen-batch", type=int, default=256)
    r.add_argument("--label-tokens", type=int, default=65536, help="tokens per labelling forward")
    r.add_argument(
        "--layer", type=int, default=None, help="target layer the head starts from (default: last)"
    )
    r.add_argument("--draft-vocab", type=int, default=8192)
    r.add_argument("--steps", type=int, default=20000, help="at most; the time budget sizes the schedule")
    r.add_argument("--batch-tokens", type=int, default=16384)
    r.add_argument("--max-len", type=int, default=640)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--reg-weight", type=float, default=1.0)
    r.add_argument("--feature-noise", type=float, default=0.0)
    r.add_argument("--held-out", type=float, default=0.03, help="fraction of sequences kept for top-1")
    r.add_argument("--answer-minutes", type=float, default=3.0, help="budget for generating answers")
    r.add_argument("--train-minutes", type=float, default=4.0)
    r.add_argument("--seed", type=int, default=0)
    k = sub.add_parser("package", help="make a draft folder of run's output (needs the tokenizer)")
    k.add_argument("--source", required=True)
    k.add_argument("--target", default="default")
    k.add_argument("--out", required=True)
    k.add_argument("--command-line", default="", help="the commands that produced the weights, recorded")
    args = p.parse_args(argv)
    return {"prepare": prepare, "run": run, "package": package}[args.stage](args)


if __name__ == "__main__":
    raise SystemExit(main())
