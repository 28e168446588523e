"""Prometheus metrics under vLLM's names and labels (`model_name`, `engine`), in a registry of their own.

vLLM-only concepts the simulator adds are prefixed `simengine:` so they never shadow a real vLLM series."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # fmt: skip
_REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                         240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
#: vLLM's finish reasons (`request_success_total{finished_reason}`); "repetition" is its repetition detector's.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """vLLM's `build_1_2_5_buckets(max_model_len)`: 1, 2, 5, 10, 20, 50, ... up to the limit."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exp
            if value > limit:
                return tuple(out)
            out.append(value)
        exp += 1


_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineMetrics:
    """Every series the simulated engine exports, pre-bound to its labels so updates are cheap."""

    def __init__(self, model_name: str, engine: str = "0", max_model_len: int = 32768) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        # The process, platform and GC series vLLM's default registry has.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        labels = ("model_name", "engine")
        lv = (model_name, engine)
        #: This engine's label values, for labelled families with further labels.
        self.label_values = lv
        self._engine = engine
        self.lora_info: Gauge | None = None
        self._max_lora = ""

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="all").labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets).labels(*lv)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.",
            (*labels, "reason"),
            registry=r,
            multiprocess_mode="all",
        )
        self.waiting_capacity = by_reason.labels(*lv, "capacity")
        #: Waiting for remote KV (P/D) counts as deferred, as vLLM's WAITING_FOR_REMOTE_KVS.
        self.waiting_deferred = by_reason.labels(*lv, "deferred")
        sleep = Gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
                      "means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
                      "level 2.", (*labels, "sleep_state"), registry=r, multiprocess_mode="all")  # fmt: skip
        sleep.labels(*lv, "awake").set(1)
        sleep.labels(*lv, "weights_offloaded").set(0)
        sleep.labels(*lv, "discard_all").set(0)
        rejections = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, "
                             "by reason.", ("model_name", "reason"), registry=r)  # fmt: skip
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejections.labels(model_name, reason)
        for name, doc in (
            ("flops", "Estimated number of floating point operations per GPU"),
            ("read_bytes", "Estimated number of bytes read from memory per GPU"),
            ("write_bytes", "Estimated number of bytes written to memory per GPU"),
        ):
            counter(f"vllm:estimated_{name}_per_gpu", f"{doc} (for Model Flops Utilization calculations).")
        counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
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
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            (*labels, "source"),
            registry=r,
        )
        self.cached_by_source = {
            source: cached_by_source.labels(*lv, source)
            for source in ("device", "host", "p2p", "disk", "external_unspecified")
        }
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
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
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITERATION_BUCKETS,
        )
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            _PREEMPTION_BUCKETS,
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_TIME_BUCKETS,
        )
        self.kv_transfer_tokens = counter(
            "simengine:kv_transfer_tokens", "Prompt tokens whose KV arrived from a remote engine (P/D)."
        )
        self.kv_transfer_bytes = counter(
            "simengine:kv_transfer_bytes", "Bytes of simulated KV moved over TCP (P/D)."
        )
        #: By the other engine's KV host (`peer`), counted once per transfer by the engine that starts it (the
        #: decode engine pulling, the prefill engine pushing): bytes across hosts are those whose `peer` is not this
        #: engine's own KV host (`kv_ip`).
        self.kv_transfer_peer_bytes = Counter(
            "simengine:kv_transfer_peer_bytes",
            "Bytes of simulated KV this engine pulled or pushed over TCP (P/D), by the peer engine's KV host.",
            [*labels, "peer"],
            registry=r,
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
        self._counter, self._histogram = counter, histogram
        self.nixl_failed_transfers: Counter | None = None
        self.nixl_bytes_transferred: Histogram | None = None

    def enable_nixl(self) -> None:
        """Two of vLLM's NixlConnector series (its `NixlPromMetrics`, per engine like every series here), for an
        engine running `NixlConnector`: the bytes of each KV pull that succeeded, `vllm:nixl_bytes_transferred`
        (a histogram: its `_count` counts those pulls), and the pulls that failed, `vllm:nixl_num_failed_transfers`."""
        if self.nixl_failed_transfers is None:
            self.nixl_failed_transfers = self._counter(
                "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers."
            )
            self.nixl_bytes_transferred = self._histogram(
                "vllm:nixl_bytes_transferred",
                "Histogram of bytes transferred per NIXL KV Cache transfers.",
                tuple(float(4**i) for i in range(5, 16)),
            )

    def set_cache_config(self, cfg) -> None:
        """`vllm:cache_config_info`: vLLM's CacheConfig as labels of a constant 1 (labels `engine` + config)."""
        info = {
            "_block_size_resolved": "True",
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(cfg.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(round(cfg.npu_blocks * cfg.block_size / cfg.max_model_len, 2)),
            "kv_cache_memory_bytes": "None",
            "kv_cache_size_tokens": str(cfg.npu_blocks * cfg.block_size),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "float32",
            "num_cpu_blocks": str(cfg.cpu_blocks) if cfg.cpu_blocks else "None",
            "num_gpu_blocks": str(cfg.npu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": cfg.prefix_caching_hash_algo,
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "True",
        }
        gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", ("engine", *info),
                      registry=self.registry, multiprocess_mode="mostrecent")  # fmt: skip
        gauge.labels(self._engine, *info.values()).set(1)

    def enable_lora(self, max_loras: int) -> None:
        """`vllm:lora_requests_info`, which vLLM exports only with `--enable-lora`: a gauge set to the wall clock at
        each stats update, labelled with `max_lora` and the comma-joined names of the adapters that have requests
        in flight. vLLM fills `running_lora_adapters` and `waiting_lora_adapters` from the keys of one map, so both
        name the same adapters; every combination seen stays as its own series."""
        self._max_lora = str(max_loras)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                               registry=self.registry, multiprocess_mode="sum")  # fmt: skip

    def set_lora_info(self, adapters: str, now: float) -> None:
        if self.lora_info is not None:
            self.lora_info.labels(self._max_lora, adapters, adapters).set(now)

    def render(self) -> bytes:
        return generate_latest(self.registry)
