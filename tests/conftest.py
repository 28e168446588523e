"""Tests mirror the source tree; shared helpers live in `bench.harness` (benchmarks use them too)."""
