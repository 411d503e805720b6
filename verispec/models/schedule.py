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

The same goes for how long a prompt the kernel still takes (``FastLlama.kernel_prefill_max``): it
runs a prompt in pieces (``FastLlama.kernel_prefill_piece``: 128 tokens since session 25, 64
since session 17, 16 before), each reading all the weights, where the torch path runs one large
product per matrix at a fixed cost (float32: a row-major copy of the paired matrices;
bfloat16 and int8: a float32 or bfloat16 copy). Where they cross depends on the CPU (session 13,
the Xeon, min of 5, kernel / torch ms): float32 128 tokens 249 / 272, 192 381 / 377; int8 96 115 /
148, 128 161 / 149; bfloat16, whose torch path runs on AMX, 64 135 / 100. The session-4 EPYC
crossed near 64-96 for all three. With pieces of 64 (session 17, the Xeon, min of 4): float32
128 tokens 188 / 323, 256 474 / 535, 384 750 / 761; int8 128 172 / 161. :func:`apply_prefill`
times both paths at two prompt lengths and puts the crossing where the two lines meet, cached like
the schedule; ``VERISPEC_KERNEL_PREFILL_MAX`` (a number of tokens, or ``auto``) overrides it. Where
the kernel is still ahead at the longer length and the lines meet past it, it times both paths at
:data:`PREFILL_LONG` tokens too and takes the crossing from the two longer lengths: on the 2-core
EPYC of session 20 the kernel led at every length (float32, min of 3, kernel / torch ms: 256
tokens 370 / 517, 512 784 / 1059, 769 1176 / 1362), where the limit of 512 tokens had sent
Spec-Bench's summarization and rag prompts (660-769 tokens) to the slower torch path.

And the cost of a greedy step by its width (:func:`apply_step_costs`): the engine prices each draft
by what verifying it costs (:mod:`verispec.costs`) and times its own steps, but a fresh process knew
nothing until it had timed each width three times. The curve measured here, cached the same way, is
the prior it starts from.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

SCHEDULES: dict[str, tuple[int, int, bool, int]] = {
    "one-stream": (5, 2, False, 5),
    "two-stream": (1, 1, True, 2),
}
"""Name -> ``(two_pair_rows_float, two_pair_rows_int8, prefetch_one_row, wide_int8_rows)`` as the
kernel's ``set_schedule`` takes them: tiles of two weight pairs serve passes of at least that many
input rows (float32/bfloat16, int8), whether a pass of one input row prefetches, and from how many
input rows paired int8 products take the 512-bit tiles (where AVX-512 VNNI is; session 35: from 2
on the 2-core Xeon, 3-4 tokens 8-9% faster; the Zen 5 EPYC's one-stream schedule keeps 5)."""

DEFAULT = "one-stream"
"""The kernel's own default (the EPYC's best); kept where the measurement cannot decide."""

