"""What the benchmark measures besides generation: machine, bandwidth, verify and draft cost.

The expected-speedup model (Leviathan et al., 2023, with the verify cost measured rather than taken
as 1): with per-token acceptance ``a`` (the chance a draft token is accepted given that the ones
before it were), draft length k, draft cost ``c`` per token and target cost ``v(k)`` of verifying
k + 1 tokens, both relative to one plain target step, a drafting step yields
``(1 - a^(k+1)) / (1 - a)`` tokens at cost ``k c + v(k)``. A drafter that sometimes finds nothing
(prompt lookup) runs plain steps in between: with a fraction ``f`` of steps drafting, the speedup is
``(f T + 1 - f) / (f (k c + v) + 1 - f)``, which is the paper's formula when ``f = 1``.

A drafter that chooses its own draft length below k (prompt lookup, cut by measured cost; a draft
model below its confidence threshold) verifies shorter chains than k most of the time, so the bench
predicts from the lengths it actually drafted (:func:`predicted_speedup_by_length`): each target
call that verified L draft tokens counts ``(1 - a^(L+1)) / (1 - a)`` tokens at cost ``L c + v(L)``,
and a call with no draft one token at cost 1. With every call drafting k tokens this is the formula
above.
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from verispec.adaptive import expected_tokens
from verispec.models.pages import huge_page_bytes
from verispec.models.schedule import cpu_name, time_forwards
from verispec.stats import GenerationStats


def machine_info() -> dict:
    """CPU, cores, threads and library versions."""
    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": load_average(),
    }
    for name in ("transformers", "llama_cpp"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - optional peers
            info[name] = None
    try:
        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=os.path.dirname(__file__),
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: above the core count, other jobs competed with the run."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth_probe(num_bytes: int = 512 * 2**20, device: str | torch.device = "cpu") -> torch.Tensor:
    """The float32 tensor ``memory_bandwidth`` sums, far larger than the caches of ``device``. On a
    CPU it sits on 2 MB pages where the OS allows, as the fast path's weights do
    (``huge_page_bytes``), so the bound is what the machine reads at best, not what 4 KB pages let
    through. Build it once to take several readings."""
    raw = huge_page_bytes(num_bytes // 4 * 4) if torch.device(device).type == "cpu" else None
    if raw is not None:
        return raw.view(torch.float32).fill_(1.0)
    return torch.ones(num_bytes // 4, dtype=torch.float32, device=device)


def memory_bandwidth(
    num_bytes: int = 512 * 2**20,
    reps: int = 7,
    device: str | torch.device = "cpu",
    probe: torch.Tensor | None = None,
) -> float:
    """Memory read bandwidth in bytes/s of ``device`` (where the target's weights live): median time
    of summing ``probe`` (default: a new ``bandwidth_probe(num_bytes, device)``)."""
    x = bandwidth_probe(num_bytes, device) if probe is None else probe
    float(x.sum())  # touch every page first (and wait for the device)
    seconds = _median_seconds(lambda: float(x.sum()), reps)
    return x.numel() * x.element_size() / seconds


def core_roundtrip_ns() -> float | None:
    """Nanoseconds for a cache line to go from one of torch's threads to another and back (the C++
    kernel's ``core_roundtrip_ns``): about 60 where two cores share an L3, over 300 where they sit on
    different CCDs. None without the compiled kernel or with one thread."""
    from verispec.models import fast_llama

    module = fast_llama.loaded_kernel()
    if module is None:
        return None
    ns = float(module.core_roundtrip_ns())
    return ns if ns > 0 else None


def placement_cut(roundtrips: list[float]) -> float | None:
    """Where core round trips (:func:`core_roundtrip_ns`, all read) split into near and far: the
    geometric mean of the least and the most. None when there are none, or the most is under twice
    the least (one placement all along)."""
    if not roundtrips or min(roundtrips) <= 0:
        return None
    least, most = min(roundtrips), max(roundtrips)
    return None if most < 2 * least else (least * most) ** 0.5


def placement_groups(roundtrips: list[float]) -> dict[str, list[int]] | None:
    """The indices of ``roundtrips`` read with the cores near (below :func:`placement_cut`) and far:
    ``{"near": [...], "far": [...]}``, or None where they do not split (one placement all along)."""
    cut = placement_cut(roundtrips)
    if cut is None:
        return None
    return {
        "near": [i for i, t in enumerate(roundtrips) if t < cut],
        "far": [i for i, t in enumerate(roundtrips) if t >= cut],
    }


def by_placement(ratios: list[float], roundtrips: list[float | None]) -> dict | None:
    """The verify-cost readings split by how far apart the cores were when each was taken: each
    ratio is paired with the core round trip read beside it (:func:`core_roundtrip_ns`). Readings
    whose round trip lies below the geometric mean of the least and the most are ``near``, the rest
    ``far``; each part gives its readings, median ratio and median round trip (ns). None when the
    round trips were not read, or their most is under twice their least (one placement all run)."""
    pairs = [(r, t) for r, t in zip(ratios, roundtrips) if t is not None]
    times = [t for _, t in pairs]
    groups = placement_groups(times)
    if groups is None:
        return None
    out: dict = {"roundtrip_cut_ns": placement_cut(times)}
    for name, indices in groups.items():
        part = [pairs[i] for i in indices]
        out[name] = {
            "readings": len(part),
            "verify_cost_ratio": statistics.median(r for r, _ in part),
            "roundtrip_ns": statistics.median(t for _, t in part),
        }
    return out


def weight_bytes(model, dtype: str = "float32", greedy: bool = False, blocks: bool = True) -> int:
    """Bytes of weights the target reads per token: ``model.read_bytes(greedy)`` or
    ``model.weight_bytes()`` when the backend knows (a greedy step may read less: FastLlama's head
    screen), else the Hugging Face parameters counted at ``dtype``'s width. ``blocks=False``: what
    FastLlama would read without the 4-bit blocks of its float32 matrices (``q4_weights``), the
    float32 matrices themselves."""
    read = getattr(model, "read_bytes", None)
    if callable(read):
        return int(read(greedy=greedy, blocks=blocks))
    fn = getattr(model, "weight_bytes", None)
    if callable(fn):
        return int(fn())
    hf = getattr(model, "hf_model", None)
    if hf is None:
        return 0
    width = torch.empty(0, dtype=getattr(torch, dtype, torch.float32)).element_size()
    return sum(p.numel() for p in hf.parameters()) * width


def forward_seconds(
    model, tokens: list[int], context: int = 200, reps: int = 9, greedy: bool = False
) -> dict[int, float]:
    """Median seconds of one ``forward`` of T new tokens after ``context`` cached tokens, per T in ``tokens``.

    ``greedy``: the call greedy verification makes (``forward_greedy`` where the model has it, else
    ``logits="argmax"``), else all logits.

    The cache is truncated back to ``context`` after each call, so every call sees the same length;
    the T values are interleaved within each repetition so drift hits them alike
    (:func:`verispec.models.schedule.time_forwards`).
    """
    times = time_forwards(model, tokens, context, reps, "greedy" if greedy else "all")  # as verification asks
    return {t: statistics.median(v) for t, v in times.items()}


def verify_costs(
    model,
    widths: list[int],
    context: int = 200,
    reps: int = 9,
    greedy: bool = False,
    seconds: dict[int, list[float]] | None = None,
) -> dict[int, float]:
    """``v(T)``: time of a forward over T new tokens relative to one token, for T in ``widths``
    (``greedy``: as greedy steps call it, see :func:`forward_seconds`).

    ``seconds``: where given, each T's median seconds (1 included) is appended to ``seconds[T]``,
    so a ratio can be read beside the times it divides (a slower one-token step lowers it).
    """
    secs = forward_seconds(model, sorted({1, *widths}), context, reps, greedy)
    if seconds is not None:
        for t, v in secs.items():
            seconds.setdefault(t, []).append(v)
    return {t: secs[t] / secs[1] for t in secs}


def eagle_token_seconds(proposer, reps: int = 21) -> float:
    """Median seconds one draft token of an :class:`~verispec.distill.eagle.EagleProposer` costs as
    it drafts (head scores, then one step of its layer on its own feature, one thread), on a scratch
    cache of the same model so the proposer's own state is left alone."""
    from verispec.distill.model import DraftKV
    from verispec.models.threads import torch_threads

    scratch = DraftKV(proposer.draft.model, max_length=8, weights=proposer.draft.weights)
    feat = torch.randn(1, proposer.draft.model.cfg.hidden_size)

    def one() -> None:
        scratch.truncate(torch.zeros(1, dtype=torch.int64), rows=[0])
        tok = scratch.logits(feat).argmax(-1)  # [1]
        scratch.forward(tok[:, None], rows=[0], logits="none", features=feat[:, None])

    with torch_threads(1):
        one()  # warm-up
        return _median_seconds(one, reps)


def lookup_seconds(lookup, length: int = 600, k: int = 4, reps: int = 21) -> float:
    """Median seconds of one prompt-lookup call over a ``length``-token history."""
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 1000, (length,), generator=gen)
    return _median_seconds(lambda: lookup.lookup(seq, k), reps)


