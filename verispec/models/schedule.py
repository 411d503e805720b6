"""How the C++ kernel reads paired weights on this machine, chosen by measurement once per machine.

The kernel can serve passes of few input rows with tiles of one pair of weight rows (one stream from
memory per core) or of two pairs (two streams), and can prefetch in software when a pass has one
input row. Every choice gives bitwise the same outputs; only the speed differs, and which is faster
depends on the CPU (measured, all of SmolLM2-135M's matrices, 2 threads):

- 2-core AMD EPYC (Zen 4): one stream per core, with the hardware prefetcher alone, reads at full
  bandwidth. Two streams cost 13% at 2 float32 rows; a software prefetch on one row 10-25%.
- 2-core Intel Xeon with AVX-512: one stream per core is latency-bound. Two streams and the prefetch
  on one row: int8 1 row 10.7 -> 8.2 ms, float32 29.4 -> 23.8 ms, bfloat16 19.2 -> 14.5 ms.

So :func:`apply` times both schedules on the model itself (a one-token and a five-token forward,
interleaved) and keeps the faster. The choice is cached per CPU model, weight format and weight
size in ``<cache>/kernel_schedule.json``, so the measurement runs once per machine.
``VERISPEC_KERNEL_SCHEDULE`` (``one-stream``, ``two-stream`` or ``auto``) overrides it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SCHEDULES: dict[str, tuple[int, int, bool]] = {
    "one-stream": (5, 2, False),
    "two-stream": (1, 1, True),
}
"""Name -> ``(two_pair_rows_float, two_pair_rows_int8, prefetch_one_row)`` as the kernel's
``set_schedule`` takes them: tiles of two weight pairs serve passes of at least that many input rows
(float32/bfloat16, int8), and whether a pass of one input row prefetches."""

DEFAULT = "one-stream"
"""The kernel's own default (the EPYC's best); kept where the measurement cannot decide."""

ENV = "VERISPEC_KERNEL_SCHEDULE"

MIN_TUNED_BYTES = 64 * 2**20
"""Models whose weights are smaller keep :data:`DEFAULT` untimed: they stay in the caches, where the
schedules differ by little, and tests build many tiny models."""


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else what ``platform`` knows)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def faster(seconds: dict[str, list[float]], margin: float = 0.03) -> str:
    """The schedule whose least time is lowest; :data:`DEFAULT` unless another beats it by ``margin``
    (a relative gap smaller than that is not worth trusting to a few rounds)."""
    best = {name: min(times) for name, times in seconds.items() if times}
    if not best:
        return DEFAULT
    name = min(best, key=best.__getitem__)
    if DEFAULT in best and best[name] > (1 - margin) * best[DEFAULT]:
        return DEFAULT
    return name


@torch.no_grad()
def measure(model: Any, rounds: int = 6, context: int = 64) -> dict[str, list[float]]:
    """Seconds of a one-token plus a five-token forward of ``model`` (a kernel ``FastLlama``) after
    ``context`` tokens, per schedule, the schedules interleaved over ``rounds`` (the first is warm-up
    and not kept). Leaves the model's cache empty, for as many rows as before, and its kernel on
    :data:`DEFAULT`."""
    kernel, batch = model._kernel, model._batch
    ids = torch.arange(context + 5).remainder(model.vocab_size).view(1, -1)  # [1, context + 5]
    model.reset(1)
    model.forward(ids[:, :context], logits="none")
    back = torch.tensor([context])
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    for r in range(rounds + 1):
        for name in SCHEDULES if r % 2 else reversed(SCHEDULES):
            kernel.set_schedule(*SCHEDULES[name])
            start = time.perf_counter()
            for t in (1, 5):
                model.forward(ids[:, context : context + t], logits="last")
                model.truncate(back)
            if r:
                times[name].append(time.perf_counter() - start)
    kernel.set_schedule(*SCHEDULES[DEFAULT])
    model.reset(batch)
    return times


def _cache_file() -> Path:
    from verispec.models.loading import cache_dir

    return cache_dir() / "kernel_schedule.json"


def _read_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(data: dict[str, str], key: str, name: str) -> None:
    """Store ``name`` under ``key`` in ``data`` (the cache as read) and write it back."""
    data[key] = name
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # a read-only cache only costs the measurement next time
        logger.warning("could not cache the kernel schedule in %s: %s", path, exc)


def apply(model: Any) -> str:
    """Set ``model``'s kernel schedule (a kernel ``FastLlama``, its cache empty) and return its name.

    ``VERISPEC_KERNEL_SCHEDULE`` names one, or ``auto`` (the default): the cached choice for this
    CPU, weight format and weight size, else :func:`measure` then :func:`faster`, cached.
    """
    from verispec.config import ConfigError

    wanted = os.environ.get(ENV, "auto") or "auto"
    if wanted != "auto" and wanted not in SCHEDULES:
        raise ConfigError(f"{ENV} must be auto or one of {', '.join(SCHEDULES)}; got {wanted!r}")
    size = model.weight_bytes()
    if wanted != "auto":
        name = wanted
    elif size < MIN_TUNED_BYTES:
        name = DEFAULT
    else:
        key = f"{cpu_name()}|{model.dtype}|{size}|{torch.get_num_threads()} threads"
        cached = _read_cache()
        name = cached.get(key, "")
        if name not in SCHEDULES:
            name = faster(measure(model))
            _write_cache(cached, key, name)
    model._kernel.set_schedule(*SCHEDULES[name])
    return name
