"""Which node's agent may send KV events (and `InstanceGone`) for which instance id (pure, no I/O).

With TLS an `Ingest` stream's caller is a node agent, `spiffe://tandem/agent/<node_id>`. Its messages name the
instance they are about; the conductor accepts them only when that node owns the instance, the same rule as the
coordinator's Registry (`coordinator/admission.py`), learnt the same way:
- an id the mesh file lists under a node (its engines' `instance_id`, `<instance_id>-dp<rank>` for external DP
  ranks) belongs to that node: the layer that reads the file hands the map down (`owners`);
- an id the conductor reads itself (`conductor.direct_endpoints`) belongs to no agent;
- any other id belongs to the first node whose agent sends events for it, until that agent says it is gone
  (`InstanceGone`) or all of that node's streams end; a node owns at most `max_per_node` instances.

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
        self._seen: dict[str, set[str]] = {}  # node -> ids it sent events for (its count against the cap)

    def problem(self, node: str, instance_id: str) -> str | None:
        """Why the agent of `node` may not send events for `instance_id`; None when it may (the id is then counted
        as the node's, and bound to it when the file does not name it)."""
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
        if instance_id not in seen:
            if len(seen) >= self.max_per_node:
                return f"node {node!r} already sends events for {len(seen)} instances (at most {self.max_per_node})"
            seen.add(instance_id)
        if named is None:
            self.bound[instance_id] = node
        return None

    def gone(self, node: str, instance_id: str) -> None:
        """The owner said the instance stopped: its id is released."""
        self._seen.get(node, set()).discard(instance_id)
        if self.bound.get(instance_id) == node:
            del self.bound[instance_id]

    def node_lost(self, node: str) -> list[str]:
        """The node's last stream ended: its ids are released; returns them."""
        ids = sorted(self._seen.pop(node, set()))
        for iid in ids:
            if self.bound.get(iid) == node:
                del self.bound[iid]
        return ids
