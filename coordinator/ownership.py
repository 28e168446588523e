"""Which node agent may touch which instance id: a pure rule, applied by the Registry service.

With TLS on, a node agent's certificate names its node (`spiffe://tandem/agent/<node_id>`). It may register,
heartbeat and deregister only instances of that node: an instance it registers must say that node, an id the mesh
file gives another node is refused, and so is an id another node's agent has registered (no takeover of another
node's traffic; `coordinator.admission`). Without TLS (insecure mode) there is no identity and no check.
"""

from __future__ import annotations

from tandem.tls import agent_node, identity


def ownership_problem(caller: str | None, tls_on: bool, claimed_node: str, owner: str | None) -> str | None:
    """Why `caller` (a role) may not act on an instance that says `claimed_node` and is registered by `owner`
    (None: not registered); None when it may. Registration adds the mesh file's owners
    (`coordinator.admission.registration_refusal`)."""
    if not tls_on:
        return None
    node = agent_node(caller)
    who = identity(caller) if caller else "a caller without a mesh identity"
    if node is None:
        return f"{who} is not a node agent"
    if claimed_node and claimed_node != node:
        return f"{who} may only register instances of node {node!r}, not of node {claimed_node!r}"
    if owner is not None and owner != node:
        return f"the instance id is registered by the agent of node {owner!r}; {who} may not take it over"
    return None
