"""Choosing the drafter from user options (CLI, server, bench share this)."""

from __future__ import annotations

import logging
from pathlib import Path

from verispec.api import make_proposer
from verispec.models.base import KVModel
from verispec.proposers import PromptLookup, Proposer
from verispec.tokenizers import check_compatible

log = logging.getLogger(__name__)


def build_proposer(
    target: KVModel,
    draft_model: str | None,
    prompt_lookup: bool,
    *,
    max_batch_size: int = 1,
    dtype: str = "float32",
    backend: str = "auto",
) -> Proposer:
    """The proposer named by the options.

    ``--draft-model default`` is the trained draft shipped for the target. With no drafter named we
    use prompt lookup: the shipped draft for the default model does not yet beat plain decoding on
    this hardware (benchmarks/DRAFTS.md), and a default must never make generation slower.
    """
    from verispec.models.loading import load_model, load_tokenizer

    if prompt_lookup or draft_model is None:
        return PromptLookup()
    if draft_model == "default":
        shipped = shipped_draft_for(target, max_batch_size=max_batch_size)
        if shipped is None:
            log.warning("no draft is shipped for this target; using prompt lookup")
            return PromptLookup()
        return shipped
    if (Path(draft_model).expanduser() / "draft.json").is_file():  # a draft made by `verispec distill`
        from verispec.distill.shipped import load_proposer

        return load_proposer(Path(draft_model).expanduser(), target, max_batch_size=max_batch_size)
    # Compare tokenizers before paying for the draft's weights.
    check_compatible(target.tokenizer, load_tokenizer(draft_model))
    draft = load_model(
        draft_model,
        backend=backend,
        dtype=dtype,
        max_batch_size=max_batch_size,
        max_length=target.max_length,
        device=str(getattr(target, "device", "cpu")),  # the draft runs where the target does
    )
    return make_proposer(target, draft, max_batch_size=max_batch_size)


def shipped_draft_for(target: KVModel, max_batch_size: int = 1) -> Proposer | None:
    """The trained draft shipped for this target, when one exists (see ``verispec.distill``)."""
    try:
        from verispec.distill.shipped import load_shipped_draft
    except ModuleNotFoundError:
        return None
    return load_shipped_draft(target, max_batch_size=max_batch_size)
