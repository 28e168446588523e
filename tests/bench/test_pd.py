import math

from bench.pd import histogram_quantile

INF = float("inf")


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 100.0), (INF, 100.0)]
    assert histogram_quantile(buckets, 0.5) == 0.002
    assert histogram_quantile(buckets, 0.75) == 0.003
    assert histogram_quantile(buckets, 0.25) == 0.0015


def test_histogram_quantile_edge_cases():
    assert math.isnan(histogram_quantile([(0.001, 0.0), (INF, 0.0)], 0.5))  # no observations
    assert histogram_quantile([(0.001, 1.0), (INF, 2.0)], 0.99) == 0.001  # beyond the last finite bound
