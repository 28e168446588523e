"""The decision-stall bench's thread pool stands in for the coordinator's UnderstandPool: same call."""

from __future__ import annotations

import inspect

from bench.decision_stall import ThreadUnderstand
from coordinator.understand_pool import UnderstandPool


def test_the_thread_pool_takes_the_calls_the_worker_pool_takes():
    pool = inspect.signature(UnderstandPool.understand).parameters
    thread = inspect.signature(ThreadUnderstand.understand).parameters
    assert list(thread) == list(pool)  # a new argument of the decision path's call reaches both
