"""Prometheus metrics of one server: request counters and histograms, plus engine state read at scrape time.

Label cardinality is bounded: `model` is a name the store knows (or "unknown"), and at most MAX_MODEL_LABELS
distinct names get their own series; the rest share "other".
"""

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

MAX_MODEL_LABELS = 256
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineCollector(Collector):
    """Cache hits/misses/evictions, residency per variant, queue depth: read from the engine when scraped."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        stats = self.engine.cache.stats
        events = CounterMetricFamily("manyfold_cache_events", "Variant cache lookups and evictions", labels=["event"])
        for event, value in (("hit", stats.hits), ("miss", stats.misses), ("eviction", stats.evictions)):
            events.add_metric([event], value)
        yield events
        resident = GaugeMetricFamily("manyfold_variant_resident", "1 where a variant's weights are held",
                                     labels=["model", "tier"])
        for info in self.engine.models()[:MAX_MODEL_LABELS]:
            for tier in ("device", "cpu", "disk"):
                resident.add_metric([info.name, tier], 1.0 if info.residency == tier else 0.0)
        yield resident
        used = GaugeMetricFamily("manyfold_cache_bytes", "Bytes of decoded variants per tier", labels=["tier"])
        for tier in ("device", "cpu"):
            used.add_metric([tier], self.engine.cache.used_bytes(tier))
        yield used
        yield GaugeMetricFamily("manyfold_queue_depth", "Rows waiting for the scheduler", value=self.engine.queue_depth)


class Metrics:
    def __init__(self, known_models: Callable[[], set[str]]):
        self.registry = CollectorRegistry()
        self._known = known_models
        self._labelled: set[str] = set()
        r = self.registry
        self.requests = Counter("manyfold_requests", "HTTP requests", ["model", "route", "status"], registry=r)
        self.tokens = Counter("manyfold_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.latency = Histogram("manyfold_request_latency_seconds", "Request latency", ["model", "route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.load_latency = Histogram("manyfold_variant_load_seconds", "Decode time of a cold variant", ["model"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("manyfold_batch_size", "Rows per scheduler step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)

    def attach(self, engine) -> None:
        self.registry.register(EngineCollector(engine))
        engine.cache.on_load = lambda name, s: self.load_latency.labels(self.model_label(name)).observe(s)
        engine.on_batch = self.batch_size.observe

    def model_label(self, name: str | None) -> str:
        if not name:
            return "none"
        if name in self._labelled:
            return name
        if name not in self._known():
            return "unknown"
        if len(self._labelled) >= MAX_MODEL_LABELS:
            return "other"
        self._labelled.add(name)
        return name

    def observe(self, model: str | None, route: str, status: int, started_s: float) -> None:
        label = self.model_label(model)
        self.requests.labels(label, route, str(status)).inc()
        self.latency.labels(label, route).observe(time.perf_counter() - started_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
