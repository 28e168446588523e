from bench.sglang_parity import agreement, model_decisions
from coordinator.scheduling.sglang_cache_aware import Params

DOC = list(range(1000, 1064))  # 4 blocks of 16 tokens


def test_agreement_counts_decisions_under_the_best_relabelling():
    assert agreement([0, 0, 1, 2], [3, 3, 0, 1]) == (4, (3, 0, 1, 2))
    assert agreement([0, 1, 0, 1], [2, 2, 2, 2])[0] == 2


def test_model_replays_the_routers_in_flight_counts():
    # Distinct prompts, two held open: each goes to a least-loaded engine; a prompt sharing a held one's document
    # follows it, however loaded its holder.
    prompts = [[i] * 64 for i in range(4)] + [DOC, DOC + [7] * 16]
    assert model_decisions(prompts, 2, Params()) == [0, 1, 0, 1, 0, 0]
    assert model_decisions(prompts, 1, Params()) == [0, 0, 0, 0, 0, 0]
