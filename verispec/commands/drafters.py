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

    ``--draft-model default`` is the trained draft shipped for the target. With no drafter named, the
    default drafter is :class:`~verispec.lookup_first.LookupFirst` over the shipped draft (prompt
    lookup where it has a good match, the trained draft elsewhere), or prompt lookup alone for a
    target with no shipped draft and for an int8 target (:func:`lookup_alone_pays`;
    benchmarks/DRAFTS.md has the measurements behind these choices).
    """
    from verispec.models.loading import load_model, load_tokenizer

    if prompt_lookup:
        return PromptLookup()
    if draft_model is None and lookup_alone_pays(target):
        log.info("int8 target: drafting by prompt lookup alone (a draft model costs more than it saves)")
        return PromptLookup()
    if draft_model is None:
        shipped = default_draft_for(target, max_batch_size=max_batch_size)
        if shipped is None:
            return PromptLookup()
        from verispec.costs import costs_for
        from verispec.lookup_first import LookupFirst

        return LookupFirst(shipped, costs=costs_for(target))
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


def lookup_alone_pays(target: KVModel) -> bool:
    """Whether prompt lookup alone beats lookup first with the shipped draft behind it: for an int8
    target. Its steps cost a third of float32's, so each draft token of the shipped head costs 0.17
    of one (0.23 with the head's weights in bfloat16; float32 target: 0.08), more than the head's
    tokens save. Side by side on Spec-Bench (greedy, session 10), lookup first ran at 0.95-0.98 of
    lookup alone's speed in five runs on an int8 target (0.96-1.00 in two with the head in int8),
    and at 1.08-1.12 of it in four on float32; on a 2-core Intel Xeon (session 11) the two tied on
    int8 (1.12-1.15x against 1.13-1.14x) while lookup first led on float32 (benchmarks/DRAFTS.md)."""
    return getattr(target, "dtype", None) == "int8"


def default_draft_for(target: KVModel, max_batch_size: int = 1) -> Proposer | None:
    """The shipped draft when it can run with this target (a CPU target of the fast path), else None."""
    from verispec.config import ConfigError

    try:
        return shipped_draft_for(target, max_batch_size=max_batch_size)
    except ConfigError as exc:  # a GPU target, or a target that records no hidden states
        log.info("the shipped draft cannot run here (%s); drafting by prompt lookup", exc)
        return None


def shipped_draft_for(target: KVModel, max_batch_size: int = 1) -> Proposer | None:
    """The trained draft shipped for this target, when one exists (see ``verispec.distill``)."""
    try:
        from verispec.distill.shipped import load_shipped_draft
    except ModuleNotFoundError:
        return None
    return load_shipped_draft(target, max_batch_size=max_batch_size)
