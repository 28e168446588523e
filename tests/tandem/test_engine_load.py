from tandem.engine_load import parse_load

METRICS = """
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 300.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
vllm:generation_tokens_total{engine="1",model_name="m"} 7.0
"""


def test_progress_counters_per_rank():
    load = parse_load(METRICS)
    assert load.running == 3
    assert load.progress == {0: (1200, 40), 1: (300, 7)}


def test_no_counters_no_progress():
    assert parse_load('vllm:num_requests_waiting{engine="0"} 4.0\n').progress == {}


def test_kv_capacity_from_the_cache_config_info():
    """GPU plus CPU blocks per rank (the conductor bounds a rank's indexed blocks by it); "None" counts 0."""
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{engine="0",num_gpu_blocks="1000",num_cpu_blocks="None"} 1.0\n'
        'vllm:cache_config_info{engine="1",num_gpu_blocks="1000",num_cpu_blocks="500"} 1.0\n'
    )
    assert parse_load(text).kv_blocks == 1500
    assert parse_load("").kv_blocks == 0


def test_prefix_cache_hits_per_rank():
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0\n'
    )
    assert parse_load(text).prefix_hits == {0: 640, 1: 32}
    assert parse_load("").prefix_hits == {}


def reference_load(text: str) -> tuple:
    """The same figures read with prometheus_client's full parser (the scanner's oracle)."""
    from prometheus_client.parser import text_string_to_metric_families

    running = waiting = blocks = 0
    usage: list[float] = []
    progress: dict[int, list[int]] = {}
    hits: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            rank = int(s.labels.get("engine", "0"))
            if s.name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
                progress.setdefault(rank, [0, 0])[s.name == "vllm:generation_tokens_total"] += int(s.value)
            elif s.name == "vllm:prefix_cache_hits_total":
                hits[rank] = hits.get(rank, 0) + int(s.value)
            elif s.name == "vllm:num_requests_running":
                running += int(s.value)
            elif s.name == "vllm:num_requests_waiting":
                waiting += int(s.value)
            elif s.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage.append(s.value)
            elif s.name == "vllm:cache_config_info":
                counts = [s.labels.get(k, "0") for k in ("num_gpu_blocks", "num_cpu_blocks")]
                blocks = max(blocks, sum(int(c) if c.isdigit() else 0 for c in counts))
    return running, waiting, max(usage, default=0.0), {r: tuple(v) for r, v in progress.items()}, hits, blocks


def scanned(text: str) -> tuple:
    load = parse_load(text)
    return load.running, load.waiting, load.kv_cache_usage, load.progress, load.prefix_hits, load.kv_blocks


def simengine_page() -> str:
    """A busy simengine's whole /metrics page (vLLM's series, histograms, process and GC collectors)."""
    from prometheus_client import generate_latest

    from simengine.metrics import EngineMetrics

    m = EngineMetrics("tandem-sim", engine="1")
    m.num_requests_running.set(3)
    m.num_requests_waiting.set(2)
    for counter in (m.prompt_tokens, m.generation_tokens, m.prefix_cache_hits):
        counter.inc(1234)
    return generate_latest(m.registry).decode()


def test_the_scanner_reads_what_prometheus_clients_parser_reads():
    page = simengine_page()
    assert "vllm:num_requests_running" in page and "_bucket{" in page  # a whole page, histograms and all
    odd = (
        '# HELP vllm:num_requests_running with "quotes" and {braces}\n'
        'vllm:num_requests_running{model_name="a \\"b\\", c",engine="0"} 4.0\n'
        "vllm:num_requests_waiting 7 1712000000000\n"  # no labels, a timestamp
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:gpu_cache_usage_perc{engine="1"} 0.5\n'
        'vllm:num_requests_running_by_reason{engine="0"} 9.0\n'  # a longer name sharing the prefix
        'vllm:prompt_tokens_total{engine="2"} 1e3\n'
    )
    for text in (METRICS, page, odd, ""):
        assert scanned(text) == reference_load(text), text[:200]
    assert scanned(odd)[:3] == (4, 7, 0.5)


def test_a_nixl_decode_engines_transfers_from_simengines_page():
    """vLLM's NixlConnector series as simengine exports them: pulls that succeeded (the bytes histogram's count)
    and pulls that failed, summed over ranks."""
    from prometheus_client import generate_latest

    from simengine.metrics import EngineMetrics

    m = EngineMetrics("m", engine="0")
    assert parse_load(generate_latest(m.registry).decode()).kv_transfers == 0  # not a NIXL engine: absent
    m.enable_nixl()
    for nbytes in (4096, 1 << 20):
        m.nixl_bytes_transferred.observe(nbytes)
    m.nixl_failed_transfers.inc()
    load = parse_load(generate_latest(m.registry).decode())
    assert (load.kv_transfers, load.kv_transfer_failures) == (2, 1)
