"""The real-engine example layouts load and give the commands their comments promise."""

from __future__ import annotations

from mesh.config import load_mesh_config
from node_agent.launch import Placement, build_launch
from tests.helpers import ROOT

EXAMPLES = ROOT / "examples"


def test_ascend_pd_example():
    mesh = load_mesh_config(EXAMPLES / "ascend-pd-mooncake.yaml")
    (prefill,) = mesh.node_agent("npu-p0").engines
    specs = build_launch(prefill, "/run/tandem")
    assert [s.name for s in specs] == ["prefill-a-dp0", "prefill-a-dp1"]
    assert specs[1].env["ASCEND_RT_VISIBLE_DEVICES"] == "8,9,10,11,12,13,14,15"
    (second,) = mesh.node_agent("npu-d1").engines
    specs = build_launch(second, "/run/tandem")
    assert [s.name for s in specs][:2] == ["decode-a-dp8", "decode-a-dp9"] and len(specs) == 8
    assert [s.port for s in specs] == list(range(7200, 7208))
    rank8 = specs[0].argv
    assert rank8[rank8.index("--data-parallel-rank") + 1] == "8"
    assert rank8[rank8.index("--data-parallel-address") + 1] == "10.0.0.12"
    assert [s.kv_events[0].endpoint for s in specs][:1] == ["tcp://127.0.0.1:5608"]


def test_cross_node_pp_example_takes_rank_and_address_at_run_time():
    mesh = load_mesh_config(EXAMPLES / "ascend-pp-cross-node.yaml")
    for node, rank in (("npu-pp0", 0), ("npu-pp1", 1)):
        (engine,) = mesh.node_agent(node).engines
        assert engine.node_rank is None and engine.master_addr is None
        (spec,) = build_launch(engine, "/run/tandem", Placement(rank, "10.0.0.21"))
        assert spec.headless == bool(rank) and spec.argv[spec.argv.index("--node-rank") + 1] == str(rank)
