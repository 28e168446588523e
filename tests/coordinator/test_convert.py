"""Registry messages as the coordinator's dataclasses."""

from coordinator.convert import load_from_proto
from tandem.v1 import common_pb2


def test_a_heartbeats_load_carries_the_engines_adapters_and_slots():
    msg = common_pb2.InstanceLoad(running_requests=2, loaded_adapters=["sql", "chat"], max_loras=4)
    load = load_from_proto(msg)
    assert load.running == 2 and load.adapters == frozenset({"sql", "chat"}) and load.max_loras == 4
    assert load_from_proto(common_pb2.InstanceLoad()).adapters == frozenset()
