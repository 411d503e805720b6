"""Drafts for speculative decoding: distilled small drafts bound to their target, and early exit.

- ``verispec distill`` (:mod:`verispec.distill.cli`) trains a draft for any Llama-family target.
- :func:`load_shipped_draft` returns the shipped draft's proposer for a target (None if none).
- :func:`load_draft` loads a draft folder, refusing one trained for another target;
  :func:`load_proposer` gives its proposer.
- :class:`EagleProposer` drafts with an EAGLE head over the target's hidden states.
- :class:`EarlyExitProposer` drafts with the target's own first layers (no training).
"""

from verispec.distill.eagle import EagleProposer
from verispec.distill.early_exit import EarlyExitProposer
from verispec.distill.shipped import load_draft, load_proposer, load_shipped_draft, target_id

__all__ = [
    "EagleProposer",
    "EarlyExitProposer",
    "load_draft",
    "load_proposer",
    "load_shipped_draft",
    "target_id",
]
