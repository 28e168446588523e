"""Where instances sit and what moving KV between them costs (pure core).

Each node has two kinds of link: the intra-node fabric between its own accelerators (HCCS on Ascend, NVLink on
GPUs) and its NIC to other nodes (RoCE / InfiniBand). A transfer between two instances of one node uses the
fabric; between nodes, the slower of the two NICs. Transfers in flight share a link's bandwidth evenly, as
concurrent RDMA reads of one NIC do.

Defaults, per node unless the mesh file says otherwise:
- Ascend 910B/910C (`ascend`): HCCS 56 GB/s per direction between NPUs of one node (Huawei Atlas 800T A2
  technical white paper: 392 GB/s aggregate over 7 links), 200 Gb/s RoCE per NPU (25 GB/s) to other nodes;
- GPU (`gpu`): NVLink 4 at 450 GB/s per direction (NVIDIA H100 SXM5 datasheet: 900 GB/s bidirectional), 400 Gb/s
  InfiniBand NDR per GPU (50 GB/s) to other nodes.
Latencies are per transfer (set-up, first byte): 20 us inside a node, 50 us across nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of path between instances."""

    bandwidth: float  # bytes per second, one direction
    latency_s: float = 0.0  # per transfer

    def seconds(self, nbytes: float, sharing: int = 0) -> float:
        """Time to move `nbytes` while `sharing` other transfers use the link."""
        return self.latency_s + nbytes / (self.bandwidth / (sharing + 1))


@dataclass(frozen=True, slots=True)
class NodeLinks:
    """A node's fabric (between its own instances) and its NIC (to other nodes), with its place."""

    intra: Link
    nic: Link
    rack: str = ""
    zone: str = ""


PRESETS: dict[str, NodeLinks] = {
    "ascend": NodeLinks(intra=Link(56e9, 20e-6), nic=Link(25e9, 50e-6)),
    "gpu": NodeLinks(intra=Link(450e9, 20e-6), nic=Link(50e9, 50e-6)),
}


@dataclass(frozen=True)
class Topology:
    """Nodes by id; a node the mesh file does not describe gets `default`."""

    nodes: Mapping[str, NodeLinks] = field(default_factory=dict)
    default: NodeLinks = PRESETS["ascend"]

    def of(self, node: str) -> NodeLinks:
        return self.nodes.get(node, self.default)

    def link(self, a: str, b: str) -> tuple[Link, tuple[str, ...]]:
        """The link a transfer from node `a` to node `b` uses, and the keys of what it shares with other
        transfers (`node` for a node's fabric; `node/nic` for each NIC on the way)."""
        if a == b and a:
            return self.of(a).intra, (a,)
        nic_a, nic_b = self.of(a).nic, self.of(b).nic
        slower = nic_a if nic_a.bandwidth <= nic_b.bandwidth else nic_b
        return Link(slower.bandwidth, max(nic_a.latency_s, nic_b.latency_s)), (f"{a}/nic", f"{b}/nic")

    def cross_node(self, a: str, b: str) -> bool:
        """True when a transfer from `a` to `b` leaves the node."""
        return not (a == b and a)


class Transfers:
    """KV transfers in flight per shared resource (`Topology.link` keys), each until its predicted end: what a
    new transfer shares. (The coordinator does not see a transfer end; the prediction bounds it.)"""

    def __init__(self) -> None:
        self._until: dict[str, list[float]] = {}

    def sharing(self, keys: tuple[str, ...], now: float) -> int:
        """Transfers in flight at `now` on the busiest resource of a path."""
        return max((self._live(k, now) for k in keys), default=0)

    def start(self, keys: tuple[str, ...], until: float) -> None:
        """A transfer on `keys`, predicted to end at `until`."""
        for k in keys:
            self._until.setdefault(k, []).append(until)

    def _live(self, key: str, now: float) -> int:
        ends = self._until.get(key)
        if not ends:
            return 0
        live = [t for t in ends if t > now]
        if live:
            self._until[key] = live
        else:
            del self._until[key]
        return len(live)

    def in_flight(self, now: float) -> int:
        """Resource uses in flight at `now` (0 when idle)."""
        return sum(self._live(k, now) for k in list(self._until))
