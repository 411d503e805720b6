"""Choosing the drafter from user options (CLI, server, bench share this)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from verispec.api import make_proposer
from verispec.models.base import KVModel
from verispec.proposers import PromptLookup, Proposer
from verispec.tokenizers import check_compatible, check_vocab_size

log = logging.getLogger(__name__)


def build_proposer(
    target: KVModel,
    draft_model: str | None,
    prompt_lookup: bool,
    *,
    max_batch_size: int = 1,
    dtype: str = "float32",
    backend: str = "auto",
    ngrams: str | None = None,
) -> Proposer:
    """The proposer named by the options.

    ``--draft-model default`` is the trained draft shipped for the target; ``ngrams`` (``--ngrams``)
    is prompt lookup plus an n-gram table of the target's own answers ("default": the one shipped
    for the target, else a folder made by ``verispec ngrams``). With no drafter named, the
    default drafter is :class:`~verispec.lookup_first.LookupFirst` over the shipped draft (prompt
    lookup where it has a good match, the trained draft elsewhere), or prompt lookup alone for a
    target with no shipped draft, an int8 target and a target on the C++ kernel
    (:func:`lookup_alone_pays`; benchmarks/DRAFTS.md has the measurements behind these choices).
    Where prompt lookup drafts by default and an n-gram table is shipped for the target, the table
    drafts beside it (:class:`~verispec.ngrams.NgramLookup`: 11-15% more tokens per target call on
    Spec-Bench, session 31).
    """
    from verispec.models.loading import gguf_vocab_size, load_model, load_tokenizer

    if prompt_lookup:
        return PromptLookup()
    if ngrams is not None:
        from verispec.ngrams import NgramLookup

        return NgramLookup.for_target(target, None if ngrams == "default" else Path(ngrams).expanduser())
    if draft_model is None and lookup_alone_pays(target):
        from verispec.ngrams import NgramLookup

        with_table = NgramLookup.shipped(target)
        if with_table is not None:
            log.info("drafting by prompt lookup with the n-gram table shipped for this target")
            return with_table
        log.info("drafting by prompt lookup alone: on this target a draft model costs more than it saves")
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
    # Compare tokenizers before paying for the draft's weights, and a GGUF draft's vocabulary size
    # before converting it: a draft of another family is refused in seconds, not minutes.
    size = gguf_vocab_size(draft_model)
    if size is not None:
        check_vocab_size(len(target.tokenizer), size)
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


def proposer_from_args(target: KVModel, args: argparse.Namespace, max_batch_size: int = 1) -> Proposer:
    """:func:`build_proposer` with the drafter options of ``generate`` and ``serve``
    (:func:`~verispec.commands.common.add_model_arguments`)."""
    return build_proposer(
        target,
        args.draft_model,
        args.prompt_lookup,
        max_batch_size=max_batch_size,
        dtype=args.dtype,
        backend=args.backend,
        ngrams=getattr(args, "ngrams", None),
    )


def lookup_alone_pays(target: KVModel) -> bool:
    """Whether prompt lookup alone beats lookup first with the shipped draft behind it: for an int8
    target, and for any target whose steps run on the C++ kernel.

    An int8 step costs a third of a float32 one on the kernel of session 10, so each draft token of
    the shipped head cost 0.17 of one (float32 target: 0.08), more than the head's tokens save: lookup
    first ran at 0.95-0.98 of lookup alone's speed in five runs on an int8 target there, and at
    1.08-1.12 of it on float32. Since session 23 the kernel's float32 steps read 4-bit blocks and
    cost a half to a quarter of what they did, and lookup first came level with lookup alone on
    Spec-Bench (1.03-1.05x against 1.05-1.06x on two EPYCs, sessions 24 and 26; 1.00x against
    1.02x in session 28) and lost where it must learn the costs first: a fresh `verispec generate`
    of a short chat prompt ran at 0.65-0.75x plain decoding with the head against 1.0-1.16x with
    lookup alone (session 28, benchmarks/DRAFTS.md). So the head drafts by default only where the
    target's steps are slow (the fast path without its kernel); ``--draft-model default`` still
    asks for it."""
    return getattr(target, "dtype", None) == "int8" or bool(getattr(target, "uses_kernel", False))


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