def table_seconds(table, length: int = 600, k: int = 4, reps: int = 21) -> float:
    """Median seconds of one n-gram table draft (:meth:`verispec.ngrams.NgramTable.draft`) of ``k``
    tokens after a ``length``-token history of the table's own tokens (so that it finds them)."""
    seq = list(itertools.islice(itertools.chain.from_iterable(table.sequences), length)) or [0]
    return _median_seconds(lambda: table.draft(seq, k), reps)


def conditional_acceptance(stats: GenerationStats) -> float:
    """Per-token acceptance ``a``: accepted draft tokens over draft tokens whose predecessors were all
    accepted (what the i.i.d. model means by a; ``stats.acceptance_rate`` divides by all drafted)."""
    acc, drafted = stats.accepted_per_position, stats.drafted_per_position
    reached = sum(min(drafted[i], acc[i - 1] if i else drafted[0]) for i in range(len(drafted)))
    return sum(acc) / reached if reached else 0.0


def draft_fraction(stats: GenerationStats) -> float:
    """Fraction of target calls that verified at least one draft token."""
    if not stats.target_calls or not stats.drafted_per_position:
        return 0.0
    return stats.drafted_per_position[0] / stats.target_calls


def draft_lengths(stats: GenerationStats) -> list[int]:
    """Target calls by the length of the draft chain they verified: ``[n_0, n_1, .., n_K]``, n_0 the
    calls that verified no draft (from ``drafted_per_position``: a chain that reached position i
    reached every position before it)."""
    reached = stats.drafted_per_position
    counts = [stats.target_calls - (reached[0] if reached else 0)]
    for i, n in enumerate(reached):
        counts.append(n - (reached[i + 1] if i + 1 < len(reached) else 0))
    return counts


