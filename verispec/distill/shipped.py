"""Saving and loading trained drafts, each bound to the target it was trained for.

A draft folder holds ``draft.safetensors`` (the draft's layers and final norm, float16, plus the
head's ``vocab_ids``) and ``draft.json`` (its :class:`~verispec.distill.model.DraftConfig`, the
target's id and name, the command that produced it and its measured acceptance). The embeddings and
output head are the target's and are taken from it at load time, so a draft only works with that
exact target: :func:`target_id` fingerprints tokenizer, config and weights, and :func:`load_draft`
refuses a draft whose recorded id differs.

Drafts shipped with verispec live in ``verispec/drafts/<name>/``; :func:`load_shipped_draft` picks
the one whose target id matches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from verispec.config import ConfigError
from verispec.distill.model import KERNEL_WEIGHTS, DraftConfig, DraftKV, DraftLM, target_modules
from verispec.proposers import DraftModelProposer, Proposer

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parent.parent / "drafts"
WEIGHTS = "draft.safetensors"
META = "draft.json"


def target_id(target) -> str:
    """A fingerprint of a target: tokenizer vocabulary, architecture and bytes of some weights.

    Accepts a KVModel with ``.hf_model`` or a Hugging Face model. Loading the same model from GGUF or
    from its converted folder gives the same id; any other model (or a fine-tuned copy) does not.
    """
    hf = getattr(target, "hf_model", target)
    tok = getattr(target, "tokenizer", None) or getattr(hf, "_verispec_tokenizer", None)
    h = hashlib.sha256()
    if tok is not None and hasattr(tok, "get_vocab"):
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    c = hf.config
    fields = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    h.update(json.dumps([getattr(c, f, None) for f in fields]).encode())
    embed, layers, norm, head, _ = target_modules(hf)
    with torch.no_grad():
        for w in (
            embed.weight[:8],
            layers[0].self_attn.q_proj.weight[:8],
            layers[-1].mlp.down_proj.weight[:8],
            norm.weight,
            head[-8:],
        ):
            h.update(w.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_draft(folder: str | Path, model: DraftLM, meta: dict) -> Path:
    """Write ``draft.safetensors`` (float16 weights) and ``draft.json`` (config + ``meta``) to ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in model.trainable_state().items()}
    if model.vocab_ids is not None:
        tensors["vocab_ids"] = model.vocab_ids.to(torch.int64).contiguous()
    save_file(tensors, str(folder / WEIGHTS))
    (folder / META).write_text(json.dumps({**meta, "config": model.cfg.to_dict()}, indent=2) + "\n")
    return folder


def read_meta(folder: str | Path) -> dict:
    """The metadata of a draft folder; ConfigError when it is not one."""
    path = Path(folder) / META
    if not path.is_file():
        raise ConfigError(f"{folder} is not a verispec draft (no {META})")
    return json.loads(path.read_text())


def build_draft(target, cfg: DraftConfig, vocab_ids: torch.Tensor | None) -> DraftLM:
    """A DraftLM wired to ``target``'s embeddings and head, layers initialised from ``cfg.init_layers``."""
    hf = getattr(target, "hf_model", target)
    embed, layers, norm, head, inv_freq = target_modules(hf)
    model = DraftLM(cfg, embed.weight, head, inv_freq, vocab_ids)
    for mine, src in zip(model.layers, cfg.init_layers):
        mine.adopt(layers[src], share=False)
    model.norm = torch.nn.Parameter(norm.weight.detach().float().clone())
    if model.fc is not None:
        # EAGLE: start from "the target's feature plus the next token's embedding", a residual stream
        # the copied layer can read; training finds the real mix.
        h = cfg.hidden_size
        with torch.no_grad():
            model.fc.weight.zero_()
            model.fc.weight[:, :h] = torch.eye(h) * FC_INIT_EMBED
            model.fc.weight[:, h:] = torch.eye(h)
    return model


FC_INIT_EMBED = 1.0
"""Weight of the token embedding in an EAGLE draft's initial ``fc`` (the feature's is 1)."""


