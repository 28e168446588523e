"""Predicted cache: prompts just routed to an instance count as cached there for a short while (pure core).

The conductor learns what an engine caches from the engine's KV events, which arrive only after the engine has
computed the blocks: a burst of requests sharing a new prefix would otherwise be scored as if nobody held it and
spread over the fleet, each computing the prefix again. The coordinator therefore records, per instance, the chain
hashes (`tandem.chain_hash`) of every prompt it routes there, and counts them as that instance's leading blocks
until the engine's events take over:

- confirmed: a conductor answer that shows the instance holding at least the predicted blocks drops the
  prediction (the index now knows);
- contradicted or never confirmed (evicted, engine restarted, request failed): the prediction expires after
  `lifetime_s`.

`overlay` merges predictions into the conductor's per-instance facts: an instance is credited with the longer of
the two leading runs, the extra predicted blocks counting as accelerator blocks (where a new prefill leaves them).
With `lifetime_s = inf` and no confirmation this is a router's own routing-history tree (SGLang's router inserts
every routed prompt into its per-worker tree at routing time); `max_entries` then bounds it (oldest first out).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from coordinator.kv_facts import NO_MATCH, KvMatch


class PredictedCache:
    """Routed prompts' block hashes per instance, with an expiry."""

    def __init__(
        self,
        lifetime_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 1_000_000,
    ) -> None:
        if lifetime_s < 0:
            raise ValueError(f"lifetime must be >= 0, got {lifetime_s}")
        self.lifetime_s = lifetime_s
        self.clock = clock
        self.max_entries = max_entries
        self._holders: dict[int, dict[str, float]] = {}  # chain hash -> instance id -> expiry
        self._order: collections.deque[tuple[float, Sequence[int], str]] = collections.deque()  # by expiry
        self._entries = 0  # hashes recorded in `_order`

    def __len__(self) -> int:
        return sum(len(h) for h in self._holders.values())

    def routed(self, instance_id: str, hashes: Sequence[int]) -> None:
        """A prompt with these chain hashes was just routed to `instance_id`."""
        if not hashes or self.lifetime_s == 0:
            return
        now = self.clock()
        expiry = now + self.lifetime_s
        holders_of = self._holders
        for h in hashes:
            holders = holders_of.get(h)
            if holders is None:
                holders_of[h] = {instance_id: expiry}
            else:
                holders[instance_id] = expiry
        self._order.append((expiry, hashes, instance_id))
        self._entries += len(hashes)
        self._trim(now)

    def _trim(self, now: float) -> None:
        order, holders_of = self._order, self._holders
        while order and (order[0][0] <= now or self._entries > self.max_entries):
            expiry, hashes, iid = order.popleft()
            self._entries -= len(hashes)
            for h in hashes:
                holders = holders_of.get(h)
                if holders is not None and holders.get(iid) == expiry:  # not refreshed since
                    del holders[iid]
                    if not holders:
                        del holders_of[h]

    def blocks(self, hashes: Sequence[int], candidates: Iterable[str] | None = None) -> dict[str, int]:
        """Per instance, how many leading blocks of the prompt it is predicted to hold (instances with none
        left out)."""
        now = self.clock()
        self._trim(now)
        wanted = None if candidates is None else set(candidates)
        out: dict[str, int] = {}
        alive: set[str] | None = None
        depth = 0
        for h in hashes:
            holders = self._holders.get(h)
            here = (
                {i for i, e in holders.items() if e > now and (wanted is None or i in wanted)}
                if holders
                else set()
            )
            if alive is not None:
                here &= alive
                for gone in alive - here:
                    out[gone] = depth
            alive = here
            if not here:
                break
            depth += 1
        for iid in alive or ():
            out[iid] = depth
        return out

    def confirm(self, instance_id: str, hashes: Sequence[int], indexed_blocks: int) -> None:
        """The conductor's index shows `instance_id` holding the first `indexed_blocks` blocks: predictions it
        covers are dropped."""
        for h in hashes[:indexed_blocks]:
            holders = self._holders.get(h)
            if holders is not None and holders.pop(instance_id, None) is not None and not holders:
                del self._holders[h]

    def overlay(
        self,
        hashes: Sequence[int],
        matches: Mapping[str, KvMatch] | None,
        candidates: Iterable[str],
        block_size: int,
    ) -> dict[str, KvMatch]:
        """The conductor's facts (`matches`, None when it gave none) with predictions merged in; confirms the
        predictions the facts cover."""
        merged = dict(matches or {})
        if not self._holders or not hashes:
            return merged
        candidates = list(candidates)
        predicted = self.blocks(hashes, candidates)
        for iid, p in predicted.items():
            m = merged.get(iid, NO_MATCH)
            held = m.npu_blocks + m.cpu_blocks + m.disk_blocks
            if matches is not None and held >= p:
                self.confirm(iid, hashes, held)
            elif p > held:
                merged[iid] = KvMatch(m.npu_blocks + p - held, m.cpu_blocks, m.disk_blocks, block_size)
        return merged


INFINITE = math.inf
