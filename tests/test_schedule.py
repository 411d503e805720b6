"""The kernel's schedule for paired weights: chosen by measurement, cached per machine, overridable."""

from __future__ import annotations

import json
import logging

import pytest

from verispec.config import ConfigError
from verispec.models import schedule
from verispec.models.schedule import DEFAULT, PREFILL_KEY, SCHEDULES, faster


def test_faster_keeps_the_default_unless_another_wins_clearly() -> None:
    assert faster({"one-stream": [1.0, 0.9], "two-stream": [0.95, 0.8]}) == "two-stream"
    assert faster({"one-stream": [0.8], "two-stream": [0.79]}) == DEFAULT  # within the 3% margin
    assert faster({"one-stream": [0.7], "two-stream": [0.9]}) == "one-stream"
    assert faster({"one-stream": [], "two-stream": []}) == DEFAULT


def test_faster_compares_round_by_round() -> None:
    """One lucky round of the default does not decide: each round's pair of times is compared, and
    the median of those ratios chooses. Rounds that do not pair up fall back to least times."""
    one, two = [1.0, 1.0, 1.0, 0.5], [0.9, 0.9, 0.9, 0.95]
    assert faster({"one-stream": one, "two-stream": two}) == "two-stream"  # least times: one-stream
    assert faster({"one-stream": [1.0, 0.8, 1.2], "two-stream": [1.02, 0.79, 1.25]}) == DEFAULT
    assert faster({"one-stream": [1.0, 0.6], "two-stream": [0.9]}) == "one-stream"
    assert faster({"two-stream": [0.9]}) == "two-stream"


class _Kernel:
    def __init__(self) -> None:
        self.schedule = SCHEDULES[DEFAULT]

    def set_schedule(self, *sched: object) -> None:
        self.schedule = sched

    def set_block_rows(self, layers: int, head: int) -> None:
        self.block_rows = (layers, head)


