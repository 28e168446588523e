"""Prometheus metrics of the conductor, read from the live state at scrape time (no double bookkeeping)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from conductor.ingest import IngestCore


class ConductorCollector(Collector):
    """`tandem_conductor_*` gauges and counters from an `IngestCore` (and optional extra counters)."""

    def __init__(self, core: IngestCore, extra: Callable[[], dict[str, int]] | None = None) -> None:
        self.core = core
        self.extra = extra

    def collect(self) -> Iterable:
        s = self.core.stats()
        blocks = GaugeMetricFamily(
            "tandem_conductor_blocks", "Indexed (block, holder) entries per medium", labels=["medium"]
        )
        blocks.add_metric(["npu"], s.npu_blocks)
        blocks.add_metric(["cpu"], s.cpu_blocks)
        blocks.add_metric(["disk"], s.disk_blocks)
        yield blocks
        gauges = {
            "instances": ("Instances with at least one indexed block", s.instances),
            "holders": ("Engine ranks known to the index", s.holders),
            "entries": ("(block, holder) entries, the unit of max_entries", s.entries),
            "index_bytes": ("Approximate memory held by the index", s.index_bytes),
            "events_per_second": (
                "Events ingested per second over the last ten seconds",
                s.events_per_second,
            ),
            "max_event_lag_seconds": (
                "Largest engine-to-ingest delay over the last ten seconds",
                s.max_event_lag_seconds,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"tandem_conductor_{name}", doc, value=value)
        counters = {
            "events": ("Events ingested", s.events_total),
            "batches": ("Batches ingested", s.batches_total),
            "gaps": ("Sequence gaps seen", s.gaps),
            "replays": ("Replays asked for", s.replays),
            "replays_recovered": ("Replays that closed their gap", s.recovered),
            "clears": ("Engine ranks cleared because events were lost", s.clears),
            "engine_restarts": ("Engine restarts seen (sequence went back)", s.restarts),
            "evicted_entries": ("Entries dropped by the memory bound", s.evicted_entries),
            "rejected_entries": ("New entries refused by the memory bound", s.rejected_entries),
            "orphan_blocks": ("Stored blocks whose parent block was unknown", s.orphan_blocks),
            "unresolved_blocks": (
                "Token-less stores or removals of unknown engine hashes",
                s.unresolved_blocks,
            ),
        }
        for name, value in (self.extra() if self.extra else {}).items():
            counters[name] = (name.replace("_", " ").capitalize(), value)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"tandem_conductor_{name}", doc, value=value)


def register(core: IngestCore, extra=None, registry: CollectorRegistry = REGISTRY) -> ConductorCollector:
    """Registers the collector (once per process in production; tests pass their own registry)."""
    collector = ConductorCollector(core, extra)
    registry.register(collector)
    return collector