ENV = "VERISPEC_KERNEL_SCHEDULE"
PREFILL_ENV = "VERISPEC_KERNEL_PREFILL_MAX"
PREFILL_SIZES = (64, 256)
"""Prompt lengths :func:`measure_prefill` times: short chat prompts and the long end of the range
where the two paths are close (160 until session 17, when float32 crossed near 400 tokens)."""
PREFILL_LONG = 1024
"""The third length :func:`measure_crossing` times when the kernel still leads at the longest of
:data:`PREFILL_SIZES` and the lines meet past it (at most the model's ``max_length``)."""
PREFILL_KEY = "prefill-v14|"
"""Prefix of the cached crossings' keys, changed whenever either path's cost changes so that every
machine measures again. v3 (session 17): the torch path copies paired matrices in the kernel
(SmolLM2-135M's layers, float32 62-69 -> 43-49 ms, int8 to bfloat16 37-51 -> 18-20 ms), and the
kernel takes prompts in pieces of 64 tokens instead of 16 (float32 128 tokens 321 -> 188 ms). v4
(session 18): those copies of float32 bypass the caches (within a 210-token float32 prefill, 76-92
-> 46-62 ms). v5 (session 20): crossings past the measured lengths are measured at
:data:`PREFILL_LONG`, and may lie up to 2048 tokens. v6 (session 25): float32 passes of more
than 12 rows are tiled for the arithmetic and the kernel takes prompts in pieces of 128 (a
700-token float32 prompt on the Zen 5 EPYC 635 -> 509-536 ms). v7 (session 26): the 256-bit
float32 tiles load each input vector once for all their weight rows (the layer matrices at 64-128
rows on a Zen 3 EPYC without AVX-512, 9% faster). v8 (session 27): their 6-row pair tile in inline
assembly, and passes over blocks of 48 weight rows (there, a 128-token prompt piece 227 -> 186-197
ms, 288 tokens 519-529 -> 439-460). v9 (session 27): the int8 pair tiles of 2-6 rows in inline
assembly on CPUs without AVX-512 (there, a 128-token int8 prompt 264 -> 181 ms). v10 (session 34):
int8 products on AMX tiles where the CPU has them (on the Xeon, a 700-token int8 prompt on the
kernel 557-581 -> 262-275 ms; the torch path took 224-226). v11 (session 39): float32 prompts on
the torch path take the kernel's fused norms, rotations and activation too (on the Xeon, prompts
of 656-1334 tokens about 7% faster). v12 (session 39): long bfloat16 products of few columns split
their rows over the threads (int8 prompts of 769-848 tokens 6-8% faster on the torch path). v13
(session 40): on CPUs with AVX-512 VNNI and no AMX, int8 prompts on the kernel read the layers' tiles
(``linear_vnni_tiles``; on a Zen 4 EPYC the products of a 128-token piece about 20% faster). v14
(session 41): a prompt piece's attention widens each block of keys and values once for items of up
to 96 queries (on the Zen 4 EPYC its attention 11-17% faster, a 769-token int8 prompt 3-5%)."""
PREFILL_LIMITS = (16, 2 * PREFILL_LONG)
"""The crossing :func:`prefill_crossing` returns lies in this range: below the kernel's own call
size a prompt is one kernel call anyway, and far past the measured lengths (at most twice the
longest, :data:`PREFILL_LONG`) a line is a guess."""

EVERY_PROMPT = 1 << 30
"""A ``kernel_prefill_max`` no prompt reaches: every prompt runs on the kernel (the kernel-only
formats' limit, and the kernel side of :func:`measure_prefill`)."""

BLOCKS_ENV = "VERISPEC_BLOCK_ROWS"
BLOCKS_KEY = "blocks-v3|"
"""Prefix of the cached block-row crossings' keys (:func:`apply_blocks`); changed whenever either
path's cost changes, so that every machine measures again. v2 (session 26): the block tiles without
AVX-512 redone (one-token step on a Zen 3 EPYC about 30% faster). v3 (session 33): the 512-bit block
tiles prefetch (a one-token float32 step on the 2-core Xeon 8.1 -> 6.7 ms, five tokens 13.1 ->
9.3)."""
BLOCK_WIDTHS = (2, 4, 6, 8, 10, 12, 14, 16)
"""Call widths :func:`measure_blocks` times: decoding, verification of 1-15 drafts."""

STEPS_KEY = "steps-v4|"
"""Prefix of the cached step-cost curves' keys (:func:`apply_step_costs`); changed whenever the
kernel's cost by call width changes, so that every machine measures again. v2 (session 30): one-row
int8 passes prefetch (a one-token step about 10% faster on a Zen 3 EPYC), and the curve times the
greedy step's own call (``forward_greedy``), without the tensors around ``forward``. v3 (session 33):
the 512-bit block tiles prefetch, and take 5-6 rows against all four pairs of a group (on the Xeon,
five tokens 1.61 -> 1.40 times one). v4 (session 34): the greedy argmax vectorised (about 40 us less
per row of logits); int8 steps of up to 9 tokens stay off the AMX tiles (:data:`AMX_ROWS`)."""
STEP_WIDTHS = 9
"""Widths :func:`measure_steps` times: 1 to 9 tokens, verifying up to 8 drafts."""
STEP_CONTEXT = 128
"""Cached tokens before the steps :func:`measure_steps` times (a short chat's context)."""
MEASURE_CONTEXT = 64
"""Cached tokens before the calls :func:`measure` and :func:`measure_blocks` time."""