class _Model:
    """What ``apply`` and ``measure_crossing`` read of a FastLlama: its kernel, dtype, context cap and
    weight size."""

    dtype = "int8"
    max_length = 8192
    has_blocks = True
    q4_rows = head_q8_rows = 6

    def __init__(self, size: int) -> None:
        self._kernel = _Kernel()
        self.size = size
        self.kernel_prefill_max = {"float32": 96, "int8": 96}

    def weight_bytes(self) -> int:
        return self.size


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[int]:
    """A cache in tmp_path and a fake measurement in which two-stream wins; counts the measurements."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(schedule.ENV, raising=False)
    calls: list[int] = []

    def measure(model, rounds: int = 6, context: int = 64) -> dict[str, list[float]]:
        calls.append(1)
        return {"one-stream": [2.0, 1.0], "two-stream": [0.8, 0.9]}

    monkeypatch.setattr(schedule, "measure", measure)
    return calls


def test_apply_measures_once_per_machine_and_format_then_reads_the_cache(timed, tmp_path) -> None:
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.apply(model) == "two-stream"
    assert model._kernel.schedule == SCHEDULES["two-stream"]
    cached = json.loads((tmp_path / "kernel_schedule.json").read_text())
    assert list(cached.values()) == ["two-stream"]
    assert "int8" in next(iter(cached)) and str(model.size) in next(iter(cached))
    again = _Model(model.size)
    assert schedule.apply(again) == "two-stream" and again._kernel.schedule == SCHEDULES["two-stream"]
    assert len(timed) == 1  # the second model read the cache
    other = _Model(model.size + 1)  # another model size is measured on its own
    schedule.apply(other)
    assert len(timed) == 2


def test_a_measurement_is_announced_and_a_cached_choice_is_not(timed, prefill_timed, caplog) -> None:
    """A first run sits for seconds timing the machine: it says what it times, and only then."""
    model = _Model(schedule.MIN_TUNED_BYTES)
    with caplog.at_level(logging.WARNING, logger="verispec"):
        schedule.apply(model)
        schedule.apply_prefill(model)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2 and all("on this machine once" in n and "kernel_schedule.json" in n for n in notes)
    assert "reading int8 weights" in notes[0] and "int8 prompts" in notes[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="verispec"):
        schedule.apply(_Model(model.size))
        schedule.apply_prefill(_Model(model.size))
    assert not caplog.records and len(timed) == 1 and len(prefill_timed) == 1


def test_small_models_keep_the_default_untimed(timed) -> None:
    model = _Model(schedule.MIN_TUNED_BYTES - 1)
    assert schedule.apply(model) == DEFAULT
    assert model._kernel.schedule == SCHEDULES[DEFAULT] and not timed


def test_the_environment_overrides_and_is_checked(timed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(schedule.ENV, "one-stream")
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.apply(model) == "one-stream" and not timed
    monkeypatch.setenv(schedule.ENV, "fastest")
    with pytest.raises(ConfigError, match="VERISPEC_KERNEL_SCHEDULE"):
        schedule.apply(model)


def test_an_unreadable_cache_is_measured_again(timed, tmp_path) -> None:
    (tmp_path / "kernel_schedule.json").write_text("not json")
    assert schedule.apply(_Model(schedule.MIN_TUNED_BYTES)) == "two-stream"
    assert len(timed) == 1


def _times(kernel: dict[int, float], torch: dict[int, float]) -> dict[str, dict[int, list[float]]]:
    """Measured times with noise above each least one, which is what counts."""
    return {
        "kernel": {t: [v * 1.3, v] for t, v in kernel.items()},
        "torch": {t: [v, v * 1.5] for t, v in torch.items()},
    }


def test_prefill_crossing_is_where_the_two_lines_meet() -> None:
    # kernel 1 s + 0.01 s per token, torch 1.5 s + 0.005 s per token: they meet at 100 tokens
    times = _times({48: 1.48, 160: 2.6}, {48: 1.74, 160: 2.3})
    assert schedule.prefill_crossing(times) == 96  # 100, rounded down to a multiple of 8
    # torch ahead at both lengths and gaining: the lines met below them (41.4 tokens), or would
    # have below the floor
    assert schedule.prefill_crossing(_times({48: 1.0, 160: 3.0}, {48: 0.9, 160: 1.2})) == 40
    assert schedule.prefill_crossing(_times({48: 1.0, 160: 3.0}, {48: 0.3, 160: 0.6})) == 16
    # the kernel ahead and gaining: as far as the limit allows
    assert schedule.prefill_crossing(_times({48: 0.5, 160: 1.0}, {48: 1.0, 160: 2.0})) == 2048
    assert schedule.prefill_crossing(_times({48: 1.0, 160: 2.0}, {48: 0.5, 160: 1.0})) == 16


def test_measure_crossing_times_a_long_prompt_when_the_kernel_leads_past_the_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kernel 0.1 s + 1 ms per token; torch 0.3 s + 1 ms per token up to 256 tokens, then 0.7 ms per
    # token: the short lines never meet, the long ones at 256 + 0.2 / 0.0003 = 922.7 tokens
    def kernel(t: int) -> float:
        return 0.1 + 0.001 * t

    def torch_path(t: int) -> float:
        return 0.3 + 0.001 * t if t <= 256 else 0.3 + 0.001 * 256 + 0.0007 * (t - 256)

    asked: list[tuple[int, ...]] = []

    def measure_prefill(model, sizes=schedule.PREFILL_SIZES, rounds: int = 3):
        asked.append(tuple(sizes))
        return _times({t: kernel(t) for t in sizes}, {t: torch_path(t) for t in sizes})

    monkeypatch.setattr(schedule, "measure_prefill", measure_prefill)
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.measure_crossing(model) == 920  # rounded down to a multiple of 8
    assert asked == [schedule.PREFILL_SIZES, (schedule.PREFILL_LONG,)]
    model.max_length = 512  # a model that holds no more: the long length is its own
    asked.clear()
    schedule.measure_crossing(model)
    assert asked == [schedule.PREFILL_SIZES, (512,)]
    model.max_length = max(schedule.PREFILL_SIZES)  # nothing longer to time: the short lines decide
    asked.clear()
    assert schedule.measure_crossing(model) == schedule.PREFILL_LIMITS[1]
    assert asked == [schedule.PREFILL_SIZES]


def test_measure_crossing_stops_at_the_sizes_when_the_lines_meet_among_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[int, ...]] = []

    def measure_prefill(model, sizes=schedule.PREFILL_SIZES, rounds: int = 3):
        asked.append(tuple(sizes))
        return _times({64: 0.2, 256: 0.7}, {64: 0.31, 256: 0.61})  # the lines meet at 169.6 tokens

    monkeypatch.setattr(schedule, "measure_prefill", measure_prefill)
    assert schedule.measure_crossing(_Model(schedule.MIN_TUNED_BYTES)) == 168
    assert asked == [schedule.PREFILL_SIZES]


@pytest.fixture
def prefill_timed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[int]:
    """A cache in tmp_path and a fake prefill measurement that crosses at 128 tokens."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(schedule.PREFILL_ENV, raising=False)
    calls: list[int] = []

    def measure_prefill(model, sizes=schedule.PREFILL_SIZES, rounds: int = 3):
        calls.append(1)
        return _times({48: 0.48, 160: 1.6}, {48: 0.8, 160: 1.6 - 0.32 * 32 / 112})

    monkeypatch.setattr(schedule, "measure_prefill", measure_prefill)
    return calls


