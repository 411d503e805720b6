"""The cached-model protocol every target and draft goes through.

A ``KVModel`` holds a batch of rows, each with its own key/value cache. The engine keeps one
invariant for every row (written here, tested in ``tests/test_kv_rollback.py``):

    ``lengths[row] == len(committed[row]) - 1``

i.e. the cache holds every committed token except the newest, which is "pending": it is fed at the
start of the next step together with the draft tokens, so the step that verifies drafts also
produces the logits that follow the pending token. Rejected draft tokens are never "removed"
explicitly: ``truncate`` sets the row's length back and the next write overwrites them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import torch

LogitsMode = Literal["all", "argmax", "last", "none"]


@runtime_checkable
class KVModel(Protocol):
    """A causal LM with a per-row KV cache that can be rolled back."""

    vocab_size: int
    """Size of the logits' last dimension."""
    max_length: int
    """Context length: a row may never hold more tokens than this."""
    tokenizer: object | None
    """The Hugging Face tokenizer, when the model has one."""

    def reset(self, batch_size: int) -> None:
        """Drop every row's cache and make room for ``batch_size`` empty rows."""

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens held per row, ``[batch_size]`` int64 on the CPU."""

    def forward(
        self, input_ids: torch.Tensor, rows: list[int] | None = None, logits: LogitsMode = "all"
    ) -> torch.Tensor | None:
        """Append ``input_ids`` to the caches of ``rows`` and return their logits.

        Args:
            input_ids: ``[n, T]`` int64, one line per row in ``rows`` (all rows when None).
            rows: which rows of the batch the lines belong to.
            logits: "all" returns ``[n, T, V]``, "last" ``[n, V]``, "none" returns None.
                "argmax" returns ``[n, T, V]`` for a caller that reads only where each position's
                largest logit lies (greedy decoding): the largest value and its first place are
                those of "all", other entries may be -inf (a backend may skip them).

        Row ``r`` writes its tokens at positions ``lengths[r] .. lengths[r] + T - 1`` and attends to
        everything before them; its length grows by T. ``input_ids`` and the returned logits live on
        the CPU whatever device the model runs on: sampling and acceptance run there.
        """

    def truncate(self, lengths: torch.Tensor | Sequence[int], rows: list[int] | None = None) -> None:
        """Roll back: row ``rows[i]`` keeps its first ``lengths[i]`` tokens (``[n]`` int64, or ints)."""


@functools.lru_cache(maxsize=64)
def logit_rows(n: int, t: int, logits: LogitsMode) -> torch.Tensor:
    """Indices ``[R]`` int64 into the ``n * t`` flattened tokens of an ``[n, t]`` call whose logits
    ``logits`` asks for: all of them, each row's last, or none (the C++ kernel's ``logit_rows``).

    Built once per call shape and shared: read it, never write it (every decoding step asks)."""
    if logits in ("all", "argmax"):
        return torch.arange(n * t)
    if logits == "last":
        return torch.arange(t - 1, n * t, t)
    return torch.zeros(0, dtype=torch.int64)


def tensor_bytes(obj: object, _seen: set[int] | None = None) -> int:
    """Bytes held by the tensors in ``obj`` (a tensor, or nested dicts, lists and tuples of them).

    Storage shared by several entries (a tied embedding and output head) counts once.
    """
    seen = set() if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        if obj.data_ptr() in seen:
            return 0
        seen.add(obj.data_ptr())
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0
