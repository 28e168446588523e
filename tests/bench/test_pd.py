import math
from argparse import Namespace

from bench.pd import DEFAULT_ROWS, ROWS, histogram_quantile, local_share, simulate_row, split_row

INF = float("inf")


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 100.0), (INF, 100.0)]
    assert histogram_quantile(buckets, 0.5) == 0.002
    assert histogram_quantile(buckets, 0.75) == 0.003
    assert histogram_quantile(buckets, 0.25) == 0.0015


def test_histogram_quantile_edge_cases():
    assert math.isnan(histogram_quantile([(0.001, 0.0), (INF, 0.0)], 0.5))  # no observations
    assert histogram_quantile([(0.001, 1.0), (INF, 2.0)], 0.99) == 0.001  # beyond the last finite bound


def _args(**kw) -> Namespace:
    base = dict(trace="conversation", requests=12, time_scale=1.0, speedup=2.5, max_input=4096, max_output=8,
                seed=0, prefill=1, decode=1)  # fmt: skip
    return Namespace(**{**base, **kw})


def test_rows_name_a_mode_and_a_choice_or_aggregated():
    assert split_row("aggregated") == (None, "aggregated")
    assert split_row("trigger joint") == ("trigger", "joint")
    assert set(DEFAULT_ROWS) <= set(ROWS)


def test_the_simulated_row_replays_every_request_of_the_slice_with_its_rule():
    aggregated = simulate_row("aggregated", _args(), 0.0)
    handoff = simulate_row("handoff separate", _args(), 0.0)
    assert len(aggregated.ttft_s) == len(handoff.ttft_s) == 12
    assert (
        aggregated.prefill == 0 and aggregated.bytes_intra_node == 0
    )  # every instance hybrid, nothing moved
    assert (
        handoff.prefill == 1 and handoff.bytes_intra_node > 0
    )  # one prefill instance, its KV moved to decode


def test_a_slower_trigger_callback_delays_the_simulated_first_tokens():
    fast = simulate_row("trigger separate", _args(), 0.0)
    slow = simulate_row("trigger separate", _args(), 0.2)  # 0.5 simulated s per callback at speedup 2.5
    assert slow.mean_ttft >= fast.mean_ttft + 0.4


def test_the_local_share_counts_the_coordinators_choices():
    assert local_share({"local": 3.0, "disaggregated": 9.0}) == 0.25
    assert local_share({"disaggregated": 4.0}) == 0.0
    assert math.isnan(local_share({}))  # `separate` counts no choice
