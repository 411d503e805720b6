"""Spec-Bench prompts (Xia et al., 2024): one JSON object a line with ``category`` and ``turns``.

Only the first turn of each question is used. Selection is by category and the first N questions of
each, in file order, so a run never depends on which prompts happened to favour a method.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from verispec.config import ConfigError

DEFAULT_PROMPTS = Path("..") / "shared" / "data" / "spec_bench" / "question.jsonl"
"""Relative to the repository root."""


@dataclass(frozen=True)
class BenchPrompt:
    """One question's first turn."""

    question_id: str
    category: str
    text: str


def repo_root() -> Path:
    """The checkout the package is installed from (editable installs)."""
    return Path(__file__).resolve().parents[2]


def default_prompts_path() -> Path:
    """``../shared/data/spec_bench/question.jsonl`` from the repository root."""
    return (repo_root() / DEFAULT_PROMPTS).resolve()


def load_prompts(path: str | Path | None = None) -> list[BenchPrompt]:
    """Every question of a Spec-Bench-format file, in file order; raises ConfigError when unusable."""
    where = Path(path) if path is not None else default_prompts_path()
    if not where.is_file():
        hint = "" if path is not None else " (the default Spec-Bench file; give one with --prompts)"
        raise ConfigError(f"prompt file not found: {where}{hint}")
    out = []
    for n, line in enumerate(where.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = obj["turns"]
            text = turns[0] if isinstance(turns, list) else turns
            category = str(obj.get("category", "all"))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ConfigError(
                f"{where}:{n}: not a Spec-Bench question ({exc.__class__.__name__}: {exc})"
            ) from exc
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}:{n}: the first turn is empty")
        out.append(BenchPrompt(question_id=str(obj.get("question_id", n)), category=category, text=text))
    if not out:
        raise ConfigError(f"{where} holds no questions")
    return out


def select(
    prompts: list[BenchPrompt], categories: list[str] | None, per_category: int | None
) -> list[BenchPrompt]:
    """The first ``per_category`` questions of each chosen category (all categories when None)."""
    present = list(dict.fromkeys(p.category for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise ConfigError(f"unknown categories {', '.join(unknown)}; the file has: {', '.join(present)}")
        chosen = list(dict.fromkeys(categories))
    else:
        chosen = present
    if per_category is not None and per_category < 1:
        raise ConfigError(f"--per-category must be >= 1, got {per_category}")
    out = []
    for cat in chosen:
        rows = [p for p in prompts if p.category == cat]
        out.extend(rows if per_category is None else rows[:per_category])
    return out