def test_apply_prefill_measures_once_per_machine_and_format(prefill_timed, tmp_path) -> None:
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.apply_prefill(model) == 128
    assert model.kernel_prefill_max == {"float32": 96, "int8": 128}  # only its own format
    cached = json.loads((tmp_path / "kernel_schedule.json").read_text())
    assert list(cached.values()) == [128] and next(iter(cached)).startswith(PREFILL_KEY)
    again = _Model(model.size)
    assert schedule.apply_prefill(again) == 128 and len(prefill_timed) == 1
    assert schedule.apply_prefill(_Model(model.size + 1)) == 128 and len(prefill_timed) == 2


def test_apply_prefill_keeps_small_models_and_obeys_the_environment(
    prefill_timed, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert schedule.apply_prefill(_Model(schedule.MIN_TUNED_BYTES - 1)) == 96 and not prefill_timed
    monkeypatch.setenv(schedule.PREFILL_ENV, "200")
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.apply_prefill(model) == 200 and model.kernel_prefill_max["int8"] == 200
    assert not prefill_timed
    for bad in ("lots", "-1"):
        monkeypatch.setenv(schedule.PREFILL_ENV, bad)
        with pytest.raises(ConfigError, match="VERISPEC_KERNEL_PREFILL_MAX"):
            schedule.apply_prefill(model)


def _block_times(blocks: dict[int, float], rows: dict[int, float]) -> dict[str, dict[int, list[float]]]:
    return {
        "blocks": {t: [v * 1.4, v] for t, v in blocks.items()},
        "rows": {t: [v, v * 1.2] for t, v in rows.items()},
    }


def test_blocks_crossing_is_the_last_width_before_the_float32_matrices_win() -> None:
    rows = {2: 10.0, 4: 10.5, 6: 11.0, 8: 11.5, 10: 12.0}
    assert schedule.blocks_crossing(_block_times({2: 4.0, 4: 6.0, 6: 8.0, 8: 11.0, 10: 13.0}, rows)) == 8
    assert schedule.blocks_crossing(_block_times({2: 11.0, 4: 6.0, 6: 8.0, 8: 9.0, 10: 10.0}, rows)) == 1
    assert schedule.blocks_crossing(_block_times({t: 1.0 for t in rows}, rows)) == 10


@pytest.fixture
def blocks_timed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[int]:
    """A cache in tmp_path and a fake block measurement whose crossing is 6 tokens."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(schedule.BLOCKS_ENV, raising=False)
    calls: list[int] = []

    def measure_blocks(model, widths=schedule.BLOCK_WIDTHS, rounds: int = 4, context: int = 64):
        calls.append(1)
        return _block_times({2: 1.0, 4: 2.0, 6: 3.0, 8: 5.0}, {2: 4.0, 4: 4.0, 6: 4.0, 8: 4.0})

    monkeypatch.setattr(schedule, "measure_blocks", measure_blocks)
    return calls


def test_apply_blocks_measures_once_per_machine_and_sets_both_limits(blocks_timed, tmp_path) -> None:
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.apply_blocks(model) == 6
    assert model.q4_rows == model.head_q8_rows == 6 and model._kernel.block_rows == (6, 6)
    cached = json.loads((tmp_path / "kernel_schedule.json").read_text())
    assert list(cached.values()) == [6] and next(iter(cached)).startswith(schedule.BLOCKS_KEY)
    assert schedule.apply_blocks(_Model(model.size)) == 6 and len(blocks_timed) == 1


def test_apply_blocks_keeps_the_default_where_untimed_and_obeys_the_environment(
    blocks_timed, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert schedule.apply_blocks(_Model(schedule.MIN_TUNED_BYTES - 1)) == _Model.q4_rows
    plain = _Model(schedule.MIN_TUNED_BYTES)
    plain.has_blocks = False
    assert schedule.apply_blocks(plain) == _Model.q4_rows and not blocks_timed
    monkeypatch.setenv(schedule.BLOCKS_ENV, "0")  # never read the blocks
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.apply_blocks(model) == 0 and model._kernel.block_rows == (0, 0) and not blocks_timed
    for bad in ("many", "-2"):
        monkeypatch.setenv(schedule.BLOCKS_ENV, bad)
        with pytest.raises(ConfigError, match="VERISPEC_BLOCK_ROWS"):
            schedule.apply_blocks(model)


def _cpuinfo(family: int, model: int, flags: str) -> str:
    """A two-processor ``/proc/cpuinfo`` under the bare name virtual machines often report."""
    lines = ["model name\t: AMD EPYC", f"cpu family\t: {family}", f"model\t: {model}", f"flags\t: {flags}"]
    return "".join(f"processor\t: {n}\n" + "\n".join(lines) + "\n\n" for n in range(2))


def test_cpu_name_tells_apart_cpus_that_share_a_model_name() -> None:
    """Cached crossings are keyed by ``cpu_name``: a Zen 3 without AVX-512 and a Zen 5 with it, both
    reported as "AMD EPYC", must not share them."""
    from unittest.mock import mock_open, patch

    with patch("builtins.open", mock_open(read_data=_cpuinfo(25, 1, "fpu sse avx2 fma"))):
        zen3 = schedule.cpu_name()
    with patch("builtins.open", mock_open(read_data=_cpuinfo(26, 2, "fpu avx2 avx512f avx512_vnni"))):
        zen5 = schedule.cpu_name()
    assert zen3 == "AMD EPYC (family 25, model 1; avx2)"
    assert zen5 == "AMD EPYC (family 26, model 2; avx2+avx512f+avx512_vnni)"


def test_cache_key_follows_the_kernel_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed choices are keyed by the kernel's source version: a changed kernel is timed again
    instead of inheriting an older one's step costs."""
    from types import SimpleNamespace

    from verispec.models import fast_llama

    model = SimpleNamespace(dtype="w4a8", weight_bytes=lambda: 123)
    now = schedule._key(model)
    assert now.endswith(f"|kernel {fast_llama.kernel_version()}") and len(fast_llama.kernel_version()) == 12
    monkeypatch.setattr(fast_llama, "kernel_version", lambda: "0123456789ab")
    assert schedule._key(model) != now and schedule._key(model).endswith("|kernel 0123456789ab")


def test_step_curve_is_each_widths_least_time_over_one_tokens_at_least_one() -> None:
    times = {1: [1.2, 1.0], 2: [1.1, 1.3], 3: [0.95, 1.4], 4: [1.6, 1.5]}
    assert schedule.step_curve(times) == pytest.approx([1.0, 1.1, 1.0, 1.5])


@pytest.fixture
def steps_timed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[int]:
    """A cache in tmp_path and a fake step measurement: each extra token costs 0.25 of one."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    calls: list[int] = []

    def measure_steps(model, widths: int = schedule.STEP_WIDTHS, rounds: int = 5, context: int = 128):
        calls.append(1)
        return {t: [1.0 + 0.25 * (t - 1), 9.0] for t in range(1, widths + 1)}

    monkeypatch.setattr(schedule, "measure_steps", measure_steps)
    return calls


def test_apply_step_costs_measures_once_per_machine_and_is_the_engines_prior(steps_timed, tmp_path) -> None:
    from verispec.costs import costs_for

    want = [1.0 + 0.25 * w for w in range(schedule.STEP_WIDTHS)]
    model = _Model(schedule.MIN_TUNED_BYTES)
    assert schedule.apply_step_costs(model) == pytest.approx(want) == model.step_cost_prior
    cached = json.loads((tmp_path / "kernel_schedule.json").read_text())
    assert next(iter(cached)).startswith(schedule.STEPS_KEY)
    again = _Model(model.size)
    assert schedule.apply_step_costs(again) == pytest.approx(want) and len(steps_timed) == 1
    costs = costs_for(again)  # a fresh process prices its first drafts at the measured curve
    assert costs.ratio(3) == pytest.approx(1.5) and costs.ratio(12) == pytest.approx(3.75)
    small = _Model(schedule.MIN_TUNED_BYTES - 1)
    assert schedule.apply_step_costs(small) is None and small.step_cost_prior is None
    assert len(steps_timed) == 1
    (tmp_path / "kernel_schedule.json").write_text(json.dumps({next(iter(cached)): [1.0, "x"]}))
    assert schedule.apply_step_costs(_Model(model.size)) == pytest.approx(want) and len(steps_timed) == 2


def test_a_model_too_short_for_a_measurement_takes_the_cache_or_the_default(
    timed, prefill_timed, blocks_timed, steps_timed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_model(..., max_length=100)`` on a machine with nothing cached: no measurement runs
    calls longer than the model's context; the defaults hold until a load with room measures."""
    monkeypatch.delenv(schedule.ENV, raising=False)
    short = _Model(schedule.MIN_TUNED_BYTES)
    short.max_length = 100
    assert schedule.apply(short) == "two-stream"  # 64 + 5 tokens fit: measured
    assert schedule.apply_blocks(short) == 6  # 64 + 16 tokens fit: measured
    assert schedule.apply_prefill(short) == 96 and short.kernel_prefill_max["int8"] == 96
    assert schedule.apply_step_costs(short) is None and short.step_cost_prior is None
    assert (len(timed), len(prefill_timed), len(blocks_timed), len(steps_timed)) == (1, 0, 1, 0)
    roomy = _Model(schedule.MIN_TUNED_BYTES)  # measures what the short one could not
    assert schedule.apply_prefill(roomy) == 128 and schedule.apply_step_costs(roomy) is not None
    again = _Model(schedule.MIN_TUNED_BYTES)
    again.max_length = 20  # too short for any measurement, but the cache has them all now
    tiny = _Model(schedule.MIN_TUNED_BYTES + 1)  # another size, nothing cached, no room
    tiny.max_length = 20
    assert schedule.apply(tiny) == DEFAULT and schedule.apply_blocks(tiny) == _Model.q4_rows
    assert schedule.apply(again) == "two-stream" and schedule.apply_blocks(again) == 6
    assert schedule.apply_prefill(again) == 128
    assert schedule.apply_step_costs(again) == pytest.approx(roomy.step_cost_prior)
    assert (len(timed), len(prefill_timed), len(blocks_timed), len(steps_timed)) == (1, 1, 1, 1)


class _Counted:
    """A model of one row that records each call's kind, width and starting length."""

    vocab_size = 50
    max_length = 64

    def __init__(self) -> None:
        self.length = 0
        self.calls: list[tuple[str, int, int]] = []

    def reset(self, batch_size: int) -> None:
        self.length = 0

    def forward(self, input_ids, rows=None, logits="all"):
        self.calls.append((logits, input_ids.shape[1], self.length))
        self.length += input_ids.shape[1]

    def truncate(self, lengths, rows=None) -> None:
        self.length = int(lengths[0])


class _CountedGreedy(_Counted):
    def forward_greedy(self, lines: list[list[int]], rows: list[int]) -> list[list[int]]:
        self.calls.append(("greedy", len(lines[0]), self.length))
        self.length += len(lines[0])
        return [[0] * len(lines[0])]


def test_time_forwards_greedy_times_the_greedy_steps_own_call() -> None:
    """``logits="greedy"`` times ``forward_greedy`` where the model has one (what the engine calls
    for a greedy step), else ``forward(..., "argmax")``; every call starts at the same length."""
    fast = _CountedGreedy()
    times = schedule.time_forwards(fast, [1, 3], 20, 2, "greedy")
    assert sorted(times) == [1, 3] and all(len(v) == 2 for v in times.values())
    assert fast.calls == [("none", 20, 0)] + [("greedy", 1, 20), ("greedy", 3, 20)] * 3  # warm-up + 2
    plain = _Counted()
    schedule.time_forwards(plain, [2], 10, 1, "greedy")
    assert plain.calls == [("none", 10, 0), ("argmax", 2, 10), ("argmax", 2, 10)]
