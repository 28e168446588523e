"""Registry messages as the coordinator's dataclasses."""

from coordinator.convert import load_from_proto, status_to_proto
from coordinator.instances import InstanceInfo, InstanceState
from coordinator.workload import WorkloadLedger
from tandem.v1 import common_pb2


def test_a_heartbeats_load_carries_the_engines_adapters_and_slots():
    msg = common_pb2.InstanceLoad(running_requests=2, loaded_adapters=["sql", "chat"], max_loras=4)
    load = load_from_proto(msg)
    assert load.running == 2 and load.adapters == frozenset({"sql", "chat"}) and load.max_loras == 4
    assert load_from_proto(common_pb2.InstanceLoad()).adapters == frozenset()


def test_a_heartbeats_cache_size_reaches_the_sizing_and_admin():
    state = InstanceState(InstanceInfo("i0", "m", "127.0.0.1:1", "hybrid", "aggregated"))
    state.load = load_from_proto(common_pb2.InstanceLoad(kv_blocks=1024))
    assert state.load.kv_blocks == 1024
    assert status_to_proto(state, WorkloadLedger()).load.kv_blocks == 1024


def test_admin_shows_an_instances_adapters_and_slots():
    state = InstanceState(InstanceInfo("i0", "m", "127.0.0.1:1", "hybrid", "aggregated"))
    state.load = load_from_proto(common_pb2.InstanceLoad(loaded_adapters=["sql", "chat"], max_loras=2))
    status = status_to_proto(state, WorkloadLedger())
    assert list(status.load.loaded_adapters) == ["chat", "sql"] and status.load.max_loras == 2
