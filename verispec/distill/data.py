"""Offline training text for distillation: passages on the machine and the target's own generations.

Nothing here touches Spec-Bench. Sources:

- :func:`offline_passages`: paragraphs from documentation shipped with installed packages
  (``*.dist-info/METADATA`` long descriptions) and the Python standard library's docstrings.
- :func:`generate_corpus`: the target's answers (chat template applied) to prompts from
  :mod:`verispec.distill.prompts`, appended to a JSONL file batch by batch so a run can be resumed
  and its output used while it is still growing.
- :func:`text_corpus`: plain text files given with ``--corpus``.

A corpus on disk is a folder of ``shard_*.pt`` files holding token ids and the target's soft labels
(its top log-probabilities per position, see :func:`read_corpus`).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch


def offline_passages(limit: int = 2000, min_chars: int = 300) -> list[str]:
    """Paragraph groups (~300-1500 chars) from installed packages' documentation, sorted for determinism."""
    roots = {Path(p) for p in sys.path if p and Path(p).is_dir() and "site-packages" in p}
    out: list[str] = []
    for root in sorted(roots):
        for meta in sorted(root.glob("*.dist-info/METADATA")):
            try:
                text = meta.read_text(errors="ignore")
            except OSError:
                continue
            body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
            out.extend(_chunks(body, min_chars))
            if len(out) >= limit:
                return out[:limit]
    return out


def _chunks(text: str, min_chars: int, max_chars: int = 1500) -> Iterator[str]:
    """Group paragraphs of prose (not tables, links or code-only lines) into passages."""
    buf = ""
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        words = re.findall(r"[A-Za-z]{3,}", para)
        if len(words) < 12 or para.count("|") > 4 or para.startswith(("[!", "<", "..", "![", "http")):
            continue
        buf = f"{buf}\n\n{para}" if buf else para
        if len(buf) >= min_chars:
            yield buf[:max_chars]
            buf = ""


def text_corpus(files: Sequence[str | Path], tokenizer, chunk_tokens: int = 256) -> list[dict]:
    """Plain text files cut into ``chunk_tokens`` pieces (``start`` 0: every position is trained on)."""
    seqs = []
    for name in files:
        ids = tokenizer(Path(name).read_text(errors="ignore")).input_ids
        for i in range(0, len(ids) - 16, chunk_tokens):
            seqs.append({"ids": ids[i : i + chunk_tokens], "start": 0})
    return seqs


TOP = 32
"""Target log-probabilities kept per position (the largest ones): the soft labels of distillation."""


def read_corpus(folder: str | Path) -> list[dict]:
    """All sequences in a corpus folder's ``shard_*.pt`` files (a missing folder is an empty corpus).

    Each sequence: ``ids`` ``[T]`` int64 (prompt + answer), ``start`` (first position trained on),
    ``top_ids``/``top_logp`` ``[T - start, TOP]``: the target's largest next-token log-probabilities
    for predicting ``ids[start + j]``, i.e. given ``ids[: start + j]``.
    """
    seqs: list[dict] = []
    for shard in sorted(Path(folder).glob("shard_*.pt")):
        seqs.extend(torch.load(shard))
    return seqs


def _top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., V]`` logits -> (``[..., TOP]`` int32 ids, ``[..., TOP]`` float16 log-probs)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(TOP, dim=-1)
    return ids.to(torch.int32), vals.to(torch.float16)


