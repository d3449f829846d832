"""``GET /metrics``: the engine's stats and the server's request figures as Prometheus text
(prometheus-client, in the ``serve`` extra). One registry per app, so several apps in one
process (tests) do not share counters."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from acb.outputs import GenerationOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("acb_requests_running", "requests being computed", registry=r)
        self.waiting = Gauge("acb_requests_waiting", "requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("acb_kv_cache_usage", "fraction of KV blocks held by requests", registry=r)
        self.prefix_hit_rate = Gauge("acb_prefix_cache_hit_rate", "prompt tokens found in the prefix cache",
                                     registry=r)
        self.requests = Counter("acb_requests", "requests ended, by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("acb_prompt_tokens", "prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("acb_generation_tokens", "generated tokens of ended requests",
                                         registry=r)
        self.ttft = Histogram("acb_time_to_first_token_seconds", "submit to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("acb_inter_token_latency_seconds", "time between a request's tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("acb_request_duration_seconds", "submit to final outcome", registry=r,
                             buckets=_LATENCY_BUCKETS)

    def disconnected(self) -> None:
        self.requests.labels("client_disconnected").inc()

    def finished(self, out: GenerationOutput) -> None:
        self.requests.labels(out.status.name.lower()).inc()
        self.prompt_tokens.inc(len(out.prompt_ids))
        counts = [len(s.generated_tokens) for s in out.samples] if out.samples else [len(out.generated_tokens)]
        self.generation_tokens.inc(sum(counts))
        if out.time_to_first_token is not None:
            self.ttft.observe(out.time_to_first_token)
        if out.total_time is not None:
            self.e2e.observe(out.total_time)
        ts = out.timestamps or []
        for a, b in zip(ts, ts[1:]):
            self.itl.observe(b - a)

    def render(self, stats: Any) -> bytes:
        if stats is not None:
            self.running.set(stats.running)
            self.waiting.set(stats.waiting)
            self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
            self.prefix_hit_rate.set(stats.prefix_hit_rate)
        return bytes(generate_latest(self.registry))
