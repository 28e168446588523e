"""Stopping an agent from outside (`tandem agent stop [--engines]`, and `tandem up` at the end).

Engines outlive their agent, so stopping them is a deliberate act: `NodeAgent/Shutdown {stop_engines: true}` asks a
running agent to deregister and stop them before it exits. When the agent does not answer (it crashed, or was
stopped without `--engines`), the processes recorded in its state directory are stopped directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from node_agent.config import NodeAgentConfig
from node_agent.processes import stop_recorded
from tandem.tls import TlsFiles, channel
from tandem.v1 import node_agent_pb2, node_agent_pb2_grpc


@dataclass
class ShutdownReport:
    """What `shutdown_agent` did."""

    agent_answered: bool = False  # the agent took the Shutdown call
    agent_exited: bool = False  # ... and stopped answering within the timeout
    stopped: list[str] = field(default_factory=list)  # processes stopped (by the agent or directly)
    left_running: list[str] = field(default_factory=list)  # engines left for the next agent

    def summary(self, node_id: str) -> str:
        if not self.agent_answered:
            head = f"agent {node_id}: not running"
        else:
            head = f"agent {node_id}: " + (
                "stopped" if self.agent_exited else "asked to stop, still answering"
            )
        if self.stopped:
            head += f"; stopped {', '.join(self.stopped)}"
        if self.left_running:
            head += f"; left running for the next agent: {', '.join(self.left_running)}"
        return head


def _answers(chan: grpc.Channel) -> bool:
    try:
        grpc.channel_ready_future(chan).result(timeout=0.2)
    except grpc.FutureTimeoutError:
        return False
    return True


def shutdown_agent(
    config: NodeAgentConfig, stop_engines: bool, timeout_s: float = 60.0, tls: TlsFiles | None = None
) -> ShutdownReport:
    """Asks the agent at `config.listen` to exit (stopping its engines when `stop_engines`), waits up to `timeout_s`
    for it to go; with `stop_engines`, then stops whatever its state directory still records. `tls`: the
    operator's certificate (the NodeAgent service answers no one else when the mesh runs with TLS)."""
    report = ShutdownReport()
    with channel(config.listen, tls, f"agent/{config.node_id}") as chan:
        try:
            reply = node_agent_pb2_grpc.NodeAgentStub(chan).Shutdown(
                node_agent_pb2.ShutdownRequest(stop_engines=stop_engines), timeout=5
            )
        except grpc.RpcError:
            reply = None
        if reply is not None:
            report.agent_answered = True
            report.stopped = list(reply.stopping)
            report.left_running = list(reply.left_running)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _answers(chan):
                time.sleep(0.1)
            report.agent_exited = not _answers(chan)
    if stop_engines:
        leftovers = stop_recorded(config.state_path, grace_s=config.stop_grace_s)
        report.stopped += [name for name in leftovers if name not in report.stopped]
    return report
