"""Continuous batching: one engine thread steps every running request together.

Requests wait in a FIFO queue until a batch slot is free. Each iteration of the engine thread:

1. drops requests whose clients went away (their slots are free at once; a slot's cache is simply
   overwritten by its next occupant, see ``verispec.models.base``);
2. admits waiting requests into free slots (prompt processing, one request at a time);
3. sets each running sequence's draft length: its own requested k, capped by the
   :class:`BatchPolicy` for the current batch size;
4. runs one :meth:`~verispec.engine.Engine.step` for the whole batch (shared target and draft
   forward passes), delivers each request its new text, and retires finished ones.

Requests join and leave between any two steps and keep their own sampling settings, seed and k.

Threading: torch calls happen only on the engine thread. Request handlers (asyncio) talk to it through
a condition-guarded queue; results go back with ``loop.call_soon_threadsafe`` into each request's
``asyncio.Queue``. Failure isolation: an exception while admitting a request fails that request
only; an exception in a batched step rolls every row back to its committed tokens and retries the
rows one by one, so only the request that fails alone is failed. Nothing escapes the thread.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from verispec.engine import Engine, SequenceState, StepEvent
from verispec.entrypoints.openai.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """What a request handler receives after each step that changed its request."""

    text: str
    """The whole output text so far (stop strings already cut), not a delta."""
    completion_tokens: int
    finish_reason: str | None = None
    """None while running; "stop", "length", or "error"."""
    stats: dict | None = None
    """The request's ``GenerationStats.to_dict()``, on the final update."""
    error: str | None = None
    """Why the request failed (finish_reason "error")."""


@dataclass(eq=False)
class ServerRequest:
    """One request as the engine thread sees it."""

    seq: SequenceState
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    k: int
    """The draft length this request asked for (0 = no speculation); the policy may lower it."""
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    seen: tuple[int, int, list[int], int] = (0, 0, [], 0)
    """(draft_tokens, accepted_tokens, accepted_per_position, new_tokens) already counted in metrics."""
    stream: bool = True
    """False: the client wants only the final result, so no update is sent before it (each update
    wakes the event loop thread, which then competes with the kernel's threads for the cores)."""


@dataclass(frozen=True)
class BatchPolicy:
    """Caps the draft length by batch size: speculation pays while the target's step is bound by
    reading its weights, and stops paying once a batch's extra verification tokens make the step
    compute-bound (measured crossover in ``benchmarks/SERVER.md``).

    ``limits`` is a sorted list of ``(max_batch, k_cap)``: batches of up to ``max_batch`` sequences
    draft at most ``k_cap`` tokens; batches larger than the last entry do not speculate.
    """

    limits: tuple[tuple[int, int], ...] = ((1, 64),)
    """Measured on SmolLM2-135M with prompt lookup on 2 quiet CPU cores (``benchmarks/SERVER.md``):
    k = 1..4 gave 1.04-1.09x at batch 1, 0.97 / 0.98 / 0.80x at batch 2 and at most 0.78x from batch
    4 up, so only a sequence running alone speculates. A draft with higher acceptance moves the
    crossover: ``--batch-policy 2:2,4:1`` and the like."""

    def cap(self, batch: int) -> int:
        """The largest draft length allowed for a batch of ``batch`` sequences."""
        bounds = [b for b, _ in self.limits]
        i = bisect.bisect_left(bounds, batch)
        return self.limits[i][1] if i < len(self.limits) else 0

    @classmethod
    def parse(cls, text: str) -> BatchPolicy:
        """From ``"4:64,8:2"`` (``max_batch:k_cap`` pairs); ``"off"`` never caps."""
        if text.strip() == "off":
            return cls(limits=((1 << 30, 64),))
        pairs = []
        for item in text.split(","):
            batch, k = item.split(":")
            pairs.append((int(batch), int(k)))
        if [b for b, _ in pairs] != sorted({b for b, _ in pairs}) or any(b < 1 or k < 0 for b, k in pairs):
            raise ValueError(f"bad batch policy {text!r}: want increasing max_batch:k_cap pairs")
        return cls(limits=tuple(pairs))


