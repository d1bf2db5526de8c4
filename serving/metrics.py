"""The worker's Prometheus metrics: queue depth, batch size, tokens, latencies, tier counters.

Each worker has its own registry (several workers may share a test process); the tier
counters are read from the residency plan at scrape time, so they are never out of step.
"""

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mint_core.planning.residency import Residency

if TYPE_CHECKING:
    from mint_core.catalog.catalog import Catalog
    from serving.engine.generation import Generating

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _TierCollector(Collector):
    def __init__(self, residency: Residency) -> None:
        self.residency = residency

    def collect(self) -> Iterator[Metric]:
        for event in ("hits", "misses", "loads", "evictions"):
            family = CounterMetricFamily(
                f"mint_tier_{event}", f"Residency tier {event} since start", labels=["tier"]
            )
            for tier, counters in self.residency.counters.items():
                family.add_metric([tier.value], getattr(counters, event))
            yield family
        resident = GaugeMetricFamily("mint_tier_resident", "Revisions resident", labels=["tier"])
        resident.add_metric(["host"], len(self.residency.host_table()))
        resident.add_metric(["device"], len(self.residency.slot_table()))
        yield resident
        yield GaugeMetricFamily(
            "mint_host_cache_bytes",
            "Bytes of adapter weights in the host cache",
            value=self.residency.host_bytes,
        )


class CatalogCollector(Collector):
    """The catalog's questions to the registry about names it had not seen, and the "not
    found" answers it gave from memory instead (`mint_core.catalog.absent`)."""

    def __init__(self, catalog: "Catalog") -> None:
        self.catalog = catalog

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "mint_registry_lookups",
            "Names not in the catalog that were asked of the registry",
            value=self.catalog.lookups,
        )
        yield CounterMetricFamily(
            "mint_registry_absent_answers",
            "Requests answered 'not found' from a recent registry answer, without asking it",
            value=self.catalog.absent_answers,
        )


class WorkerMetrics:
    def __init__(self, residency: Residency) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "mint_queue_depth", "Requests waiting to join the batch", registry=r
        )
        self.batch_size = Histogram(
            "mint_batch_size",
            "Rows in each decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.generated_tokens = Counter(
            "mint_generated_tokens", "Tokens generated, all requests", registry=r
        )
        self.tokens_per_second = Gauge(
            "mint_tokens_per_second", "Tokens per second of the last decode step", registry=r
        )
        self.requests = Counter(
            "mint_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.request_latency = Histogram(
            "mint_request_latency_seconds",
            "Submit to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "mint_time_to_first_token_seconds",
            "Submit to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.not_ready = Counter(
            "mint_not_ready_answers", "Requests answered 'not ready' at the gate", registry=r
        )
        self.demand_admissions = Counter(
            "mint_demand_admissions",
            "Revisions admitted because a request wanted them while they were ready nowhere",
            registry=r,
        )
        r.register(_TierCollector(residency))

    def first_token(self, request: "Generating") -> None:
        """`request` got its first token now."""
        request.first_token_at = time.perf_counter()
        self.time_to_first_token.observe(request.first_token_at - request.submitted)

    def finished(self, request: "Generating") -> None:
        """`request` ended (EOS, stop string or length)."""
        assert request.finish_reason is not None
        self.requests.labels(request.finish_reason.value).inc()
        self.request_latency.observe(time.perf_counter() - request.submitted)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
