"""Typed, validated configuration shared by the Python API, the CLI and the server.

Every object here is a frozen dataclass validated once in ``__post_init__``; nothing mutates it while
generating. Invalid values raise :class:`ConfigError`, which the CLI turns into a one-line error with
exit code 2 and the server into an HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A user-supplied value is out of range or inconsistent."""


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution; identical for draft and target.

    Order of application (as in transformers and vLLM): temperature, then top-k, then top-p.
    """

    temperature: float = 1.0
    """0 means greedy (argmax); must be >= 0."""
    top_k: int | None = None
    """Keep the k most likely tokens; None or 0 disables."""
    top_p: float | None = None
    """Keep the smallest set whose mass reaches p, in (0, 1]; None or 1 disables."""

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise ConfigError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ConfigError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax."""
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationConfig:
    """One request: how many tokens, how to sample, how far to speculate."""

    max_new_tokens: int = 128
    """Upper bound on emitted tokens; never exceeded."""
    num_speculative_tokens: int = 4
    """Draft length k; 0 is plain autoregressive decoding by the same engine."""
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None
    """Seeds the request's own torch.Generator, so a seed reproduces a response."""
    stop: tuple[str, ...] = ()
    """Generation ends when the text contains one of these; the text is cut before it."""
    ignore_eos: bool = False
    adaptive: bool = False
    """Adapt k per sequence from observed acceptance (see ``verispec.adaptive``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 0:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        if k > 64:
            raise ConfigError(f"num_speculative_tokens must be <= 64, got {k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")