@torch.inference_mode()
def label_texts(
    target,
    seqs: Sequence[Sequence[int]],
    out: str | Path,
    *,
    shard_tokens: int = 20000,
    progress: bool = True,
) -> Path:
    """Teacher-force the target over plain token sequences and store its soft labels as shards."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buf: list[dict] = []
    n_tok = 0
    for ids in tqdm(seqs, desc="labelling", unit="seq", disable=not progress):
        target.reset(1)
        logits = target.forward(torch.tensor([list(ids)]), logits="all")[0]  # [T, V]
        top_ids, top_logp = _top(logits[:-1])
        buf.append({"ids": torch.tensor(ids), "start": 1, "top_ids": top_ids, "top_logp": top_logp})
        n_tok += len(ids)
        if n_tok >= shard_tokens:
            _save_shard(out, buf)
            buf, n_tok = [], 0
    if buf:
        _save_shard(out, buf)
    return out


def _save_shard(folder: Path, seqs: list[dict]) -> None:
    n = len(list(folder.glob("shard_*.pt")))
    tmp = folder / f".shard_{n:05d}.tmp"
    torch.save(seqs, tmp)
    tmp.rename(folder / f"shard_{n:05d}.pt")


@torch.inference_mode()
def generate_corpus(
    target,
    prompts: Sequence[str],
    out: str | Path,
    *,
    max_new_tokens: int = 192,
    batch_size: int = 16,
    temperatures: Sequence[float] = (0.0, 0.7),
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Answer ``prompts`` with the target and store answers and the target's soft labels as shards.

    One shard per batch of prompts, so an interrupted run resumes after its last whole batch (the
    shards already written are kept and skipped). Batches alternate over ``temperatures``, so the
    corpus holds greedy and sampled answers; the soft labels are the target's untempered
    distributions either way. ``target`` must be a KVModel with room for ``batch_size`` rows.
    """
    from tqdm import tqdm

    from verispec.tokenizers import encode_prompt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    chat = bool(getattr(target, "instruct", False))
    eos = set(getattr(target, "eos_token_ids", ()) or ())
    n_batches = (len(prompts) + batch_size - 1) // batch_size
    done = len(list(out.glob("shard_*.pt")))
    bar = tqdm(total=n_batches, initial=done, desc="generating", unit="batch", disable=not progress)
    t0, made = time.time(), 0
    for b in range(done, n_batches):
        texts = prompts[b * batch_size : (b + 1) * batch_size]
        ids = [
            encode_prompt(target.tokenizer, t, chat=chat)[-(target.max_length - max_new_tokens - 1) :]
            for t in texts
        ]
        temp = temperatures[b % len(temperatures)]
        gen = torch.Generator().manual_seed(seed + b)
        target.reset(len(ids))
        last = []
        for row, p in enumerate(ids):  # prefill rows one by one: prompts differ in length
            last.append(target.forward(torch.tensor([p]), rows=[row], logits="last")[0])
        logits = torch.stack(last)  # [B, V]
        answers: list[list[int]] = [[] for _ in ids]
        labels: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in ids]
        live = list(range(len(ids)))
        for _ in range(max_new_tokens):
            top_ids, top_logp = _top(logits)
            if temp == 0:
                tok = logits.argmax(dim=-1)
            else:
                tok = torch.multinomial(torch.softmax(logits.float() / temp, dim=-1), 1, generator=gen)[:, 0]
            still = []
            for j, row in enumerate(live):
                answers[row].append(int(tok[j]))
                labels[row].append((top_ids[j], top_logp[j]))
                if int(tok[j]) not in eos:
                    still.append(j)
            live_next = [live[j] for j in still]
            if not live_next:
                break
            logits = target.forward(tok[still][:, None], rows=live_next, logits="last")  # [B', V]
            live = live_next
            made += len(live)
        seqs = []
        for p, a, lab in zip(ids, answers, labels):
            seqs.append(
                {
                    "ids": torch.tensor(p + a),
                    "start": len(p),
                    "top_ids": torch.stack([x[0] for x in lab]),
                    "top_logp": torch.stack([x[1] for x in lab]),
                }
            )
        _save_shard(out, seqs)
        bar.update(1)
        bar.set_postfix(tok_s=f"{made / (time.time() - t0):.0f}")
    bar.close()
    return out


def main() -> None:
    """``python -m verispec.distill.data OUT COUNT``: generate a corpus with the default model."""
    import verispec
    from verispec.distill.prompts import prompts_for

    torch.set_num_threads(1)
    out, count = sys.argv[1], int(sys.argv[2])
    target = verispec.load_model(
        sys.argv[3] if len(sys.argv) > 3 else "default", max_batch_size=32, max_length=1024
    )
    prompts = prompts_for(count, offline_passages(), seed=1)
    generate_corpus(target, prompts, out, batch_size=32)


if __name__ == "__main__":
    main()
