"""Reading simulated (or real vLLM) engines' Prometheus metrics for benchmarks."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def engine_counters(address: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the named samples (all label sets) on one engine's `/metrics`."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


PREFIX = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def prefix_totals(addresses: list[str]) -> tuple[float, float]:
    """(queried tokens, hit tokens) summed over engines."""
    queries = hits = 0.0
    for address in addresses:
        c = engine_counters(address, PREFIX)
        queries += c[PREFIX[0]]
        hits += c[PREFIX[1]]
    return queries, hits
