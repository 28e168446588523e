"""Failing KV links in P/D (pure): which (prefill, decode) pairs to avoid for a while, learnt from the decode
engines' failed-transfer counters.

A decode engine whose pull of a prompt's KV fails computes the prompt itself (vLLM's NixlConnector, whose default
`kv_load_failure_policy` is `recompute`): the request is answered, but the prefill leg's work and the transfer's
wait are lost, and a broken link fails every request sent over it. vLLM counts a decode engine's pulls, those that
succeeded (`vllm:nixl_bytes_transferred_count`) and those that failed (`vllm:nixl_num_failed_transfers_total`), without
naming the prefill engine; heartbeats relay both (`InstanceLoad.kv_transfers_total`, `kv_transfer_failures_total`).
The coordinator attributes them: it remembers, per decode instance, the prefill instances of the pairs it sent
there, oldest first; when the counters of that instance rise by `ok` and `failed`, the `ok + failed` oldest
transfers have ended (they end about in the order they start), and if `failed` > 0 the pairs among them are blamed:
each is avoided for `cooldown_s`, then tried again (a link that still fails is blamed again at its next failure).
A transfer that no rise accounted for within `settle_s` is taken as done.

The attribution is exact when the transfers that ended between two heartbeats (0.25 s apart by default) came from
one prefill instance; when a failing and a healthy prefill instance fed the same decode instance within that time,
both pairs are blamed (the healthy one is avoided for one cooldown for nothing).

`LinkHealth` is used by `coordinator.scheduling.pd_joint`: `sent` when a pair's prefill leg goes out, `observe` with
each decode candidate's counter when a choice is made, `avoided` to leave a blamed pair out while another choice
exists.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: How long a pair blamed for a failed transfer is left out of the choice.
COOLDOWN_S = 30.0
#: A transfer that no rise of its decode instance's counter claimed within this long is taken as done.
SETTLE_S = 10.0


@dataclass(slots=True)
class LinkHealth:
    """See the module docstring."""

    cooldown_s: float = COOLDOWN_S
    settle_s: float = SETTLE_S
    #: Per decode instance, its transfers not yet taken as done: (sent at, prefill instance), oldest first.
    pending: dict[str, deque[tuple[float, str]]] = field(default_factory=dict)
    #: Per decode instance, its (succeeded, failed) transfer counters as last observed (the next rise's baseline).
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: (prefill, decode) -> until when the pair is avoided.
    blamed: dict[tuple[str, str], float] = field(default_factory=dict)

    def sent(self, prefill: str, decode: str, now: float) -> None:
        """A prefill leg went to `prefill` whose KV `decode` will pull."""
        queue = self.pending.setdefault(decode, deque())
        self._settle(queue, now)
        queue.append((now, prefill))

    def observe(self, decode: str, ok_total: int, failed_total: int, now: float) -> list[tuple[str, str]]:
        """`decode`'s transfer counters read `ok_total` and `failed_total`: the transfers that ended since the last
        reading are taken off its pending ones, and their pairs blamed if any failed; returns the pairs newly
        blamed. The first reading, or one lower than the last (the engine restarted), is a baseline."""
        last = self.seen.get(decode)
        self.seen[decode] = (ok_total, failed_total)
        if last is None or ok_total < last[0] or failed_total < last[1]:
            return []
        ended, failed = ok_total - last[0] + failed_total - last[1], failed_total - last[1]
        queue = self.pending.get(decode)
        if not ended or not queue:
            return []
        self._settle(queue, now)
        done = [queue.popleft()[1] for _ in range(min(ended, len(queue)))]
        if not failed:
            return []
        newly = []
        for prefill in dict.fromkeys(done):  # each pair once, in order
            pair = (prefill, decode)
            if self.blamed.get(pair, 0.0) <= now:
                newly.append(pair)
            self.blamed[pair] = now + self.cooldown_s
        return newly

    def avoided(self, prefill: str, decode: str, now: float) -> bool:
        """True while the pair is blamed for a failed transfer."""
        return self.blamed.get((prefill, decode), 0.0) > now

    def _settle(self, queue: deque[tuple[float, str]], now: float) -> None:
        while queue and now - queue[0][0] > self.settle_s:
            queue.popleft()
