"""The coordinator's recent routing decisions, for the operator (`Admin/ListDecisions`, the decisions panel of
`tandem top`): a bounded ring of the last N scorings, newest first when read.

Cheap when nobody asks: the decision path appends one plain tuple holding references it already has (the frozen
`Candidate`s the policy was given, the chosen ids) to a `deque` with a `maxlen`; nothing is formatted or computed
there, and the tuple becomes a `Decision` only when read. Each candidate's score components are computed when
Admin lists them, by `components`, the same function that fills the `tandem.score` trace span's attributes
(`coordinator.picker.candidate_attributes`): what an operator reads in `tandem top` is what a sampled trace shows.

Pure: no I/O, no clock of its own (the caller gives the time).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from coordinator.scheduling import Candidate
from coordinator.scheduling.pd_joint import prefill_s


class Components(NamedTuple):
    """One candidate's score components as its policy saw them (the `tandem.candidate.<id>.<field>` span
    attributes carry the same fields)."""

    matched_npu_tokens: int  # prompt tokens found cached in its NPU memory (conductor and predicted cache)
    matched_cpu_tokens: int  # ... in its CPU offload tier
    matched_disk_tokens: int  # ... on its disk tier
    prefill_tokens: int  # prompt tokens committed to prefill on it and not yet computed
    decode_tokens: int  # output tokens committed to decode on it
    inflight: int  # requests in flight on it through this coordinator
    predicted_ttft_s: float  # predicted time until it computed this prompt, its queue included


def components(c: Candidate, isl: int) -> Components:
    """`c`'s score components for a prompt of `isl` tokens."""
    m = c.match
    return Components(
        m.npu_blocks * m.block_size,
        m.cpu_blocks * m.block_size,
        m.disk_blocks * m.block_size,
        c.prefill_tokens,
        c.decode_tokens,
        c.inflight,
        prefill_s(c, isl),
    )


class Decision(NamedTuple):
    """One scoring: which policy chose what among which candidates, for which request. The decision path records
    a plain tuple of these fields in this order (`DecisionLog.record`): a named tuple or a dataclass cost 0.4-2 µs
    more to build there."""

    at: float  # wall-clock seconds (`time.time()`) when it was decided
    request_id: str  # the coordinator's id of the request (`tdm-...`), as in its logs and trace spans
    model: str
    policy: str  # the policy's name (`pd_joint` for a joint P/D choice)
    #: What was chosen: `aggregated` (the serving instance), `decode` (a P/D request's decode instance), `prefill`
    #: (a prefill attempt's instance) or `pair` (a joint P/D choice: prefill and decode, or decode alone).
    stage: str
    isl: int  # the request's prompt tokens (the predicted TTFT of each candidate is for this many)
    candidates: Sequence[Candidate]  # every candidate scored, as the policy saw it (frozen)
    chosen: tuple[str, ...]  # the chosen instance ids (a pair: prefill first, then decode)
    predicted_ttft_s: float | None = None  # a joint choice's predicted TTFT for the pair; None otherwise


class DecisionLog:
    """The last `capacity` decisions (`coordinator.recent_decisions`; 0: none kept, `record` does nothing)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._ring: deque[tuple] = deque(maxlen=capacity)
        self.recorded = 0  # decisions recorded since start (kept or since pushed out)

    def record(self, entry: tuple) -> None:
        """Keeps one decision, the fields of `Decision` in order, pushing out the oldest when full."""
        if self.capacity:
            self._ring.append(entry)
            self.recorded += 1

    def recent(self, limit: int = 0, model: str = "") -> list[Decision]:
        """The newest `limit` decisions (every one kept when 0), newest first; of `model` only when given."""
        out: list[Decision] = []
        for entry in reversed(self._ring):
            d = Decision._make(entry)
            if model and d.model != model:
                continue
            out.append(d)
            if limit and len(out) >= limit:
                break
        return out