SCHEDULE_KEY = "schedule-v5|"
"""Prefix of the cached schedules' keys (:func:`apply`); changed whenever what :func:`measure` times
changes. v2 (session 33): greedy steps as decoding runs them, with the model's 4-bit blocks and its
head's int8 screen. Before (no prefix), the float32 matrices alone with the last position's whole
logits: for a float32 GGUF model, whose steps read the blocks, that timed calls decoding never makes,
and on the 2-core Xeon it kept one stream, while two streams, whose one-row passes prefetch, speed
the head screen's int8 pass: SmolLM2-135M's greedy step at 200 cached tokens, both schedules
alternating in one process (8 rounds of 5, min / median, ms), 1 token 6.09 / 6.72 -> 5.63 / 6.26,
5 tokens 8.70 / 9.47 -> 8.96 / 9.53. v3 (session 34): with the AMX tiles off, since the schedule is
how the pair-interleaved matrices are read, which int8 steps on the tiles do not. v4 (session 35):
the schedules also say from how many rows int8 products take the 512-bit tiles. v5 (session 40): 12
rounds instead of 6, compared round by round (:func:`faster`). On the 2-core Zen 4 EPYC, 6 rounds by
least times had chosen two streams for int8, where greedy steps alternating between the schedules
(10 rounds of 5 steps, /tmp/s40/sched.py, min / median ms) read one stream 4.25 / 4.55 for one
token and 5.56 / 5.81 for five, two streams 4.59 / 5.17 and 5.61 / 5.85."""
MIN_TUNED_BYTES = 64 * 2**20
"""Models whose weights are smaller keep :data:`DEFAULT` untimed: they stay in the caches, where the
schedules differ by little, and tests build many tiny models."""


CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
"""The instruction sets that change which kernel tiles run, named in :func:`cpu_name`."""


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` with its family, model and the instruction sets
    of :data:`CPU_FEATURES` it has, e.g. ``AMD EPYC (family 25, model 1; avx2)`` (else what
    ``platform`` knows).

    Virtual machines often report a bare name: the 2-core "AMD EPYC" machines of sessions 24-27
    were a Zen 5 with AVX-512 and a Zen 3 without it under that one name, and a cache keyed by the
    name alone handed one machine's measured crossings to the other."""
    import platform

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = "+".join(f for f in CPU_FEATURES if f in flags) or "no avx2"
    return f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}; {isa})"


def faster(seconds: dict[str, list[float]], margin: float = 0.03) -> str:
    """:data:`DEFAULT`, unless another schedule beats it by ``margin`` (a relative gap smaller than
    that is not worth trusting to a few rounds). Each is compared with the default round by round,
    the median of its time over the default's in the same round (:func:`measure` interleaves them,
    so a round's two times share the machine's state); where the rounds do not pair up, by least
    times. The schedule that beats the default by most wins."""
    base = seconds.get(DEFAULT, [])
    if not base:
        named = {name: min(times) for name, times in seconds.items() if times}
        return min(named, key=named.__getitem__) if named else DEFAULT
    ratios = {}
    for name, times in seconds.items():
        if name == DEFAULT or not times:
            continue
        if len(times) == len(base):
            ratios[name] = statistics.median(t / b for t, b in zip(times, base, strict=True))
        else:
            ratios[name] = min(times) / min(base)
    name = min(ratios, key=ratios.__getitem__, default=DEFAULT)
    return name if name != DEFAULT and ratios[name] < 1 - margin else DEFAULT


@torch.no_grad()
def measure(model: Any, rounds: int = 12, context: int = MEASURE_CONTEXT) -> dict[str, list[float]]:
    """Seconds of a one-token plus a five-token greedy step of ``model`` (a kernel ``FastLlama``)
    after ``context`` tokens, per schedule, the schedules interleaved over ``rounds`` (the first is
    warm-up and not kept). Each step is the call greedy decoding makes (``forward_greedy`` where the
    model has it, else ``forward(..., logits="argmax")``), reading whatever the model's steps read:
    its 4-bit blocks and its head's int8 screen where it has them (see :data:`SCHEDULE_KEY`).
    Leaves the model's cache empty, for as many rows as before, and its kernel on :data:`DEFAULT`."""
    kernel, batch = model._kernel, model._batch
    amx = bool(getattr(kernel, "amx", lambda: False)())
    if amx:
        kernel.set_amx(False)  # the schedule is how the pair-interleaved matrices are read
    ids = torch.arange(context + 5).remainder(model.vocab_size).view(1, -1)  # [1, context + 5]
    model.reset(1)
    model.forward(ids[:, :context], logits="none")
    back = torch.tensor([context])
    calls = _calls(model, ids, context, (1, 5), "greedy")
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    for r in range(rounds + 1):
        for name in SCHEDULES if r % 2 else reversed(SCHEDULES):
            kernel.set_schedule(*SCHEDULES[name])
            start = time.perf_counter()
            for call in calls.values():
                call()
                model.truncate(back)
            if r:
                times[name].append(time.perf_counter() - start)
    kernel.set_schedule(*SCHEDULES[DEFAULT])
    if amx:
        kernel.set_amx(True)
    model.reset(batch)
    return times


def _cache_file() -> Path:
    from verispec.models.loading import cache_dir

    return cache_dir() / "kernel_schedule.json"


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(_cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(data: dict[str, Any], key: str, name: object) -> None:
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


def _key(model: Any) -> str:
    """The cache key: CPU model, weight format, weight size, thread count and the kernel's source
    version (a changed kernel's steps cost what they cost now, not what an older one's did)."""
    from verispec.models.fast_llama import kernel_version

    threads = torch.get_num_threads()
    return f"{cpu_name()}|{model.dtype}|{model.weight_bytes()}|{threads} threads|kernel {kernel_version()}"


def _cached(
    model: Any,
    prefix: str,
    valid: Callable[[Any], bool],
    choose: Callable[[], T],
    what: str,
    takes: str,
    *,
    needs: int,
    fallback: T,
) -> T:
    """The choice cached for ``model`` under ``prefix + _key(model)`` if ``valid`` accepts it, else
    ``choose()``, cached.

    Before measuring it says so on the ``verispec`` logger (``what`` is timed, which ``takes`` about
    so long), since a first run otherwise sits silent for those seconds.

    The measurement runs calls of up to ``needs`` cached tokens: a model whose ``max_length`` is
    shorter (``load_model(..., max_length=...)``) cannot run it, and takes ``fallback`` where nothing
    is cached, measuring and caching nothing (a later load with room measures)."""
    key = prefix + _key(model)
    cached = _read_cache()
    value = cached.get(key)
    if not valid(value):
        if int(model.max_length) < needs:
            return fallback
        logger.warning("timing %s on this machine once (%s; cached in %s)", what, takes, _cache_file())
        value = choose()
        _write_cache(cached, key, value)
    return value


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
        name = _cached(
            model,
            SCHEDULE_KEY,
            lambda v: v in SCHEDULES,
            lambda: faster(measure(model)),
            f"two ways of reading {model.dtype} weights",
            "about a second",
            needs=MEASURE_CONTEXT + 5,
            fallback=DEFAULT,
        )
    model._kernel.set_schedule(*SCHEDULES[name])
    return name


@torch.no_grad()
def measure_blocks(
    model: Any, widths: tuple[int, ...] = BLOCK_WIDTHS, rounds: int = 4, context: int = MEASURE_CONTEXT
) -> dict[str, dict[int, list[float]]]:
    """Seconds of a forward of each of ``widths`` tokens after ``context`` (whole-head logits, as a
    sampled verification wants them), reading the exact blocks and reading the float32 matrices,
    alternating over ``rounds`` (after one uncounted warm-up round): ``{"blocks": {T: [s, ...]},
    "rows": {...}}``. Leaves ``model`` (a kernel ``FastLlama`` with blocks) empty, for as many rows as
    before, with its own block rows."""
    kernel, batch = model._kernel, model._batch
    ids = torch.arange(context + max(widths)).remainder(model.vocab_size).view(1, -1)  # [1, C + W]
    back = torch.tensor([context])
    limit = {"blocks": max(widths), "rows": 0}
    times: dict[str, dict[int, list[float]]] = {path: {t: [] for t in widths} for path in limit}
    try:
        model.reset(1)
        model.forward(ids[:, :context], logits="none")
        for r in range(rounds + 1):
            for t in widths:
                for path in limit if r % 2 else reversed(limit):
                    kernel.set_block_rows(limit[path], limit[path])
                    start = time.perf_counter()
                    model.forward(ids[:, context : context + t], logits="all")
                    if r:
                        times[path][t].append(time.perf_counter() - start)
                    model.truncate(back)
    finally:
        kernel.set_block_rows(model.q4_rows, model.head_q8_rows)
        model.reset(batch)
    return times


def blocks_crossing(times: dict[str, dict[int, list[float]]]) -> int:
    """The widest call that still reads the blocks: the last measured width, in increasing order,
    before the first where the float32 matrices are faster (least times); 1 if none."""
    widest = 1
    for t in sorted(times["blocks"]):
        if min(times["blocks"][t]) > min(times["rows"][t]):
            break
        widest = t
    return widest


def _env_tokens(name: str) -> int | None:
    """The number of tokens the environment variable ``name`` sets, or None for ``auto`` (or
    unset); anything else is a :class:`~verispec.config.ConfigError`."""
    from verispec.config import ConfigError

    wanted = os.environ.get(name, "auto") or "auto"
    if wanted == "auto":
        return None
    try:
        value = int(wanted)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{name} must be auto or a number of tokens; got {wanted!r}")
    return value


def apply_blocks(model: Any) -> int:
    """Set how many tokens a call of ``model`` (a kernel ``FastLlama``, its cache empty) may have and
    still read its exact blocks (``q4_rows`` and ``head_q8_rows``), and return it:
    ``VERISPEC_BLOCK_ROWS`` if set to a number, the class's default for small models or a model
    without blocks, else the cached crossing for this CPU and model, else :func:`blocks_crossing`
    of :func:`measure_blocks`, cached. Each further token costs its multiply-adds either way, and
    the blocks also their widening, so past some width the float32 matrices, read once from memory,
    are faster; where depends on the CPU's arithmetic (2-core EPYC, whole-head logits at 200 cached
    tokens, min of 15, ms, float32 / blocks: Zen 4 with 256-bit tiles, 5 tokens 17.4 / 13.8-14.6, 9
    17.6 / 19.6-19.9; Zen 5 with 512-bit tiles, 8 tokens 14.0 / 12.5, 10 14.1 / 17.9)."""
    value = _env_tokens(BLOCKS_ENV)
    if value is None and (not model.has_blocks or model.weight_bytes() < MIN_TUNED_BYTES):
        value = type(model).q4_rows
    elif value is None:
        value = _cached(
            model,
            BLOCKS_KEY,
            lambda v: isinstance(v, int) and v >= 1,
            lambda: blocks_crossing(measure_blocks(model)),
            "float32 calls reading the weights' blocks and their float32 copy",
            "about 2 s",
            needs=MEASURE_CONTEXT + max(BLOCK_WIDTHS),
            fallback=type(model).q4_rows,
        )
    model.q4_rows = model.head_q8_rows = value
    model._kernel.set_block_rows(value, value)
    return value


AMX_ENV = "VERISPEC_AMX_ROWS"
AMX_ROWS = STEP_WIDTHS + 1
"""From how many tokens a call reads the int8 AMX tiles by default: wider than any greedy step the
engine prices (:data:`STEP_WIDTHS`), so prompts (and wide batches) take the tiles and decoding
stays on the VNNI tiles. Switching between the two paths from step to step cost more than the
tiles saved (SmolLM2-135M int8 on the 2-core Xeon, 26 Spec-Bench prompts, two rounds, 64 new
tokens, whole-request tokens/s, /tmp/s34/genab.py; plain / lookup with the n-gram table k = 4 /
k = 8): tiles from 1 token 198.2 / 256.1 / 257.1, from 4 (what timing single steps of each width
had chosen) 222.8 / 250.9 / 256.9, from 10 225.3 / 265.0 / 267.6. Steps repeated at one width
(/tmp/s34/steady.py, min / median ms): VNNI 1 token 3.24 / 3.59, 5 tokens 5.08 / 5.53; AMX 3.69 /
4.32 and 5.12 / 5.39; 1 and 5 alternating, 5 on the tiles: 4.58 / 4.72 and 5.68 / 6.39."""

VNNI_ROWS = 16
"""The same for the tiles a CPU with VNNI and no AMX reads (``linear_vnni_tiles``, session 40), made
for prompt pieces of 128 rows, four input rows a pass. Below 16 rows the pair tiles were as fast or
faster: on the 2-core Zen 4 EPYC, one int8 call after 200 cached tokens, tiles / pair tiles, min /
median of 12 alternating rounds, ms (/tmp/s40/pfm.py): 10 rows 10.36 / 10.61 and 10.08 / 10.34, 12
rows 11.39 / 12.11 and 11.25 / 11.57, 16 rows 14.30 / 14.59 and 14.81 / 15.05, 20 rows 17.06 / 17.39
and 18.65 / 18.95, 36 rows 28.56 / 28.99 and 33.74 / 34.71, 64 rows 49.24 / 50.49 and 59.92 / 61.11."""


def apply_amx(model: Any) -> int:
    """Set from how many tokens a call of ``model`` (a kernel ``FastLlama``) reads its int8
    matrices' tiles (``amx_rows``; AMX or VNNI) and return it: ``VERISPEC_AMX_ROWS`` if set to a
    number, else :data:`AMX_ROWS` (AMX) or :data:`VNNI_ROWS`. Nothing to set (0) without tiles."""
    kernel = model._kernel
    if not bool(getattr(kernel, "tile_bytes", lambda: 0)()):
        return 0
    value = _env_tokens(AMX_ENV)
    if value is not None and value < 1:
        from verispec.config import ConfigError

        raise ConfigError(f"{AMX_ENV} must be auto or a number of tokens >= 1; got {value}")
    if value is None:
        value = VNNI_ROWS if bool(getattr(kernel, "vnni_tiles", lambda: False)()) else AMX_ROWS
    model.amx_rows = value
    kernel.set_amx_rows(value)
    return value


@torch.no_grad()
def measure_prefill(
    model: Any, sizes: tuple[int, ...] = PREFILL_SIZES, rounds: int = 3
) -> dict[str, dict[int, list[float]]]:
    """Seconds of a prompt of each of ``sizes`` tokens into an empty cache, on the kernel (in its
    pieces) and on the torch path, alternating over ``rounds`` (after one uncounted warm-up round):
    ``{"kernel": {T: [s, ...]}, "torch": {...}}``. Leaves ``model`` (a kernel ``FastLlama``) empty,
    for as many rows as before, with its own ``kernel_prefill_max``."""
    before, batch = model.kernel_prefill_max, model._batch
    ids = torch.arange(max(sizes)).remainder(model.vocab_size).view(1, -1)  # [1, max(sizes)]
    limit = {"kernel": EVERY_PROMPT, "torch": 0}
    times: dict[str, dict[int, list[float]]] = {path: {t: [] for t in sizes} for path in limit}
    try:
        for r in range(rounds + 1):
            for t in sizes:
                for path in limit if r % 2 else reversed(limit):
                    model.kernel_prefill_max = {model.dtype: limit[path]}
                    model.reset(1)
                    start = time.perf_counter()
                    model.forward(ids[:, :t], logits="last")
                    if r:
                        times[path][t].append(time.perf_counter() - start)
    finally:
        model.kernel_prefill_max = before
        model.reset(batch)
    return times


def prefill_crossing(times: dict[str, dict[int, list[float]]]) -> int:
    """The prompt length up to which the kernel is faster: where the lines through each path's least
    times at the two measured lengths meet, rounded down to a multiple of 8 and held within
    :data:`PREFILL_LIMITS`."""
    t0, t1 = min(times["kernel"]), max(times["kernel"])
    k0, k1 = (min(times["kernel"][t]) for t in (t0, t1))
    c0, c1 = (min(times["torch"][t]) for t in (t0, t1))
    lo, hi = PREFILL_LIMITS
    gap0 = c0 - k0  # the kernel's lead at the shorter length (seconds)
    slope = ((k1 - k0) - (c1 - c0)) / (t1 - t0)  # how fast that lead shrinks per token
    if slope <= 0:  # the kernel's lead never shrinks
        return hi if gap0 > 0 else lo
    return int(min(hi, max(lo, t0 + gap0 / slope))) // 8 * 8


def measure_crossing(model: Any) -> int:
    """The prompt length up to which the kernel is faster on ``model`` (a kernel ``FastLlama``, its
    cache empty): :func:`prefill_crossing` of :func:`measure_prefill` at :data:`PREFILL_SIZES`; if
    that lies past the longest of them, again from the longest and :data:`PREFILL_LONG` (or the
    model's ``max_length``, if shorter), since a line drawn through short prompts says little of
    long ones."""
    times = measure_prefill(model)
    crossing = prefill_crossing(times)
    longest = max(PREFILL_SIZES)
    long = min(PREFILL_LONG, int(model.max_length))
    if crossing <= longest or long <= longest:
        return crossing
    more = measure_prefill(model, (long,))
    pair = {path: {longest: times[path][longest], long: more[path][long]} for path in times}
    return prefill_crossing(pair)


def apply_prefill(model: Any) -> int:
    """Set ``model.kernel_prefill_max`` for its weight format (a kernel ``FastLlama``, its cache
    empty) and return it: ``VERISPEC_KERNEL_PREFILL_MAX`` if set to a number, the class's default
    for small models, else the cached crossing for this CPU, format and size, else
    :func:`measure_crossing`, cached. int4 and w4a8 weights have no torch path: every prompt runs on the
    kernel."""
    if getattr(model, "kernel_only", False):
        return model.kernel_prefill_max[model.dtype]
    value = _env_tokens(PREFILL_ENV)
    if value is None and model.weight_bytes() < MIN_TUNED_BYTES:
        value = model.kernel_prefill_max.get(model.dtype, 0)
    elif value is None:
        value = _cached(
            model,
            PREFILL_KEY,
            lambda v: isinstance(v, int) and v >= 0,
            lambda: measure_crossing(model),
            f"{model.dtype} prompts on the kernel and on the torch path",
            "5-25 s",
            needs=max(PREFILL_SIZES),
            fallback=model.kernel_prefill_max.get(model.dtype, 0),
        )
    model.kernel_prefill_max = {**model.kernel_prefill_max, model.dtype: value}
    return value


def _calls(
    model: Any, ids: torch.Tensor, context: int, widths: Sequence[int], logits: str
) -> dict[int, Callable[[], object]]:
    """Per width T of ``widths``, the call that feeds ``ids[:, context : context + T]`` (``ids``
    ``[1, >= context + T]``) to row 0 of ``model`` asking for ``logits``; ``"greedy"``: the call a
    greedy step makes, the model's ``forward_greedy`` where it has one (the kernel's argmax on
    Python ints, the line built here, outside any timing), else ``forward(..., logits="argmax")``."""
    greedy = getattr(model, "forward_greedy", None) if logits == "greedy" else None
    mode = "argmax" if logits == "greedy" else logits
    if greedy is not None:
        return {t: functools.partial(greedy, [ids[0, context : context + t].tolist()], [0]) for t in widths}
    return {t: functools.partial(model.forward, ids[:, context : context + t], logits=mode) for t in widths}


@torch.no_grad()  # not inference_mode: reset() here makes state tensors that later calls update in place
def time_forwards(
    model: Any, widths: Sequence[int], context: int, rounds: int, logits: str
) -> dict[int, list[float]]:
    """Seconds of one ``forward`` of each of ``widths`` new tokens (asking for ``logits``) after
    ``context`` cached tokens (at most what ``max_length`` leaves room for), the widths interleaved
    over ``rounds`` after one uncounted warm-up round: ``{T: [s, ...]}``. The cache is truncated back
    to the context after each call, so every call sees the same length. Leaves ``model`` holding
    the context in one row.

    ``logits="greedy"`` times the call a greedy step makes: the model's ``forward_greedy`` where it
    has one (the kernel's argmax on Python ints), else ``forward(..., logits="argmax")``."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (1, context + max(widths)), generator=gen)  # [1, C + W]
    context = min(context, model.max_length - max(widths))
    model.reset(1)
    model.forward(ids[:, :context], logits="none")
    back = torch.tensor([context])
    times: dict[int, list[float]] = {t: [] for t in widths}
    calls = _calls(model, ids, context, widths, logits)
    for r in range(rounds + 1):
        for t in widths:
            start = time.perf_counter()
            calls[t]()
            elapsed = time.perf_counter() - start
            model.truncate(back)
            if r:  # the first round is warm-up
                times[t].append(elapsed)
    return times


def measure_steps(
    model: Any, widths: int = STEP_WIDTHS, rounds: int = 5, context: int = STEP_CONTEXT
) -> dict[int, list[float]]:
    """Seconds of a greedy step's call (``forward_greedy``) of each width 1..``widths`` after
    ``context`` cached tokens (:func:`time_forwards`). Leaves ``model`` (a kernel ``FastLlama``)
    empty, for as many rows as before."""
    batch = model._batch
    try:
        return time_forwards(model, range(1, widths + 1), context, rounds, "greedy")
    finally:
        model.reset(batch)


def step_curve(times: dict[int, list[float]]) -> list[float]:
    """``[v(1), ..., v(W)]`` from :func:`measure_steps`: each width's least time over the one-token
    step's, at least 1 (the least times are the ones a busy machine disturbs least; a wider step
    that measured cheaper than one token is taken to cost as much)."""
    one = min(times[1])
    return [max(1.0, min(times[t]) / one) for t in sorted(times)]


def apply_step_costs(model: Any) -> list[float] | None:
    """Set and return ``model.step_cost_prior``, what a greedy step of each width 1..
    :data:`STEP_WIDTHS` costs over a one-token step on this machine (a kernel ``FastLlama``, its
    cache empty): the cached curve for this CPU, format and size, else :func:`step_curve` of
    :func:`measure_steps`, cached; None (the constant prior) for small models.

    The engine prices drafts by these costs (:class:`verispec.costs.StepCosts`) and measures its own
    as it steps, but a fresh process had only an optimistic prior, 5% per extra token, until it had
    timed each width three times: a short request drafted as if verification cost next to nothing
    (float32 steps of 2 / 3 / 4 tokens cost 1.18 / 1.52 / 1.89 of one on a Zen 3 EPYC)."""
    if model.weight_bytes() < MIN_TUNED_BYTES:
        model.step_cost_prior = None
        return None
    curve = _cached(
        model,
        STEPS_KEY,
        lambda v: (
            isinstance(v, list)
            and len(v) == STEP_WIDTHS
            and all(isinstance(x, (int, float)) and 1.0 <= x < 1e3 for x in v)
        ),
        lambda: step_curve(measure_steps(model)),
        f"{model.dtype} steps of 1 to {STEP_WIDTHS} tokens",
        "about a second",
        needs=STEP_CONTEXT + STEP_WIDTHS,
        fallback=None,
    )
    model.step_cost_prior = [float(x) for x in curve] if curve is not None else None
    return model.step_cost_prior