class Scheduler:
    """Owns the engine thread and the batch slots."""

    def __init__(
        self, engine: Engine, max_num_seqs: int, metrics: ServerMetrics, policy: BatchPolicy | None = None
    ):
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self.policy = policy or BatchPolicy()
        self._cond = threading.Condition()
        self._waiting: deque[ServerRequest] = deque()
        self._running: list[ServerRequest] = []
        self._free = list(range(max_num_seqs - 1, -1, -1))  # a stack: low slots first
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self.steps = 0

    # ----- called from request handlers (any thread) -----

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def run_here(self) -> None:
        """Run the engine loop in the calling thread until ``stop`` (instead of ``start``).

        Why: the kernel's OpenMP threads belong to the thread that first runs parallel work. A model
        loaded in one thread and run from another gets a second team of threads, and a decode step
        measured 25% slower that way (27 against 34 ms here). The server loads its models in the
        thread that then runs this loop.
        """
        self.bind_to_current_thread()
        self._run()

    def bind_to_current_thread(self) -> None:
        """Make the calling thread the engine thread (``healthy`` and ``stop`` follow it)."""
        self._thread = threading.current_thread()

    def stop(self) -> None:
        """Ask the engine thread to finish and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def submit(self, req: ServerRequest) -> None:
        """Queue a request; its updates arrive in ``req.queue``."""
        with self._cond:
            self._waiting.append(req)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, req: ServerRequest) -> None:
        """The client went away: drop the request before the next step (idempotent)."""
        with self._cond:
            req.cancelled = True
            self._cond.notify()

    @property
    def healthy(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive() and not self._stopping

    @property
    def num_running(self) -> int:
        """Sequences in the batch now."""
        return len(self._running)

    # ----- the engine thread -----

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            try:
                admitted = self._next_batch()
                if admitted is None:
                    return
                for req in admitted:
                    self._admit(req)
                if self._running:
                    self._step()
            except Exception:  # never let the thread die: fail what is running and go on
                log.exception("engine loop error")
                for req in list(self._running):
                    self._fail(req, "internal error in the engine loop")

    def _next_batch(self) -> list[ServerRequest] | None:
        """Wait for work; drop cancelled requests; pop the waiting requests that fit. None = stop."""
        with self._cond:
            while not self._stopping and not self._waiting and not self._running:
                self._cond.wait()
            if self._stopping:
                return None
            for req in [r for r in self._running if r.cancelled]:
                self._retire(req, "abort")
            admitted = []
            while self._waiting and self._free:
                req = self._waiting.popleft()
                if req.cancelled:
                    self.metrics.finished("abort")
                    continue
                req.seq.slot = self._free.pop()
                admitted.append(req)
            self.metrics.waiting.set(len(self._waiting))
            return admitted

    def _admit(self, req: ServerRequest) -> None:
        """Process the prompt into the request's slot; a failure fails this request only."""
        seq = req.seq
        try:
            self.engine.add(seq, seq.slot)
            if self.engine.proposer is not None and seq.k == 0:
                # The draft holds per-slot state; it must know every running sequence, since a batch
                # mixes rows with and without speculation and the policy may raise k later.
                self.engine.proposer.start(seq.slot, seq.tokens)
        except Exception as exc:
            log.exception("prompt processing failed")
            self._free.append(seq.slot)
            self._send(req, Update(text="", completion_tokens=0, finish_reason="error", error=_describe(exc)))
            self.metrics.finished("error")
            return
        self.metrics.prompt_tokens.inc(seq.prompt_len)
        self._running.append(req)
        self.metrics.running.set(len(self._running))

    def _step(self) -> None:
        cap = self.policy.cap(len(self._running))
        for req in self._running:
            req.seq.k = min(req.k, cap)
        seqs = [r.seq for r in self._running]
        try:
            events = self.engine.step(seqs)
        except Exception:
            log.exception("batched step failed; retrying its rows one by one")
            events = self._isolate()
        self.steps += 1
        by_seq = {id(r.seq): r for r in self._running}
        now = time.perf_counter()
        for ev in events:
            req = by_seq[id(ev.seq)]
            ev.seq.stats.seconds = now - ev.seq.started
            self._deliver(req, ev, now)
        for req in [r for r in self._running if r.seq.finished]:
            with self._cond:
                self._retire(req, req.seq.finish_reason or "stop")

    def _isolate(self) -> list[StepEvent]:
        """After a failed batched step: restore each row's cache to its committed tokens and step
        each row alone; fail the rows that fail alone."""
        events: list[StepEvent] = []
        for req in list(self._running):
            seq = req.seq
            try:
                self.engine.target.truncate(torch.tensor([len(seq.tokens) - 1]), rows=[seq.slot])
                if self.engine.proposer is not None:
                    self.engine.proposer.start(seq.slot, seq.tokens)
                events.extend(self.engine.step([seq]))
            except Exception as exc:
                log.exception("request failed alone; failing it")
                self._fail(req, _describe(exc))
        return events

    def _deliver(self, req: ServerRequest, ev: StepEvent, now: float) -> None:
        seq = req.seq
        stats = seq.stats
        drafted, accepted, per_pos, new = req.seen
        m = self.metrics
        if stats.draft_tokens > drafted:
            m.drafts.inc()
            m.draft_tokens.inc(stats.draft_tokens - drafted)
            m.accepted_tokens.inc(stats.accepted_tokens - accepted)
            for i, count in enumerate(stats.accepted_per_position):
                before = per_pos[i] if i < len(per_pos) else 0
                if count > before:
                    m.accepted_at(i, count - before)
        if stats.new_tokens > new:
            m.generation_tokens.inc(stats.new_tokens - new)
        req.seen = (
            stats.draft_tokens,
            stats.accepted_tokens,
            list(stats.accepted_per_position),
            stats.new_tokens,
        )
        if ev.token_ids:
            if req.first_token_at is None:
                req.first_token_at = now
                m.ttft.observe(now - req.arrival)
            else:
                m.itl.observe(now - (req.last_token_at or now))
            req.last_token_at = now
        if not req.stream and not seq.finished:
            return
        final = seq.stats.to_dict() if seq.finished else None
        self._send(
            req,
            Update(
                text=seq.text,
                completion_tokens=len(seq.output_ids),
                finish_reason=seq.finish_reason,
                stats=final,
            ),
        )

    def _fail(self, req: ServerRequest, message: str) -> None:
        with self._cond:
            self._retire(req, "error")
        self._send(
            req,
            Update(
                text=req.seq.text,
                completion_tokens=len(req.seq.output_ids),
                finish_reason="error",
                error=message,
            ),
        )

    def _retire(self, req: ServerRequest, reason: str) -> None:
        """Remove a running request and free its slot (caller holds the condition)."""
        if req in self._running:
            self._running.remove(req)
            self._free.append(req.seq.slot)
            self.metrics.running.set(len(self._running))
            self.metrics.finished(reason)
            if reason in ("stop", "length"):
                self.metrics.e2e.observe(time.perf_counter() - req.arrival)

    @staticmethod
    def _send(req: ServerRequest, update: Update) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
