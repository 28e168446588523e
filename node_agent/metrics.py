"""Prometheus metrics of the node agent, read from its supervisors and KV relay at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class AgentCollector:
    """`tandem_node_agent_*`: engine states, health and restarts; KV event relay counters."""

    def __init__(self, agent) -> None:
        self.agent = agent

    def collect(self):
        state = GaugeMetricFamily(
            "tandem_node_agent_process_state",
            "1 for the state each supervised process is in",
            labels=["instance", "state"],
        )
        up = GaugeMetricFamily("tandem_node_agent_engine_healthy", "1 while the process answers its health probe",
                               labels=["instance"])  # fmt: skip
        restarts = CounterMetricFamily("tandem_node_agent_restarts", "Restarts since the agent started",
                                       labels=["instance"])  # fmt: skip
        scrapes = CounterMetricFamily(
            "tandem_node_agent_engine_scrapes",
            "Reads of the engine's /metrics (load_interval_s while it works, idle_load_interval_s while idle)",
            labels=["instance"],
        )
        for name, sup in self.agent.supervisors.items():
            state.add_metric([name, sup.reported_state.name.lower()], 1)
            up.add_metric([name], 1 if sup.healthy else 0)
            restarts.add_metric([name], sup.restarts)
            if sup.base_url:
                scrapes.add_metric([name], sup.scrapes)
        relays = self.agent.relays
        yield state
        yield up
        yield restarts
        yield scrapes
        yield CounterMetricFamily("tandem_node_agent_kv_batches_relayed", "KV event batches sent to the conductor",
                                  value=sum(r.batches_sent for r in relays))  # fmt: skip
        yield CounterMetricFamily("tandem_node_agent_kv_messages", "Ingest messages sent (queued batches travel together)",
                                  value=sum(r.messages_sent for r in relays))  # fmt: skip
        yield CounterMetricFamily("tandem_node_agent_kv_batches_dropped", "KV event batches dropped on a full queue",
                                  value=sum(r.dropped for r in relays))  # fmt: skip
        yield CounterMetricFamily("tandem_node_agent_kv_decode_errors", "Engine KV event messages that did not decode",
                                  value=sum(r.decode_errors for r in relays))  # fmt: skip
