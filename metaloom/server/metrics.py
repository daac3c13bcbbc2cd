"""Prometheus metrics of one server (its own registry, so two apps in one process never mix)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: a 135M model's first token on 2 cores is ~10-100 ms, a long strategy minutes
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("metaloom_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("metaloom_prompt_tokens", "prompt tokens charged (cached ones included)", registry=r)
        self.cached_tokens = Counter("metaloom_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("metaloom_completion_tokens", "generated tokens", registry=r)
        self.queue_depth = Gauge("metaloom_queue_depth", "requests waiting to join the decode loop", registry=r)
        self.running = Gauge("metaloom_running_rows", "rows admitted to the decode loop (those being prefilled and "
                             "beams searching included)", registry=r)
        self.prefilling = Gauge("metaloom_prefilling_rows", "rows admitted and being prefilled now", registry=r)
        self.preemptions = Gauge("metaloom_preemptions", "requests whose rows were taken out for want of KV memory "
                                 "(recomputed when admitted again), since the start", registry=r)
        self.batch_size = Histogram("metaloom_batch_size", "rows per decode step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.ttft = Histogram("metaloom_time_to_first_token_seconds", "time to first token", registry=r, buckets=_BUCKETS)
        self.memory = Gauge("metaloom_memory_bytes", "memory by part: weights, kv_pool (allocated), kv_pool_used, "
                            "kv_pool_limit, prefix_cache (part of kv_pool_used), process_rss", ["part"], registry=r)
        self.latency = Histogram("metaloom_request_latency_seconds", "time from request to last byte", ["route"],
                                 registry=r, buckets=_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)
