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
