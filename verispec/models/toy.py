"""Models given only as ``.logits(ids) -> [seq, vocab]`` (the tutorial's interface).

There is no cache: every call recomputes the whole sequence, and "rolling back" just shortens the
stored token list. Used for toy models whose distribution is known exactly, so exactness can be
checked against analytic laws.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from verispec.models.base import LogitsMode


class LogitsFn(Protocol):
    """Anything with ``.logits(ids: [seq] int64) -> [seq, vocab]``."""

    def logits(self, ids: torch.Tensor) -> torch.Tensor: ...


class LogitsModel:
    """Adapts a :class:`LogitsFn` to the cached-model protocol by storing each row's tokens."""

    def __init__(self, fn: LogitsFn, vocab_size: int | None = None, max_length: int = 1 << 30):
        self.fn = fn
        self.tokenizer = getattr(fn, "tokenizer", None)
        if vocab_size is None:
            vocab_size = getattr(fn, "vocab_size", None)
        if vocab_size is None:
            vocab_size = int(fn.logits(torch.zeros(1, dtype=torch.int64)).shape[-1])
        self.vocab_size = int(vocab_size)
        self.max_length = max_length
        self._tokens: list[torch.Tensor] = []

    def reset(self, batch_size: int) -> None:
        """Start ``batch_size`` empty rows."""
        self._tokens = [torch.zeros(0, dtype=torch.int64) for _ in range(batch_size)]

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` tokens held per row."""
        return torch.tensor([len(t) for t in self._tokens], dtype=torch.int64)

    def forward(
        self, input_ids: torch.Tensor, rows: list[int] | None = None, logits: LogitsMode = "all"
    ) -> torch.Tensor | None:
        """Recompute the logits of each row's whole sequence and return the new positions'."""
        rows = list(range(len(self._tokens))) if rows is None else rows
        outs = []
        t = input_ids.shape[1]
        for line, row in enumerate(rows):
            self._tokens[row] = torch.cat([self._tokens[row], input_ids[line].cpu()])
            if logits == "none":
                continue
            full = self.fn.logits(self._tokens[row])  # [seq, V]
            outs.append(full[-t:] if logits in ("all", "argmax") else full[-1])
        return None if logits == "none" else torch.stack(outs)

    def truncate(self, lengths: torch.Tensor | Sequence[int], rows: list[int] | None = None) -> None:
        """Keep the first ``lengths[i]`` tokens of row ``rows[i]``."""
        rows = list(range(len(self._tokens))) if rows is None else rows
        for line, row in enumerate(rows):
            self._tokens[row] = self._tokens[row][: int(lengths[line])]
