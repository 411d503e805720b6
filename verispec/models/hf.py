"""Any Hugging Face causal LM as a :class:`~verispec.models.base.KVModel` (the generic path).

Each row keeps its own ``DynamicCache``, cropped on rollback. Rows run one after another, so this
path is for correctness and breadth of architectures; Llama-family models take the fast path in
:mod:`verispec.models.fast_llama`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from verispec.models.base import LogitsMode, tensor_bytes


class HFModel:
    """Wraps a ``transformers`` causal LM; rows' caches are independent ``DynamicCache`` objects."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: object | None = None, max_length: int | None = None
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        ctx = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_length = int(min(ctx, max_length) if max_length else ctx)
        self.device = next(model.parameters()).device
        self._caches: list[DynamicCache] = []
        self._lengths = torch.zeros(0, dtype=torch.int64)

    def reset(self, batch_size: int) -> None:
        """Start ``batch_size`` empty rows."""
        # Full (not sliding-window) layers for every model: a sliding layer cannot be cropped back
        # exactly once its window is full, and rollback must be exact.
        self._caches = [DynamicCache() for _ in range(batch_size)]
        self._lengths = torch.zeros(batch_size, dtype=torch.int64)

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` tokens held per row."""
        return self._lengths

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, rows: list[int] | None = None, logits: LogitsMode = "all"
    ) -> torch.Tensor | None:
        """See :meth:`KVModel.forward`; ``input_ids`` is ``[n, T]``."""
        rows = list(range(len(self._caches))) if rows is None else rows
        outs = []
        for line, row in enumerate(rows):
            ids = input_ids[line : line + 1].to(self.device)  # [1, T]
            keep = 1 if logits == "last" else 0  # 0 = all positions (transformers' convention)
            out = self.model(input_ids=ids, cache=self._caches[row], use_cache=True, logits_to_keep=keep)
            self._lengths[row] += ids.shape[1]
            if logits in ("all", "argmax"):  # "argmax": the whole logits are a valid answer
                outs.append(_float(out.logits[0]))  # [T, V]
            elif logits == "last":
                outs.append(_float(out.logits[0, -1]))  # [V]
        if logits == "none":
            return None
        return torch.stack(outs).cpu()  # sampling and acceptance run on the CPU

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters."""
        return tensor_bytes(list(self.model.parameters()))

    def cache_bytes(self) -> int:
        """Bytes the rows' caches hold now (they grow with the sequences)."""
        total = 0
        for cache in self._caches:
            for layer in getattr(cache, "layers", []):
                total += tensor_bytes([getattr(layer, "keys", None), getattr(layer, "values", None)])
        return total

    def truncate(self, lengths: torch.Tensor | Sequence[int], rows: list[int] | None = None) -> None:
        """Crop each row's cache to ``lengths`` (``[n]``)."""
        rows = list(range(len(self._caches))) if rows is None else rows
        for line, row in enumerate(rows):
            n = int(lengths[line])
            if n < int(self._lengths[row]):
                self._caches[row].crop(n - int(self._lengths[row]))  # negative: tokens to drop
                self._lengths[row] = n


def _float(x: torch.Tensor) -> torch.Tensor:
    """Half precisions become float32; float64 stays (exactness tests run in float64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
