"""Bootstrap shared by every Tandem gRPC process: health, reflection, Prometheus metrics, clean SIGTERM.

A component builds a `GrpcApp`, adds its servicers, and awaits `run()`:

    app = GrpcApp("conductor", listen="127.0.0.1:9200", metrics_listen="127.0.0.1:9201")
    app.add_service("tandem.v1.Conductor", conductor_pb2_grpc.add_ConductorServicer_to_server, servicer)
    await app.run()   # returns after SIGTERM/SIGINT, once in-flight calls had `grace` seconds to finish
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tandem import tracing
from tandem.authz import AuthzInterceptor, Rules
from tandem.banner import print_banner
from tandem.metrics import start_metrics_server
from tandem.tls import TlsFiles

log = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE = reflection.SERVICE_NAME


class GrpcApp:
    """One `grpc.aio` server with the standard health and reflection services and a metrics endpoint."""

    def __init__(
        self,
        role: str,
        listen: str,
        metrics_listen: str | None = None,
        grace: float = 5.0,
        options: list[tuple[str, Any]] | None = None,
        tls: TlsFiles | None = None,
        rules: Rules | None = None,
    ) -> None:
        """With `tls`, the port speaks mutual TLS only and every call is checked against `rules` (who may call
        what, `tandem.authz`); without, plain text and no checks (a mesh file's `security.insecure: true`)."""
        self.role = role
        self.listen = listen
        self.metrics_listen = metrics_listen
        self.grace = grace
        self.tls = tls
        interceptors: list[Any] = [AuthzInterceptor(rules or {}, tls.revoked)] if tls is not None else []
        traced = tracing.server_interceptor()  # None unless the mesh file's `tracing` names a collector
        if traced is not None:
            interceptors.insert(0, traced)
        self.server = grpc.aio.server(
            options=options or [("grpc.so_reuseport", 0)], interceptors=interceptors
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._services: list[str] = []
        self._extra_reflection: list[str] = []
        self._on_stop: list[Callable[[], Awaitable[None]]] = []
        self._stopping = asyncio.Event()
        self.bound_port = 0

    def add_service(
        self, name: str, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any
    ) -> None:
        """Serves `servicer`; `name` is its full name (`tandem.v1.Admin`), reported by health and reflection."""
        add_to_server(servicer, self.server)
        self._services.append(name)

    def advertise(self, *names: str) -> None:
        """Lists more services in reflection (the coordinator describes the whole mesh behind Envoy's :9000)."""
        self._extra_reflection.extend(n for n in names if n not in self._extra_reflection)

    def on_stop(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Runs `callback` after the server stopped taking calls, before the process exits."""
        self._on_stop.append(callback)

    async def start(self) -> None:
        """Binds, marks every service SERVING and starts the metrics endpoint."""
        names = [*self._services, *self._extra_reflection, HEALTH_SERVICE, REFLECTION_SERVICE]
        reflection.enable_server_reflection(list(dict.fromkeys(names)), self.server)
        if self.tls is not None:
            self.bound_port = self.server.add_secure_port(self.listen, self.tls.server_credentials())
        else:
            self.bound_port = self.server.add_insecure_port(self.listen)
        if self.bound_port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await self.server.start()
        for name in ["", *self._services]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.metrics_listen:
            start_metrics_server(self.metrics_listen)
        details = {
            "grpc": self.listen if self.tls is not None else f"{self.listen} (PLAIN TEXT: insecure mode)"
        }
        if self.metrics_listen:
            details["metrics"] = f"http://{self.metrics_listen}/metrics"
        print_banner(self.role, details)
        log.info("serving", extra={"listen": self.listen, "services": self._services})

    async def run(self, after_start: Callable[[], Awaitable[None]] | None = None) -> None:
        """Starts, runs `after_start`, then serves until SIGTERM or SIGINT and shuts down cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        if after_start is not None:
            await after_start()
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        """NOT_SERVING everywhere, `grace` seconds for calls in flight, then the stop callbacks."""
        log.info("shutting down", extra={"grace_s": self.grace})
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace)
        for callback in reversed(self._on_stop):
            try:
                await callback()
            except Exception:
                log.exception("stop callback failed")
        log.info("stopped")
