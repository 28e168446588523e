"""Prometheus metrics under vLLM's names and labels (`model_name`, `engine`), in a registry of their own.

vLLM-only concepts the simulator adds are prefixed `simengine:` so they never shadow a real vLLM series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineMetrics:
    """Every series the simulated engine exports, pre-bound to its labels so updates are cheap."""

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        labels = ("model_name", "engine")
        lv = (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="all").labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(*lv)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution."
        )
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting.")
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector, in tokens.",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector, in tokens."
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            (*labels, "source"),
            registry=r,
        )
        self.prompt_local_compute = by_source.labels(*lv, "local_compute")
        self.prompt_local_cache_hit = by_source.labels(*lv, "local_cache_hit")
        self.prompt_external_kv_transfer = by_source.labels(*lv, "external_kv_transfer")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.success = {
            reason: success.labels(*lv, reason) for reason in ("stop", "length", "abort", "error")
        }
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E_BUCKETS
        )
        self.kv_transfer_tokens = counter(
            "simengine:kv_transfer_tokens", "Prompt tokens whose KV arrived from a remote engine (P/D)."
        )
        self.kv_transfer_bytes = counter(
            "simengine:kv_transfer_bytes", "Bytes of simulated KV moved over TCP (P/D)."
        )
        self.kv_transfer_fallbacks = counter(
            "simengine:kv_transfer_fallbacks",
            "Decode requests that computed their prompt locally because the KV params were invalid or the pull failed.",
        )
        self.kv_transfer_failures = counter(
            "simengine:kv_transfer_failures", "Remote KV transfers that failed or timed out (P/D)."
        )
        self.callbacks_sent = counter(
            "simengine:metaserver_callbacks", "Metaserver callback POSTs sent (trigger mode)."
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
