"""KV transfer links of a simulated P/D fleet: a small topology (nodes of N instances, one NIC per node, one
intra-node fabric per node) and a fluid model of transfers sharing them. Pure: times are simulated seconds passed
in by the caller, nothing sleeps.

Sharing: every transfer in flight uses resources, an intra-node transfer its node's fabric, an inter-node transfer
the sending node's NIC (out) and the receiving node's NIC (in). Each resource's bandwidth is split equally among the
transfers using it, and a transfer moves at the smallest of its shares. Every start or end re-divides the shares.
A transfer's fixed latency (link setup, first byte) is added once, after its last byte.

Layer by layer (trigger mode): a transfer may start while its prefill still computes. It then holds back a floor
of `bytes / layers` (the last layer cannot leave before it is computed) and, while it waits at that floor, takes no
share of any link; `produced` lifts the floor when the prefill completes. So a trigger transfer ends at the later
of (prefill end + last layer over the link) and (start + all bytes over the link).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Topology:
    """Where instances sit and what links them. Defaults: Ascend 910B servers (Atlas 800T A2 class).

    Instance i sits on node `i // ceil(instances / nodes)`. Bandwidths are bytes per second, each direction."""

    nodes: int = 1
    #: One node's network interface to other nodes: 200 Gb/s RoCE at ~80% (the timing profile's P/D transfer
    #: figure, `simengine.profiles.ASCEND_910B.transfer_bandwidth`), shared by every transfer in or out of the node.
    nic_bandwidth: float = 20e9
    nic_latency_s: float = 50e-6  # per inter-node transfer: RDMA setup and first byte across the switch
    #: Within a node (HCCS on Ascend, NVLink on GPUs): ~56 GB/s, shared by the node's intra-node transfers.
    intra_bandwidth: float = 56e9
    intra_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"topology.nodes: at least 1, got {self.nodes}")
        for name in ("nic_bandwidth", "intra_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"topology.{name}: must be > 0, got {getattr(self, name)}")

    def node_of(self, index: int, instances: int) -> int:
        """The node of instance `index` in a fleet of `instances`."""
        return index // math.ceil(instances / self.nodes)


@dataclass(eq=False)
class Transfer:
    """One KV transfer in flight."""

    src: int  # sending node
    dst: int  # receiving node
    total: float  # bytes
    remaining: float
    floor: float = 0.0  # bytes held back until `produced` (the last layer, trigger mode)
    on_done: Callable[[float], None] | None = None  # called with the completion time
    rate: float = 0.0
    started_at: float = 0.0
    done_at: float | None = None  # last byte moved (latency not included)
    resources: tuple = field(default=())

    @property
    def inter_node(self) -> bool:
        return self.src != self.dst


class Links:
    """The transfers in flight over one topology; the caller asks `next_time` and calls `advance` there."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.active: list[Transfer] = []
        self.now = 0.0
        self.bytes_inter_node = 0.0
        self.bytes_intra_node = 0.0
        self.version = 0  # bumped whenever `next_time` may change (stale events are ignored by the caller)

    def _capacity(self, resource: tuple) -> float:
        return self.topology.intra_bandwidth if resource[0] == "intra" else self.topology.nic_bandwidth

    def latency(self, t: Transfer) -> float:
        return self.topology.nic_latency_s if t.inter_node else self.topology.intra_latency_s

    def start(
        self,
        now: float,
        src: int,
        dst: int,
        nbytes: float,
        layers: int = 0,
        on_done: Callable[[float], None] | None = None,
    ) -> Transfer:
        """Starts a transfer of `nbytes` from node `src` to node `dst`; with `layers` > 0 the last layer waits for
        `produced` (trigger mode)."""
        self.advance(now)
        res = (("intra", src),) if src == dst else (("out", src), ("in", dst))
        floor = nbytes / layers if layers > 0 else 0.0
        t = Transfer(src, dst, float(nbytes), float(nbytes), floor, on_done, started_at=now, resources=res)
        if t.inter_node:
            self.bytes_inter_node += nbytes
        else:
            self.bytes_intra_node += nbytes
        self.active.append(t)
        self._reshare()
        return t

    def produced(self, now: float, t: Transfer) -> None:
        """The prefill behind `t` completed: its last layer may leave."""
        self.advance(now)
        t.floor = 0.0
        self._reshare()

    def _moving(self, t: Transfer) -> bool:
        return t.remaining > t.floor + 1e-3

    def _reshare(self) -> None:
        users: dict[tuple, int] = {}
        for t in self.active:
            if self._moving(t):
                for r in t.resources:
                    users[r] = users.get(r, 0) + 1
        for t in self.active:
            t.rate = min(self._capacity(r) / users[r] for r in t.resources) if self._moving(t) else 0.0
        self.version += 1

    def next_time(self) -> float | None:
        """When the next transfer in flight moves its last byte (or reaches its floor), None when none will."""
        best = None
        for t in self.active:
            if t.rate > 0:
                at = self.now + (t.remaining - t.floor) / t.rate
                best = at if best is None or at < best else best
            elif t.remaining <= 1e-3:
                return self.now
        return best

    def advance(self, now: float) -> list[Transfer]:
        """Moves every transfer to `now`; returns (and drops) those whose last byte moved. Their `on_done` is
        called with the time the data is there (last byte plus the link's latency)."""
        dt = now - self.now
        if dt > 0:
            for t in self.active:
                if t.rate > 0:
                    t.remaining = max(t.floor, t.remaining - t.rate * dt)
        self.now = max(self.now, now)
        done = [t for t in self.active if t.remaining <= 1e-3]
        if done:
            self.active = [t for t in self.active if t.remaining > 1e-3]
            for t in done:
                t.done_at = self.now
        changed = bool(done) or any(t.rate > 0 and not self._moving(t) for t in self.active)
        if changed:
            self._reshare()
        for t in done:
            if t.on_done is not None:
                t.on_done(self.now + self.latency(t))
        return done
