"""Prometheus metrics of one server, in a registry of its own (two apps in one process, as Ray
replicas or tests may have, never share or clash)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds. TTFT spans a queue wait and a prefill; a token is one decode step of the whole batch.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("bitnet_requests", "HTTP requests to the API by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("bitnet_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("bitnet_generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("bitnet_queue_depth", "Requests waiting for a sequence slot", registry=r)
        self.running = Gauge("bitnet_running_sequences", "Sequences in a slot (prefilling or decoding)",
                             registry=r)
        self.ttft = Histogram("bitnet_time_to_first_token_seconds", "From submission to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.token_latency = Histogram("bitnet_time_per_output_token_seconds",
                                       "Between consecutive tokens of one sequence", buckets=TOKEN_BUCKETS,
                                       registry=r)

    def watch(self, queue_depth: Callable[[], int], running: Callable[[], int]) -> None:
        """Read the scheduler's queue depth and running sequences at each scrape."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)

    def render(self) -> bytes:
        return generate_latest(self.registry)
