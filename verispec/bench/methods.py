"""What one benchmark run is, and our own methods as runs of the engine.

Every method, ours or a peer's, is a :class:`Runner`: given prompt token ids, a :class:`MethodConfig`
and a :class:`Sampling` request, it generates and returns a :class:`RunResult` timed the same way (wall clock
around the whole request, prompt processing included; time to the first emitted token beside it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from verispec.api import stream_generate
from verispec.config import GenerationConfig, SamplingConfig
from verispec.proposers import Proposer
from verispec.stats import GenerationStats

OURS = ("autoregressive", "draft-model", "prompt-lookup", "lookup+draft", "lookup+ngrams")
PEERS = ("hf-generate", "hf-prompt-lookup", "hf-assisted", "llama.cpp", "llama.cpp-prompt-lookup")
METHODS = OURS + PEERS
SPECULATIVE = (
    "draft-model",
    "prompt-lookup",
    "lookup+draft",
    "lookup+ngrams",
    "hf-prompt-lookup",
    "hf-assisted",
    "llama.cpp-prompt-lookup",
)
COPYING = ("prompt-lookup", "lookup+ngrams")
"""Our methods whose drafts are point masses: with a seed, their sampled output is the plain one."""
BASELINE = {
    "autoregressive": "autoregressive",
    "draft-model": "autoregressive",
    "prompt-lookup": "autoregressive",
    "lookup+draft": "autoregressive",
    "lookup+ngrams": "autoregressive",
    "hf-generate": "hf-generate",
    "hf-prompt-lookup": "hf-generate",
    "hf-assisted": "hf-generate",
    "llama.cpp": "llama.cpp",
    "llama.cpp-prompt-lookup": "llama.cpp",
}
"""Each method's speedup is against the same engine's plain decoding."""


@dataclass(frozen=True)
class MethodConfig:
    """One column of the benchmark: a method at one draft length, weight format and k policy."""

    method: str
    k: int = 0
    """Draft length (the starting one when adaptive); 0 for plain decoding."""
    adaptive: bool = False
    dtype: str = "float32"
    """Weight format of our engine; peers run their own (transformers float32, llama.cpp the GGUF's)."""

    @property
    def baseline(self) -> MethodConfig:
        """The same engine's plain decoding."""
        name = BASELINE[self.method]
        return MethodConfig(name, dtype=self.dtype if name == "autoregressive" else "float32")

    @property
    def label(self) -> str:
        """Short name for tables and legends."""
        out = self.method
        if self.method in SPECULATIVE:
            out += f" k={self.k}" + (" adaptive" if self.adaptive else "")
        if self.method in OURS and self.dtype != "float32":
            out += f" [{self.dtype}]"
        return out


@dataclass
class RunResult:
    """One prompt through one method."""

    token_ids: list[int]
    """New tokens, EOS included when generation stopped on it."""
    seconds: float
    """Wall time of the whole request."""
    first_token_seconds: float
    """Until the first new token was available (prompt processing and one step)."""
    first_tokens: int
    """Tokens that arrived with the first one (more than 1 when a first draft was accepted)."""
    stats: GenerationStats | None = None
    """Draft and acceptance counters, for our engine."""
    round_seconds: tuple[float, ...] = ()
    """With ``--repeats``: the wall time of every round on this prompt (``seconds`` is the least)."""


Runner = Callable[[list[int], MethodConfig, "Sampling"], RunResult]
"""(prompt token ids, config, request) -> result."""


@dataclass
class Sampling:
    """What every method is asked for."""

    max_new_tokens: int
    sampling: SamplingConfig
    seed: int | None = None


def run_ours(
    target, proposer: Proposer | None, prompt: list[int], cfg: MethodConfig, req: Sampling
) -> RunResult:
    """Generate with our engine; ``proposer`` None (or ``cfg.k`` 0) is plain decoding."""
    config = GenerationConfig(
        max_new_tokens=req.max_new_tokens,
        num_speculative_tokens=cfg.k if proposer is not None else 0,
        sampling=req.sampling,
        seed=req.seed,
        adaptive=cfg.adaptive,
    )
    start = time.perf_counter()
    first, first_tokens, seq = None, 0, None
    for events in stream_generate(target, proposer if cfg.k else None, [prompt], config):
        for ev in events:
            seq = ev.seq
            if first is None and ev.token_ids:
                first, first_tokens = time.perf_counter() - start, len(ev.token_ids)
    seconds = time.perf_counter() - start
    assert seq is not None
    return RunResult(
        token_ids=list(seq.output_ids),
        seconds=seconds,
        first_token_seconds=first or seconds,
        first_tokens=first_tokens,
        stats=seq.stats,
    )
