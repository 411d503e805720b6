"""The one logits-to-probabilities path, used by draft and target alike.

Losslessness needs both models' distributions to be transformed identically, so every caller goes
through :func:`logits_to_probs`. Settings are per row, so a batch may mix greedy and sampled requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verispec.config import SamplingConfig


class SeededGenerator(torch.Generator):
    """The generator of a request that gave a seed (the engine makes one per request, seeded or
    not; its seed also keys the request's uniforms by output position,
    :func:`verispec.rejection.position_uniforms`). A drafter that samples its tokens, and whose
    choices would otherwise follow measured times, prices such a sampled row by fixed figures
    instead, so that the seed reproduces the response (:func:`is_seeded`). Point-mass drafts need
    no such care: they never change which token a position emits."""


def is_seeded(generator: torch.Generator | None) -> bool:
    """Whether ``generator`` is a seeded request's (a :class:`SeededGenerator`)."""
    return isinstance(generator, SeededGenerator)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings as tensors (built once per batch composition)."""

    temperature: torch.Tensor  # [B] float; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    any_greedy: bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_configs(cls, configs: Sequence[SamplingConfig]) -> SamplingTensors:
        """Stack the settings of the rows of a batch."""
        return cls.of(
            torch.tensor([c.temperature for c in configs], dtype=torch.float64),
            torch.tensor([c.top_k or 0 for c in configs], dtype=torch.int64),
            torch.tensor([1.0 if c.top_p is None else c.top_p for c in configs], dtype=torch.float64),
        )

    @classmethod
    def of(cls, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> SamplingTensors:
        """From ``[B]`` tensors, with the batch-wide flags that let greedy batches skip work."""
        greedy = temperature == 0
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            any_greedy=bool(greedy.any()),
            all_greedy=bool(greedy.all()),
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool((top_p < 1).any()),
        )

    def select(self, rows: Sequence[int]) -> SamplingTensors:
        """The settings of a subset of rows."""
        index = torch.tensor(list(rows), dtype=torch.int64)
        return self.of(self.temperature[index], self.top_k[index], self.top_p[index])


def logits_to_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Turn logits into the distribution that sampling draws from.

    Args:
        logits: ``[B, T, V]`` (or ``[B, V]``), any float dtype.
        params: settings of the B rows.

    Returns:
        Probabilities of the same shape, in float32 (float64 when the logits are float64). Greedy
        rows are one-hot on the argmax (first index on ties), so rejection sampling reduces to exact
        argmax matching.
    """
    squeeze = logits.dim() == 2
    if squeeze:
        logits = logits[:, None, :]
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    batch = logits.shape[0]
    if params.all_greedy:
        probs = _one_hot_argmax(logits)
        return probs[:, 0] if squeeze else probs

    kernel = sampling_kernel(logits)
    if kernel is not None:
        rows = logits.shape[1]
        per_row = (params.temperature.double(), params.top_k.long(), params.top_p.double())  # [B] each
        per_row = tuple(t.repeat_interleave(rows) if rows > 1 else t.contiguous() for t in per_row)  # [B * T]
        flat = logits.reshape(batch * rows, -1).contiguous()  # [B * T, V]
        probs = kernel.sampling_probs(flat, *per_row).view(logits.shape)
    else:
        probs = _probs_torch(logits, params)
    if params.any_greedy:
        greedy = (params.temperature == 0).to(logits.device).view(batch, 1, 1)
        probs = torch.where(greedy, _one_hot_argmax(logits), probs)
    return probs[:, 0] if squeeze else probs


def sampling_kernel(values: torch.Tensor) -> Any:
    """The compiled kernel module, when this process has loaded it (a fast model did) and
    ``values`` are float32 on the CPU; else None. Never compiles it. Its ``sampling_probs`` is
    :func:`logits_to_probs`'s transform in one pass per row, its ``draw_rows``
    :func:`verispec.rejection.inverse_cdf`'s draw (``benchmarks/sampling_cost.py``, V = 49152,
    random logits: top-p 0.9 over one row 0.25 -> 0.13 ms, over five 1.5 -> 0.35)."""
    if values.dtype != torch.float32 or values.device.type != "cpu":
        return None
    # Imported here: fast_llama imports verispec.rejection, which imports this module.
    from verispec.models.fast_llama import loaded_kernel

    return loaded_kernel()


def _probs_torch(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """:func:`logits_to_probs`'s transform in torch operations: ``[B, T, V]`` logits (float32 or
    float64) -> probabilities of the same shape and dtype (greedy rows not yet one-hot)."""
    dtype = logits.dtype
    batch = logits.shape[0]
    temp = params.temperature.to(dtype=dtype, device=logits.device).clamp_min(1e-6).view(batch, 1, 1)
    scaled = logits / temp
    if params.any_top_k:
        top_k = params.top_k.to(logits.device).clamp(max=logits.shape[-1])
        # k-th largest value per row; rows with top_k == 0 keep everything.
        kth = torch.topk(scaled, int(top_k.max()), dim=-1).values
        idx = (top_k.clamp_min(1) - 1).view(batch, 1, 1).expand(-1, scaled.shape[1], 1)
        threshold = kth.gather(-1, idx)
        threshold = torch.where(
            (top_k > 0).view(batch, 1, 1), threshold, torch.full_like(threshold, -torch.inf)
        )
        scaled = scaled.masked_fill(scaled < threshold, -torch.inf)
    if params.any_top_p:
        scaled = _top_p_mask(scaled, params.top_p.to(dtype=dtype, device=logits.device).view(batch, 1, 1))
    return torch.softmax(scaled, dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` -> one-hot of the argmax, same shape."""
    probs = torch.zeros_like(logits)
    probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return probs


_TOP_P_FIRST = 64  # tokens ranked in :func:`_top_p_mask`'s first try


def _top_p_mask(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but the smallest prefix of tokens (by probability) whose mass reaches ``top_p``.

    A token stays if the mass of the tokens ranked before it is below ``top_p``, so the first token
    always stays. The ranking is found among the ``k`` most probable tokens (``torch.topk``), with
    ``k`` growing eightfold from 64 until every row's prefix ends inside it: its mass reaches
    ``top_p``, so every token after it is masked. Sorting the whole vocabulary instead took 3.7 ms
    for one row and 12-14 ms for five (V = 49152, a 2-core Zen 4; ``benchmarks/sampling_cost.py``),
    more than the model's step.

    Args:
        scaled: ``[B, T, V]`` temperature-scaled logits (possibly already top-k masked).
        top_p: ``[B, 1, 1]``.

    Returns:
        ``scaled`` with the dropped tokens set to ``-inf``, ``[B, T, V]``.
    """
    probs = torch.softmax(scaled, dim=-1)
    vocab = probs.shape[-1]
    k = min(vocab, _TOP_P_FIRST)
    while True:
        top, order = torch.topk(probs, k, dim=-1)  # [B, T, k], descending
        top = top.double()  # the masses summed in float64: thousands of terms may precede the cut
        mass = torch.cumsum(top, dim=-1)
        if k == vocab or bool((mass[..., -1:] >= top_p).all()):
            break
        k = min(vocab, k * 8)
    keep_sorted = mass - top < top_p  # the mass strictly before each token
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, -torch.inf)
