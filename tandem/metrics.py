"""Prometheus metrics endpoint of a Tandem process (the default `prometheus_client` registry)."""

from __future__ import annotations

from prometheus_client import start_http_server

from tandem.netaddr import split_host_port


def start_metrics_server(listen: str) -> None:
    """Serves `/metrics` on `listen` (`host:port`, IPv6 bracketed) from a daemon thread."""
    host, port = split_host_port(listen)
    start_http_server(port, addr=host)