def load_draft(folder: str | Path, target, *, max_batch_size: int = 1) -> DraftKV:
    """Load a draft's model for ``target``; ConfigError when it was trained for another target.

    :func:`load_proposer` wraps it in the proposer its kind needs.
    """
    from safetensors.torch import load_file

    meta = read_meta(folder)
    where = getattr(target, "device", torch.device("cpu"))
    if torch.device(where).type != "cpu":
        raise ConfigError(
            f"distilled drafts run with CPU targets only for now; this target is on {where} "
            "(load it with --device cpu, or name a Hugging Face draft model or --prompt-lookup)"
        )
    mine = target_id(target)
    if meta.get("target_id") != mine:
        name = getattr(target, "name", None) or type(getattr(target, "hf_model", target)).__name__
        raise ConfigError(
            f"the draft in {folder} was trained for target {meta.get('target_name')!r} "
            f"(id {meta.get('target_id')}), not for {name!r} (id {mine}); train one with "
            f"'verispec distill --target {name} --out DIR'"
        )
    cfg = DraftConfig.from_dict(meta["config"])
    tensors = load_file(str(Path(folder) / WEIGHTS))
    vocab_ids = tensors.pop("vocab_ids", None)
    model = build_draft(target, cfg, vocab_ids)
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return DraftKV(
        model,
        getattr(target, "tokenizer", None),
        max_length=getattr(target, "max_length", 2048),
        max_batch_size=max_batch_size,
        weights=draft_weights_for(target),
    )


def draft_weights_for(target) -> str:
    """The weight format of a draft's kernel copy for ``target`` (one of ``KERNEL_WEIGHTS``): int8.
    A draft token costs what reading its weights costs, so int8 made each cheaper than bfloat16 on
    every target measured: first an int8 target (session 10), and since session 25 a float32 one too,
    whose steps had become cheap enough (see benchmarks/DRAFTS.md, session 25: the shipped head alone
    0.84 / 0.88x -> 0.90 / 0.92x of plain decoding in two pairs of runs). ``VERISPEC_DRAFT_WEIGHTS``
    overrides it. The draft's numbers never change the output, only how often it is accepted."""
    forced = os.environ.get("VERISPEC_DRAFT_WEIGHTS", "")
    if forced:
        if forced not in KERNEL_WEIGHTS:
            raise ConfigError(f"VERISPEC_DRAFT_WEIGHTS must be one of {KERNEL_WEIGHTS}, not {forced!r}")
        return forced
    return "int8"


def load_proposer(folder: str | Path, target, *, max_batch_size: int = 1) -> Proposer:
    """The proposer of a draft folder: an EAGLE head over the target's features
    (:class:`~verispec.distill.eagle.EagleProposer`) or a standalone draft (``DraftModelProposer``)."""
    draft = load_draft(folder, target, max_batch_size=max_batch_size)
    if draft.model.cfg.features:
        from verispec.distill.eagle import EagleProposer

        return EagleProposer(target, draft, max_batch_size=max_batch_size)
    return DraftModelProposer(draft, max_batch_size=max_batch_size)


def shipped_folders() -> list[Path]:
    """Folders of the drafts shipped with verispec, best first: by the held-out mean accepted length
    ``verispec distill`` recorded in each ``draft.json`` (the same prompts, k and length for every
    draft), so ``--draft-model default`` loads the measured best draft for a target."""
    if not SHIPPED.is_dir():
        return []

    def measured(folder: Path) -> float:
        after = read_meta(folder).get("acceptance_after") or {}
        return float(after.get("overall", {}).get("mean_accepted_length", 0.0))

    return sorted(sorted(p.parent for p in SHIPPED.glob(f"*/{META}")), key=measured, reverse=True)


def load_shipped_draft(target, *, max_batch_size: int = 1) -> Proposer | None:
    """The proposer of the preferred shipped draft trained for ``target``, or None when none was."""
    try:
        mine = target_id(target)
    except (ConfigError, AttributeError):
        return None
    for folder in shipped_folders():
        if read_meta(folder).get("target_id") == mine and (folder / WEIGHTS).is_file():
            return load_proposer(folder, target, max_batch_size=max_batch_size)
    return None
