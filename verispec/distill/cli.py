"""Train a small draft for a target on the CPU: ``verispec distill --target MODEL --out DIR``.

Steps: (1) the target answers training prompts written for verispec (Spec-Bench-style, never
Spec-Bench itself) and its top next-token probabilities are stored as soft labels in ``DIR/corpus``;
``--corpus FILE...`` adds plain text files, labelled the same way by teacher forcing; (2) a draft made
of a few of the target's layers, with a head over the most frequent tokens, is distilled on them
(``--arch eagle``: one layer over the target's hidden states, which are extracted first into
``DIR/features``, see :mod:`verispec.distill.eagle`);
(3) acceptance on held-out prompts is measured before and after; the draft and its metadata (target
id, the command line) are written to DIR. Every stage resumes: generation keeps finished shards,
training continues from ``DIR/checkpoint.pt`` with ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``verispec distill``."""
    p.add_argument("--target", default="default", help="the target model (short name, folder or .gguf)")
    p.add_argument("--out", required=True, help="folder for the corpus, checkpoints and the trained draft")
    p.add_argument("--corpus", nargs="*", default=[], metavar="FILE", help="extra plain-text training files")
    p.add_argument("--corpus-dir", help="a labelled corpus folder to train on instead of DIR/corpus")
    p.add_argument(
        "--prompts", type=int, default=1600, help="training prompts the target answers (default 1600)"
    )
    p.add_argument("--max-new-tokens", type=int, default=192, help="answer length per training prompt")
    p.add_argument("--gen-batch", type=int, default=32, help="prompts answered together")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    p.add_argument("--time-budget", type=float, help="stop training after this many minutes (resumable)")
    p.add_argument(
        "--arch",
        choices=("standalone", "eagle"),
        default="standalone",
        help="standalone: a small LM of its own; eagle: a head over the target's hidden states "
        "(one layer; needs the fast Llama path)",
    )
    p.add_argument(
        "--layers",
        help="target layers the draft's layers start from (default 0,1; for --arch eagle the last layer)",
    )
    p.add_argument(
        "--features-dir", help="the target's hidden states over the corpus (eagle; default DIR/features)"
    )
    p.add_argument(
        "--reg-weight", type=float, default=1.0, help="eagle: weight of the feature regression loss"
    )
    p.add_argument(
        "--feature-noise", type=float, default=0.0, help="eagle: relative noise added to input features"
    )
    p.add_argument("--draft-vocab", type=int, default=8192, help="tokens scored by the draft's head")
    p.add_argument(
        "--train-head",
        action="store_true",
        help="train (and store) the head's rows too, instead of using the target's",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-tokens", type=int, default=3072, help="padded tokens per optimizer step")
    p.add_argument(
        "--eval-per-category",
        type=int,
        default=1,
        help="held-out Spec-Bench prompts per category for the before/after acceptance",
    )
    p.add_argument("--eval-tokens", type=int, default=48, help="tokens generated per held-out prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads (be kind to shared machines)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Generate/label the corpus, distill, measure, save, on ``--threads`` torch threads; the
    process's own thread count is restored afterwards (``verispec.cli.main`` may run in process)."""
    from verispec.models.threads import torch_threads

    with torch_threads(max(1, args.threads)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from verispec.config import ConfigError
    from verispec.distill import data, shipped, train
    from verispec.models.loading import load_model

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.quiet
    target = load_model(args.target, max_batch_size=max(1, args.gen_batch), max_length=1024)
    n_layers = target.hf_model.config.num_hidden_layers
    eagle = args.arch == "eagle"
    if args.layers is None:
        args.layers = str(n_layers - 1) if eagle else "0,1"
    layers = [int(x) for x in args.layers.split(",") if x.strip()]
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise ConfigError(f"--layers must name layers of the target (0..{n_layers - 1})")

    corpus_dir = Path(args.corpus_dir) if args.corpus_dir else out / "corpus"
    if not args.corpus_dir and args.prompts > 0:
        from verispec.distill.prompts import prompts_for

        prompts = prompts_for(args.prompts, data.offline_passages(), seed=args.seed + 1)
        (out / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
        data.generate_corpus(
            target,
            prompts,
            corpus_dir,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.gen_batch,
            seed=args.seed,
            progress=progress,
        )
    if args.corpus and not (out / "corpus_text").is_dir():
        seqs = data.text_corpus(args.corpus, target.tokenizer)
        data.label_texts(target, [s["ids"] for s in seqs], out / "corpus_text", progress=progress)
    corpus = data.read_corpus(corpus_dir) + data.read_corpus(out / "corpus_text")
    if not corpus:
        raise ConfigError("the training corpus is empty (give --prompts > 0, --corpus FILE or --corpus-dir)")
    n_tokens = sum(len(s["top_ids"]) for s in corpus)
    print(f"corpus: {len(corpus)} sequences, {n_tokens} labelled tokens", file=sys.stderr)

    vocab_ids = train.choose_vocab(
        corpus,
        args.draft_vocab,
        train.new_config(target.hf_model, layers, 0).vocab_size,
        always=getattr(target, "eos_token_ids", ()),
    )
    ckpt = out / "checkpoint.pt"
    if args.resume and ckpt.is_file():
        # The head's rows belong to the vocabulary the run started with, even if the corpus grew.
        vocab_ids = torch.load(ckpt).get("vocab_ids", vocab_ids)
    cfg = train.new_config(
        target.hf_model, layers, len(vocab_ids), trained_head=args.train_head, features=eagle
    )
    model = shipped.build_draft(target, cfg, vocab_ids)
    features = None
    if eagle:
        from verispec.distill import eagle as eagle_mod

        features_dir = Path(args.features_dir) if args.features_dir else out / "features"
        eagle_mod.extract_features(target, corpus, features_dir)
        features = eagle_mod.read_features(features_dir)
        if len(features) != len(corpus):
            raise ConfigError(
                f"{features_dir} holds features of {len(features)} sequences, not {len(corpus)}"
            )
    held_out = train.eval_prompts(args.eval_per_category)
    target.reset(1)

    def acceptance() -> dict:
        kv = shipped.DraftKV(model, target.tokenizer, max_length=target.max_length)
        if eagle:
            proposer = eagle_mod.EagleProposer(target, kv)
            return train.measure_acceptance(target, proposer, held_out, max_new_tokens=args.eval_tokens)
        return train.measure_acceptance(target, kv, held_out, max_new_tokens=args.eval_tokens)

    before_file = out / "acceptance_before.json"
    if args.resume and before_file.is_file():
        before = json.loads(before_file.read_text())
    else:
        before = acceptance()
        before_file.write_text(json.dumps(before) + "\n")
    print(f"acceptance before: {before['overall']}", file=sys.stderr)
    result = train.train(
        model,
        corpus,
        out,
        steps=args.steps,
        lr=args.lr,
        batch_tokens=args.batch_tokens,
        resume=args.resume,
        time_budget_s=args.time_budget * 60 if args.time_budget else None,
        seed=args.seed,
        progress=progress,
        features=features,
        reg_weight=args.reg_weight,
        noise=args.feature_noise,
    )
    after = acceptance()
    print(f"acceptance after: {after['overall']}", file=sys.stderr)
    meta = {
        "target_name": target.name,
        "target_id": shipped.target_id(target),
        "command": command_line(args),
        "corpus": {
            "sequences": len(corpus),
            "labelled_tokens": n_tokens,
            "source": "target answers to verispec's own prompts (verispec.distill.prompts)"
            + (" + " + ", ".join(args.corpus) if args.corpus else ""),
        },
        "training": result,
        "held_out": f"Spec-Bench first turns, {args.eval_per_category} per category, "
        f"{args.eval_tokens} tokens, "
        "greedy, k=4 (not used in training)",
        "acceptance_before": before,
        "acceptance_after": after,
    }
    shipped.save_draft(out, model, meta)
    print(json.dumps({"out": str(out), "before": before["overall"], "after": after["overall"]}))
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The ``verispec distill`` command with every option spelled out (recorded with the draft)."""
    parts = ["verispec", "distill"]
    for key, value in sorted(vars(args).items()):
        if key.startswith("_") or key == "command" or value is None or value is False or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)
