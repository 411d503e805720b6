"""Prometheus metrics served at ``/metrics``.

Names follow vLLM's (``vllm:`` becomes ``verispec:``) where they mean the same thing, so existing
dashboards need only the prefix changed:

==============================================================  ==========================================
``verispec:num_requests_running`` / ``num_requests_waiting``    gauges: sequences in the batch / queued
``verispec:prompt_tokens_total`` / ``generation_tokens_total``  counters
``verispec:spec_decode_num_drafts_total``                       steps in which a sequence proposed >= 1 token
``verispec:spec_decode_num_draft_tokens_total``                 draft tokens proposed
``verispec:spec_decode_num_accepted_tokens_total``              draft tokens accepted
``verispec:spec_decode_num_accepted_tokens_per_pos_total``      accepted tokens by draft position (label)
``verispec:time_to_first_token_seconds``                        histogram, arrival to first token
``verispec:inter_token_latency_seconds``                        histogram, gap between deliveries
``verispec:e2e_request_latency_seconds``                        histogram, arrival to last token
``verispec:request_success_total``                              counter by finished_reason
==============================================================  ==========================================

A speculative step delivers several tokens at once; the inter-token latency is observed once per
delivery (as vLLM v1 does per iteration), so it measures the gaps a streaming client sees.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    """All server metrics in one private registry (so several servers can live in one process)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge(
            "verispec:num_requests_running", "Sequences in the running batch.", labels, registry=r
        ).labels(model_name)
        self.waiting = Gauge(
            "verispec:num_requests_waiting", "Requests waiting for a batch slot.", labels, registry=r
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "verispec:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "verispec:generation_tokens", "Tokens generated.", labels, registry=r
        ).labels(model_name)
        self.drafts = Counter(
            "verispec:spec_decode_num_drafts",
            "Speculative drafts (steps with >= 1 draft token, per sequence).",
            labels,
            registry=r,
        ).labels(model_name)
        self.draft_tokens = Counter(
            "verispec:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels, registry=r
        ).labels(model_name)
        self.accepted_tokens = Counter(
            "verispec:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=r
        ).labels(model_name)
        self._accepted_per_pos = Counter(
            "verispec:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft.",
            labels + ["position"],
            registry=r,
        )
        self.model_name = model_name
        self.ttft = Histogram(
            "verispec:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "verispec:inter_token_latency_seconds",
            "Time between token deliveries.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "verispec:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._finished = Counter(
            "verispec:request_success",
            "Finished requests by reason (stop, length, abort = client went away, error).",
            labels + ["finished_reason"],
            registry=r,
        )

    def accepted_at(self, position: int, count: int) -> None:
        """Add ``count`` accepted tokens at draft position ``position`` (0-based)."""
        self._accepted_per_pos.labels(self.model_name, str(position)).inc(count)

    def finished(self, reason: str) -> None:
        """Count one request that ended for ``reason``."""
        self._finished.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
