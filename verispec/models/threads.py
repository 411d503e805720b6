"""Thread count for the CPU kernel, chosen from measured call times.

Why: the kernel splits every matrix product over the intra-op threads and meets at a barrier after
each (about 150 per forward). When another process takes one of the cores, one of our threads waits
at each barrier for the other to be scheduled again, and a decode step on 2 threads went from 28 ms
to 150-1200 ms here, while 1 thread kept running at 50-75 ms. The tuner runs the calls on the
fastest measured count and probes the other one now and then, at intervals that double while the
choice holds, so a quiet machine pays almost nothing and a busy one recovers within a few calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

R = TypeVar("R")

EXTRA_TOKEN_COST = 0.05
"""Cost of each further token in a call, relative to a one-token call (measured: 5 tokens ~1.2x)."""


class torch_threads:  # noqa: N801 - used as a function: ``with torch_threads(n):``
    """Run the block on ``n`` intra-op threads and restore the process's count after it.

    For small models next to the target (a draft head of 9M weights): their matrix products are too
    small to gain from a second thread, and on a shared machine a second thread makes them wait at
    every barrier (EAGLE head, 1 thread 4.8 ms per token; 2 threads 5.7 ms quiet, up to 64 ms busy).
    A class, not a generator-based context manager: it wraps every kernel call, where a generator
    frame's setup cost more than the thread check itself.
    """

    __slots__ = ("n", "before")

    def __init__(self, n: int) -> None:
        self.n = n
        self.before = n

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.before != self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        if self.before != self.n:
            torch.set_num_threads(self.before)


class ThreadTuner:
    """Runs kernel calls on the thread count with the lowest recent cost per call."""

    first_interval: int = 16
    """Calls between probes right after the choice changed."""
    max_interval: int = 1024
    """Longest gap between probes while the choice holds on all threads (a probe of 1 thread is cheap)."""
    max_interval_reduced: int = 256
    """Longest gap while on fewer threads: probing all threads on a busy machine can cost 20 calls'
    time, but a machine that became quiet again should get its speed back within seconds."""
    smoothing: float = 0.3
    """Weight of the newest measurement in each count's running cost."""

    def __init__(self, max_threads: Callable[[], int] = torch.get_num_threads) -> None:
        self._max_threads = max_threads
        self._cost: dict[tuple[int, int], float] = {}
        """Running cost per (threads, call size bucket): a probe is compared like for like, since a
        batch of 16 rows costs several one-row calls and the batch changes between calls."""
        self._choice: int | None = None
        self._calls = 0
        self._interval = self.first_interval
        self._next_probe = self.first_interval

    @property
    def choice(self) -> int:
        """The thread count calls run on now."""
        return self._choice_for(max(1, self._max_threads()))

    def _choice_for(self, top: int) -> int:
        return top if self._choice is None or self._choice > top else self._choice

    def follow(self, fn: Callable[[], R]) -> R:
        """Call ``fn`` on the current choice without measuring it (calls of another cost scale, such
        as long prefills, which are too rare to learn from but collapse just as badly)."""
        with torch_threads(self._choice_for(max(1, self._max_threads()))):
            return fn()

    def run(self, fn: Callable[[], R], tokens: int = 1) -> R:
        """Call ``fn`` on the chosen (or probed) thread count and record how long it took."""
        top = max(1, self._max_threads())
        if top == 1:
            return fn()
        self._calls += 1
        current = self._choice_for(top)
        probe = self._calls >= self._next_probe
        threads = (1 if current != 1 else top) if probe else current
        with torch_threads(threads):
            start = time.perf_counter()
            try:
                return fn()
            finally:
                cost = (time.perf_counter() - start) / (1 + EXTRA_TOKEN_COST * (max(tokens, 1) - 1))
                self.record(threads, cost, probe, top, max(tokens, 1).bit_length())

    def record(self, threads: int, cost: float, probe: bool, top: int, bucket: int = 1) -> None:
        """Fold one call's normalised cost into the running cost of ``(threads, bucket)``; settle a
        probe. ``bucket`` groups calls of similar size (tokens' bit length: 1, 2-3, 4-7, ...).

        A probe replaces the probed count's cost: its old figure is from another time and may be from
        another load on the machine. A probe in a bucket the current count has no figure for decides
        nothing.
        """
        key = (threads, bucket)
        old = self._cost.get(key)
        if probe or old is None:
            self._cost[key] = cost
        else:
            self._cost[key] = (1 - self.smoothing) * old + self.smoothing * cost
        if not probe:
            return
        current = self._choice_for(top)
        other = threads
        mine = self._cost.get((current, bucket))
        if mine is None:
            self._next_probe = self._calls + self.first_interval
            return
        if cost < mine:
            self._choice = other
            self._interval = self.first_interval
        else:
            if current == top:
                self._choice = None  # follow the process's thread setting
            cap = self.max_interval if current == top else self.max_interval_reduced
            self._interval = min(cap, 2 * self._interval)
        self._next_probe = self._calls + self._interval
