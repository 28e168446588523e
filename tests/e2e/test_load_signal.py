"""The load signal through the whole mesh: a request's prefill leaves the ledger when the engine's counters show
its prefill done, while the request still streams and the rest of its workload stays committed."""

from __future__ import annotations

import httpx
import pytest

from tandem.v1 import admin_pb2
from tests.helpers import RunningMesh, mesh_config, wait_until

# ~2,000 prompt tokens and 300 output tokens at simulated real speed (ITL ~16 ms): the stream lasts seconds.
PROMPT = " ".join(f"word{i % 97}" for i in range(2000))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    running = RunningMesh(
        mesh_config(engines=1, engine_args=["--speedup", "1"], policy="kv_affinity"),
        tmp_path_factory.mktemp("signal"),
    )
    running.start()
    yield running
    if running.process.poll() is None:
        running.stop()


def stats(mesh) -> admin_pb2.InstanceWorkload:
    reply = mesh.admin().GetStats(admin_pb2.GetStatsRequest(), timeout=5)
    (only,) = reply.instances
    return only


def test_prefill_leaves_while_the_stream_still_decodes(mesh):
    body = {"model": "tandem-sim", "prompt": PROMPT, "max_tokens": 300, "stream": True}
    seen_prefill_done = None
    with httpx.stream("POST", mesh.http + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert first != "data: [DONE]"

        def prefill_left() -> admin_pb2.InstanceWorkload | None:
            s = stats(mesh)
            assert s.inflight_requests == 1, "the stream's workload must stay committed while it runs"
            return s if s.prefill_tokens == 0 else None

        seen_prefill_done = wait_until(prefill_left, 10, "prefill left the ledger during the stream")
        rest = [line for line in lines if line.startswith("data: ")]
    assert seen_prefill_done.decode_tokens > 0  # decode still committed (what is left of it)
    assert seen_prefill_done.decode_tokens < 300  # generated tokens left the ledger as well
    assert rest and rest[-1] == "data: [DONE]" and len(rest) > 10  # it was still streaming
    wait_until(lambda: stats(mesh).inflight_requests == 0, 10, "the request released")
    final = stats(mesh)
    assert (final.inflight_requests, final.prefill_tokens, final.decode_tokens) == (0, 0, 0)
