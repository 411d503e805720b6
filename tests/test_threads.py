"""The kernel's thread-count tuner: follows measured call times, probes rarely when settled."""

from __future__ import annotations

import pytest
import torch

from verispec.models.threads import ThreadTuner


@pytest.fixture(autouse=True)
def two_threads():
    """The tuners below are told the process runs 2 threads: make it so, whatever earlier tests set."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class FakeClock:
    """Makes ``time.perf_counter`` advance by a per-thread-count cost during each call."""

    def __init__(self, costs: dict[int, float]) -> None:
        self.costs = costs
        self.now = 0.0
        self.calls: list[int] = []

    def call(self) -> None:
        threads = torch.get_num_threads()
        self.calls.append(threads)
        self.now += self.costs[threads]


def _run(tuner: ThreadTuner, clock: FakeClock, n: int, monkeypatch) -> None:
    monkeypatch.setattr("verispec.models.threads.time.perf_counter", lambda: clock.now)
    for _ in range(n):
        tuner.run(clock.call)


def test_keeps_two_threads_on_a_quiet_machine_and_probes_less_and_less(monkeypatch) -> None:
    tuner = ThreadTuner(max_threads=lambda: 2)
    clock = FakeClock({2: 0.028, 1: 0.050})
    _run(tuner, clock, 2000, monkeypatch)
    assert tuner.choice == 2
    probes = clock.calls.count(1)
    assert 3 <= probes <= 8  # at 16, 48, 112, ... calls: intervals double up to 1024
    assert torch.get_num_threads() == 2  # the process setting is restored after each call


def test_switches_to_one_thread_under_contention_and_back(monkeypatch) -> None:
    tuner = ThreadTuner(max_threads=lambda: 2)
    clock = FakeClock({2: 0.028, 1: 0.050})
    _run(tuner, clock, 100, monkeypatch)
    clock.costs = {2: 1.2, 1: 0.07}  # another process takes a core
    start = len(clock.calls)
    _run(tuner, clock, 300, monkeypatch)
    assert tuner.choice == 1
    slow = [i for i, t in enumerate(clock.calls[start:]) if t == 2]
    assert len(slow) <= 1 + 300 // 16  # at most the calls before the next probe, then rare probes
    clock.costs = {2: 0.028, 1: 0.050}  # the other process ends
    _run(tuner, clock, ThreadTuner.max_interval_reduced + 1, monkeypatch)
    assert tuner.choice == 2


def test_single_thread_process_never_probes(monkeypatch) -> None:
    tuner = ThreadTuner(max_threads=lambda: 1)
    clock = FakeClock({1: 0.05, 2: 0.05})
    before = torch.get_num_threads()
    _run(tuner, clock, 50, monkeypatch)
    assert clock.calls == [before] * 50  # never touched the thread setting


def test_follow_uses_the_current_choice_without_learning(monkeypatch) -> None:
    tuner = ThreadTuner(max_threads=lambda: 2)
    clock = FakeClock({2: 1.2, 1: 0.07})  # contention from the start
    _run(tuner, clock, 20, monkeypatch)
    assert tuner.choice == 1
    seen = []
    tuner.follow(lambda: seen.append(torch.get_num_threads()))
    assert seen == [1] and torch.get_num_threads() == 2
    assert tuner.choice == 1


def test_probes_compare_calls_of_the_same_size(monkeypatch) -> None:
    # Quiet machine: 2 threads are faster at every size, but a 16-row call costs 4 one-row calls.
    tuner = ThreadTuner(max_threads=lambda: 2)
    now = [0.0]
    monkeypatch.setattr("verispec.models.threads.time.perf_counter", lambda: now[0])

    def call(rows: int) -> None:
        per_row = {2: 0.028, 1: 0.050}[torch.get_num_threads()]
        now[0] += per_row * (1 if rows == 1 else 4)

    for i in range(600):
        rows = 16 if (i // 7) % 2 else 1  # the batch grows and shrinks between calls
        tuner.run(lambda rows=rows: call(rows), tokens=rows)
        assert tuner.choice == 2, f"switched to 1 thread at call {i}"


def test_torch_threads_sets_and_restores():
    from verispec.models.threads import torch_threads

    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("restored on errors too")
    assert torch.get_num_threads() == before
