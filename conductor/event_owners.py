"""Which node's agent may send KV events (and `InstanceGone`) for which instance id (pure, no I/O).

With TLS an `Ingest` stream's caller is a node agent, `spiffe://tandem/agent/<node_id>`. Its messages name the
instance they are about; the conductor accepts them only when that node owns the instance, the same rule as the
coordinator's Registry (`coordinator/admission.py`), learnt the same way:
- an id the mesh file lists under a node (its engines' `instance_id`, `<instance_id>-dp<rank>` for external DP
  ranks) belongs to that node: the layer that reads the file hands the map down (`owners`);
- an id the conductor reads itself (`conductor.direct_endpoints`) belongs to no agent;
- any other id belongs to the first node whose agent sends events for it, until that agent says it is gone
  (`InstanceGone`) or all of that node's streams end; a node sends events for at most `max_per_node` engine ranks
  (instance, DP rank): the rank number is the agent's word too, so the bound is on ranks, not ids.

The conductor does not follow the coordinator's registry: the mesh file is what both read, so the two agree on
every id it names without a call between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class EventOwners:
    """Ownership of instance ids for KV events, per node."""

    def __init__(
        self,
        named: Mapping[str, frozenset[str]] | None = None,
        direct: Iterable[str] = (),
        max_per_node: int = 128,
    ) -> None:
        self.named = dict(named or {})
        self.direct = frozenset(direct)
        self.max_per_node = max_per_node
        self.bound: dict[
            str, str
        ] = {}  # an id the file does not name -> the node that sent events for it first
        self._seen: dict[str, set[tuple[str, int]]] = {}  # node -> ranks it sent events for (against the cap)

    def problem(self, node: str, instance_id: str, dp_rank: int | None = None) -> str | None:
        """Why the agent of `node` may not send events for `instance_id` (rank `dp_rank`; None: a message about the
        whole instance); None when it may (the rank is then counted as the node's, and the id bound to it when the
        file does not name it)."""
        if instance_id in self.direct:
            return f"instance {instance_id!r} is read by the conductor itself (conductor.direct_endpoints)"
        named = self.named.get(instance_id)
        if named is not None and node not in named:
            return f"the mesh file gives instance {instance_id!r} to node {', '.join(sorted(named))}"
        if named is None:
            owner = self.bound.get(instance_id)
            if owner is not None and owner != node:
                return f"instance {instance_id!r} is node {owner!r}'s (its agent sent events for it first)"
        seen = self._seen.setdefault(node, set())
        if dp_rank is not None and (instance_id, dp_rank) not in seen:
            if len(seen) >= self.max_per_node:
                return f"node {node!r} already sends events for {len(seen)} engine ranks (at most {self.max_per_node})"
            seen.add((instance_id, dp_rank))
        if named is None:
            self.bound[instance_id] = node
        return None

    def gone(self, node: str, instance_id: str) -> None:
        """The owner said the instance stopped: its id and ranks are released."""
        seen = self._seen.get(node, set())
        for key in [k for k in seen if k[0] == instance_id]:
            seen.discard(key)
        if self.bound.get(instance_id) == node:
            del self.bound[instance_id]

    def node_lost(self, node: str) -> list[str]:
        """The node's last stream ended: its ids are released; returns them."""
        ids = sorted(
            {iid for iid, _ in self._seen.pop(node, set())} | {i for i, n in self.bound.items() if n == node}
        )
        for iid in ids:
            if self.bound.get(iid) == node:
                del self.bound[iid]
        return ids
