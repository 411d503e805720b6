"""Choosing the drafter from user options (CLI, server, bench share this)."""

from __future__ import annotations

import logging

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
    """The proposer named by the options; with none named, the shipped draft for the target when there
    is one, else prompt lookup."""
    from verispec.models.loading import load_model, load_tokenizer

    if prompt_lookup:
        return PromptLookup()
    if draft_model is None or draft_model == "default":
        shipped = shipped_draft_for(target)
        if shipped is not None:
            return shipped
        if draft_model == "default":
            log.warning("no shipped draft for this target yet; using prompt lookup")
        return PromptLookup()
    # Compare tokenizers before paying for the draft's weights.
    check_compatible(target.tokenizer, load_tokenizer(draft_model))
    draft = load_model(
        draft_model, backend=backend, dtype=dtype, max_batch_size=max_batch_size, max_length=target.max_length
    )
    return make_proposer(target, draft, max_batch_size=max_batch_size)


def shipped_draft_for(target: KVModel) -> Proposer | None:
    """The trained draft shipped for this target, when one exists (see ``verispec.distill``)."""
    try:
        from verispec.distill.shipped import load_shipped_draft
    except ModuleNotFoundError:
        return None
    return load_shipped_draft(target)
