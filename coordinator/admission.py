"""Which registrations the Registry accepts, from what the mesh file says about nodes (pure rules).

A node agent's certificate names its node; a compromised node holds that certificate. What it may still register is
bounded here, by facts the operator wrote in the mesh file rather than by whoever registered first:

- **Ownership**: an instance id the mesh file lists under a node (its `instance_id`, or `<instance_id>-dp<rank>`
  for the external DP ranks the node runs) belongs to that node (to one of those nodes, when an engine spanning
  nodes is listed under several), whoever registered first and across coordinator restarts and
  replicas (they all read the same file). An id the file does not name belongs to the node that registered it
  first, for as long as the entry lives (shared through etcd with replicas; released when it stays silent).
- **Hosts**: a node's instances must be at one of its hosts: its engines' `host`, its agent's `listen` host and
  its `hosts` list (loopback counts as one host).
- **Cap**: at most `coordinator.max_instances_per_node` instances per node.
- **Not Envoy**: no instance at one of Envoy's own listeners (requests sent there would loop through Envoy).

Without TLS (insecure mode) there is no identity: only the Envoy rule holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from coordinator.instances import InstanceInfo
from tandem.netaddr import is_loopback, is_wildcard, split_host_port


@dataclass(frozen=True)
class NodeBook:
    """What the mesh file says about nodes (built by the layer that reads the file, `mesh.config`)."""

    #: Instance id (external DP ranks as `<id>-dp<rank>`) -> the nodes whose `node_agents` entries list it.
    owners: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: Node id -> the hosts its instances may be registered at.
    hosts: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: Envoy's listeners (`host:port`): no instance may be registered there.
    envoy_addresses: Sequence[str] = ()


@dataclass(frozen=True)
class Refusal:
    """Why a registration is refused, with the gRPC status it is answered with."""

    code: grpc.StatusCode
    message: str


def mesh_owners(book: NodeBook, instance_id: str) -> frozenset[str]:
    """The nodes the mesh file gives `instance_id` to; empty when the file does not name it."""
    return book.owners.get(instance_id, frozenset())


def owner_problem(book: NodeBook, node: str, instance_id: str, registered_owner: str | None) -> str | None:
    """Why the agent of `node` may not act on `instance_id`, held now by `registered_owner` (None: free)."""
    named = mesh_owners(book, instance_id)
    if named and node not in named:
        return (
            f"the mesh file gives instance {instance_id!r} to node {', '.join(sorted(named))}; "
            f"the agent of node {node!r} may not take it"
        )
    if registered_owner is not None and registered_owner != node:
        return (
            f"instance {instance_id!r} is registered by the agent of node {registered_owner!r}; "
            f"the agent of node {node!r} may not take it over"
        )
    return None


def _host(host: str) -> str:
    host = host.strip("[]").lower()
    return "loopback" if host == "localhost" or is_loopback(host) else host


def same_host(a: str, b: str) -> bool:
    """True when two hosts are the same (any two loopback names count as one)."""
    return _host(a) == _host(b)


def envoy_listener(book: NodeBook, address: str) -> str | None:
    """The Envoy listener `address` reaches, or None. A wildcard listener matches every host at its port."""
    try:
        host, port = split_host_port(address)
    except ValueError:
        return None
    for listener in book.envoy_addresses:
        lhost, lport = split_host_port(listener)
        if lport == port and (is_wildcard(lhost) or same_host(lhost, host)):
            return listener
    return None


def registration_refusal(
    book: NodeBook,
    node: str | None,
    info: InstanceInfo,
    registered_owner: str | None,
    node_instances: int,
    max_per_node: int,
) -> Refusal | None:
    """Why the agent of `node` (None: no identity, insecure mode) may not register `info`; None when it may.
    `registered_owner` is the node that holds the id now (None: free), `node_instances` how many other instances
    `node` has registered."""
    listener = envoy_listener(book, info.address)
    if listener is not None:
        return Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"instance {info.instance_id!r}: address {info.address} is Envoy's own listener ({listener}); "
            "requests routed there would loop through Envoy",
        )
    if node is None:
        return None
    problem = owner_problem(book, node, info.instance_id, registered_owner)
    if problem is not None:
        return Refusal(grpc.StatusCode.PERMISSION_DENIED, problem)
    hosts = book.hosts.get(node)
    if hosts is None:
        return Refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"node {node!r} is not in the mesh file's node_agents: its agent may not register instances",
        )
    host = split_host_port(info.address)[0]
    if not any(same_host(host, h) for h in hosts):
        return Refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"instance {info.instance_id!r}: host {host!r} is not a host of node {node!r} "
            f"(the mesh file gives it {', '.join(sorted(hosts))}; add others to node_agents[].hosts)",
        )
    if node_instances >= max_per_node:
        return Refusal(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"node {node!r} already has {node_instances} instances registered "
            f"(coordinator.max_instances_per_node is {max_per_node})",
        )
    return None