def predicted_speedup_by_length(
    acceptance: float, lengths: list[float], draft_cost: float, verify_cost: dict[int, float]
) -> float | None:
    """Decode speedup over plain steps predicted from the draft lengths verified (``lengths`` as
    :func:`draft_lengths` gives them, or any weights per length; ``verify_cost[T]``: a forward over T
    tokens relative to one). None when a length's verify cost was not measured."""
    tokens = cost = 0.0
    for length, calls in enumerate(lengths):
        if calls <= 0:
            continue
        if length == 0:  # a plain step: one token at the cost of one
            tokens += calls
            cost += calls
            continue
        v = verify_cost.get(length + 1)
        if v is None:
            return None
        tokens += calls * expected_tokens(acceptance, length)
        cost += calls * (length * draft_cost + v)
    return tokens / cost if cost > 0 else 1.0


def predicted_speedup(
    acceptance: float, k: int, draft_cost: float, verify_cost: float, fraction: float = 1.0
) -> float:
    """Decode speedup over plain steps predicted by the model in the module docstring: a fraction
    ``fraction`` of the calls verifying k draft tokens, the others plain steps."""
    if k == 0 or fraction <= 0:
        return 1.0
    lengths = [1 - fraction] + [0.0] * (k - 1) + [fraction]
    return predicted_speedup_by_length(acceptance, lengths, draft_cost, {k + 1: verify_cost})
