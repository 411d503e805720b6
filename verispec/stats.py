"""Per-generation statistics, under the names the CLI, the benchmark and the server all use."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counters for one sequence; derived rates are properties."""

    new_tokens: int = 0
    """Tokens emitted (what the user receives)."""
    seconds: float = 0.0
    """Wall time of the whole request, prompt processing included."""
    prefill_seconds: float = 0.0
    """Of which prompt processing."""
    prompt_tokens: int = 0
    target_calls: int = 0
    """Target forward passes after the prompt (each verifies one draft and emits >= 1 token)."""
    draft_tokens: int = 0
    """Draft tokens proposed and verified."""
    accepted_tokens: int = 0
    """Draft tokens the target accepted."""
    accepted_per_position: list[int] = field(default_factory=list)
    """accepted_per_position[i]: steps whose draft token i was accepted."""
    drafted_per_position: list[int] = field(default_factory=list)
    """drafted_per_position[i]: steps that proposed a draft token at position i."""
    memory_bytes: dict[str, int] = field(default_factory=dict)
    """What speculation adds: draft weights and KV caches, when known."""

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens over the whole request's time."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Emitted tokens over the time after prompt processing."""
        decode = self.seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target call (1.0 for plain decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    def record_step(self, num_draft: int, num_accepted: int, alternatives: int = 0) -> None:
        """Count one verification step: a chain of ``num_draft`` draft tokens and ``alternatives``
        other candidates verified beside it (a tree), of which ``num_accepted`` were accepted (the
        chain's first ones, then at most one alternative, counted at its chain position)."""
        self.target_calls += 1
        self.draft_tokens += num_draft + alternatives
        self.accepted_tokens += num_accepted
        while len(self.drafted_per_position) < num_draft:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(num_draft):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: GenerationStats) -> None:
        """Add another sequence's counters (for aggregates over prompts)."""
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        self.prompt_tokens += other.prompt_tokens
        self.target_calls += other.target_calls
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def to_dict(self) -> dict:
        """JSON form: counters plus derived rates."""
        out = asdict(self)
        out["tokens_per_second"] = self.tokens_per_second
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_accepted_length"] = self.mean_accepted_length
        return out
