"""`tandem top`'s view, from Admin answers built here (the live terminal test is tests/e2e/test_top.py): hit
rates from the engines' progress counters, an instance that vanished shown GONE, how long each has been registered
(UP), TTFT objective attainment and the queue per tier, P/D legs in flight per role, recent decisions with their
candidates' scores, and an unreachable Admin named instead of a crash."""

from __future__ import annotations

import io
import time

import grpc
from rich.console import Console

from mesh.top import History, Sample, hit_rate, render, run
from tandem.v1 import admin_pb2, common_pb2


def status(iid: str, hits: int, prompts: int, role=common_pb2.ROLE_HYBRID, model="m", inflight=0, health=2):
    s = admin_pb2.InstanceStatus(health=health, inflight_requests=inflight, prefill_tokens=7 * inflight)
    s.instance.instance_id, s.instance.model, s.instance.role, s.instance.node_id = iid, model, role, "n1"
    s.load.running_requests = inflight
    s.load.progress.add(dp_rank=0, prompt_tokens_total=prompts, prefix_cache_hits_total=hits)
    return s


def text(history: History, error: str | None = None) -> str:
    out = io.StringIO()
    Console(file=out, width=220, color_system=None).print(render(history, "127.0.0.1:9000", error))
    return out.getvalue()


def test_hit_rate_is_the_growth_of_hits_over_prompt_tokens():
    assert hit_rate(None, status("a", 30, 100)) == 0.3
    assert hit_rate(status("a", 30, 100), status("a", 120, 200)) == 0.9
    assert hit_rate(status("a", 30, 100), status("a", 30, 100)) is None  # nothing computed meanwhile
    assert hit_rate(status("a", 30, 100), status("a", 5, 10)) is None  # the engine restarted


def test_the_screen_shows_instances_tiers_and_pd_legs_and_a_vanished_instance():
    stats = admin_pb2.GetStatsResponse(policy="kv_affinity", requests_routed=12)
    stats.ttft_slo.add(tier="default", ttft_slo_seconds=2.0, measured=8, within_slo=6)
    stats.queues.add(tier="flex", tenant="", queued_now=3, shed_saturated=2, shed_expired=1)
    stats.sizing.add(model="pd", prefill_utilisation=0.9, decode_utilisation=0.2, prefill_instances=1,
                     decode_instances=1, suggested_prefill_instances=2, suggested_decode_instances=1)  # fmt: skip
    history = History()
    first = [status("a", 0, 0), status("b", 0, 0), status("p0", 0, 0, common_pb2.ROLE_PREFILL, "pd")]
    history.add(Sample(0.0, first, stats))
    now = [
        status("a", 80, 100, inflight=2),
        status("p0", 0, 50, common_pb2.ROLE_PREFILL, "pd", inflight=3),
        status("d0", 0, 0, common_pb2.ROLE_DECODE, "pd", inflight=1, health=3),
    ]
    decision = admin_pb2.Decision(
        request_id="tdm-abc",
        model="m",
        policy="kv_affinity",
        stage="aggregated",
        chosen=["a"],
        prompt_tokens=300,
    )
    decision.decided_at.FromSeconds(1_700_000_000)
    decision.candidates.add(instance_id="a", matched_npu_tokens=256, matched_cpu_tokens=16, prefill_tokens=44,
                            predicted_ttft_seconds=0.012, chosen=True)  # fmt: skip
    decision.candidates.add(instance_id="b", prefill_tokens=900, predicted_ttft_seconds=1.5)
    history.add(Sample(1.0, now, stats, [decision]))
    screen = text(history)
    lines = {line.split()[1]: line for line in screen.splitlines() if line.startswith("│")}
    assert "HEALTHY" in lines["a"] and "80%" in lines["a"] and " 14 " in lines["a"]  # queued prefill 7 * 2
    assert "GONE" in lines["b"]
    assert "UNHEALTHY" in lines["d0"]
    assert "policy kv_affinity" in screen and "routed 12" in screen
    default = next(line for line in screen.splitlines() if "default" in line)
    assert "2s" in default and "75%" in default  # 6 of 8 within the objective
    flex = next(line for line in screen.splitlines() if "flex" in line)
    assert flex.split("│")[-3].strip() == "3" and flex.split("│")[-2].strip() == "3"  # waiting, shed
    pd = next(
        line for line in screen.splitlines() if line.startswith("│") and " pd " in line and "0.90" in line
    )
    assert [c.strip() for c in pd.split("│")[1:-1]] == ["pd", "3", "1", "0.90", "0.20", "1:1", "2:1"]
    assert "recent decisions" in screen
    assert lines["a"].split("│")[-2].strip() == "-"  # no registration time known: no UP
    row = next(line for line in screen.splitlines() if "tdm-abc" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[1:] == ["tdm-abc", "m", "kv_affinity", "aggregated", "a", "300", "272", "44", "12ms",
                         "b 0/900/1.50s"]  # fmt: skip


def test_a_coordinator_without_list_decisions_is_named_not_fatal():
    history = History()
    history.add(Sample(0.0, [status("a", 0, 0)], admin_pb2.GetStatsResponse(), None))
    screen = text(history)
    assert "does not serve Admin/ListDecisions" in screen and "HEALTHY" in screen


def test_once_names_an_unreachable_admin_and_fails():
    out = io.StringIO()
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        code = run(channel, "127.0.0.1:1", once=True, console=Console(file=out, width=200, color_system=None))
    assert code == 1
    assert "Admin unreachable: UNAVAILABLE" in out.getvalue()


def test_up_is_the_time_since_registration_so_a_quick_restart_shows():
    history = History()
    old, restarted = status("a", 0, 0), status("b", 0, 0)
    old.registered_at.FromSeconds(int(time.time()) - 2 * 3600 - 5)
    restarted.registered_at.FromSeconds(int(time.time()) - 3)
    history.add(Sample(0.0, [old, restarted], admin_pb2.GetStatsResponse()))
    lines = {line.split()[1]: line for line in text(history).splitlines() if line.startswith("│")}
    assert lines["a"].split("│")[-2].strip() == "2h"
    assert lines["b"].split("│")[-2].strip() in {"3s", "4s"}
