"""How close each weight format's next-token distribution is to float32's, on Spec-Bench prompts.

Loads the model in float32 and in each format asked for, feeds each prompt (the first N questions
of each category, chat-formatted) once, and compares every prompt position's logits with
float32's: top-1 agreement (the same argmax) and the mean KL divergence KL(float32 || format), in
nats. Speculative decoding keeps each format's own output distribution; this measures how far
that distribution is from float32's.

    flock /tmp/verispec-cpu.lock python benchmarks/format_agreement.py [--per-category 3]
        [--dtypes int8,int4,w4a8] [--model default]
"""

from __future__ import annotations

import argparse
import collections

import torch

from verispec.bench.prompts import load_prompts, select
from verispec.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", default="int8,int4,w4a8", help="comma list of formats against float32")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--prompts", default=None, help="a Spec-Bench question file (default: the shared one)")
    args = ap.parse_args()

    dtypes = [d for d in args.dtypes.split(",") if d]
    prompts = select(load_prompts(args.prompts), None, args.per_category)
    models = {d: load_model(args.model, dtype=d) for d in ["float32", *dtypes]}
    tokenizer = models["float32"].tokenizer
    agree: collections.Counter[str] = collections.Counter()
    kl: collections.Counter[str] = collections.Counter()
    positions = 0
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tokenizer(text).input_ids])  # [1, T]
        logits = {}
        for d, model in models.items():
            model.reset(1)
            logits[d] = model.forward(ids, [0], logits="all")[0].double()  # [T, V]
        ref = logits["float32"].log_softmax(-1)
        for d in dtypes:
            agree[d] += int((logits[d].argmax(-1) == ref.argmax(-1)).sum())
            kl[d] += float((ref.exp() * (ref - logits[d].log_softmax(-1))).sum())
        positions += ids.shape[1]
    print(f"{positions} prompt positions of {len(prompts)} prompts, against float32")
    for d in dtypes:
        print(f"{d}: top-1 agreement {100 * agree[d] / positions:.2f}%, mean KL {kl[d] / positions:.2e} nats")


if __name__ == "__main__":
    main()
