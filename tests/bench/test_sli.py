"""`bench.sli`'s reading of the coordinator (the bench itself runs in `make bench`): the per-instance figures from
`/metrics` text and the per-request pairing of `Admin/ListDecisions` with the engines' `cached_tokens`."""

from __future__ import annotations

from bench.sli import from_metrics, pair, predicted_hits, table
from tandem.v1 import admin_pb2

METRICS = """\
# TYPE tandem_coordinator_predicted_request_hit_tokens histogram
tandem_coordinator_predicted_request_hit_tokens_count{instance="sim-0",model="tandem-sim",tier="npu"} 4.0
tandem_coordinator_predicted_request_hit_tokens_sum{instance="sim-0",model="tandem-sim",tier="npu"} 96.0
tandem_coordinator_predicted_request_hit_tokens_count{instance="sim-0",model="tandem-sim",tier="cpu"} 4.0
tandem_coordinator_predicted_request_hit_tokens_count{instance="x",model="other",tier="npu"} 9.0
# TYPE tandem_coordinator_predicted_hit_tokens counter
tandem_coordinator_predicted_hit_tokens_total{instance="sim-0",model="tandem-sim"} 96.0
# TYPE tandem_coordinator_delivered_hit_tokens counter
tandem_coordinator_delivered_hit_tokens_total{instance="sim-0",model="tandem-sim"} 64.0
"""


def decision(rid: str, chosen: str, npu: int, cpu: int = 0, prompt: int = 100) -> admin_pb2.Decision:
    d = admin_pb2.Decision(request_id=rid, chosen=[chosen], prompt_tokens=prompt)
    d.candidates.add(instance_id=chosen, matched_npu_tokens=npu, matched_cpu_tokens=cpu, chosen=True)
    d.candidates.add(instance_id="other", matched_npu_tokens=999)
    return d


def test_metrics_give_requests_and_mean_predicted_and_delivered_per_instance():
    (row,) = from_metrics(METRICS).values()
    assert (row.instance, row.requests, row.predicted_tokens, row.delivered_tokens) == (
        "sim-0",
        4,
        96.0,
        64.0,
    )
    assert (row.mean(row.predicted_tokens), row.mean(row.delivered_tokens)) == (24.0, 16.0)


def test_each_answer_pairs_with_its_decision_by_the_minted_id():
    decisions = [
        decision("tdm-a", "sim-0", 32, 16),
        decision("tdm-b", "sim-0", 200),
        decision("tdm-c", "sim-1", 0),
    ]
    assert predicted_hits(decisions[1]) == ("sim-0", 100)  # capped at the prompt
    answers = [
        ("cmpl-tdm-a", {"prompt_tokens_details": {"cached_tokens": 48}}),  # exact
        ("cmpl-tdm-b", {"prompt_tokens_details": {"cached_tokens": 64}}),  # 36 fewer than predicted (100)
        ("cmpl-tdm-c", {"prompt_tokens_details": None}),  # nothing cached, nothing predicted
        ("cmpl-tdm-gone", {}),  # pushed out of the ring
    ]
    pairs, unpaired = pair(decisions, answers)
    assert pairs == {"sim-0": [(48, 48), (100, 64)], "sim-1": [(0, 0)]} and unpaired == 1
    rows = from_metrics(METRICS)
    rows["sim-0"].pairs = pairs["sim-0"]
    text = table(rows)
    assert "| `sim-0` | 4 | 24.0 | 16.0 | 2 | 74.0 | 56.0 | 18.0 | -18.0 | 50.0% |" in text
