"""The coordinator's health probe of engines (the shell; `RegistryService` decides what to probe and what an answer
means, `expire_silent` asks the engines of a silent agent).

An instance is routable only after `GET http://<address>/health` answered 200: an agent's registration alone does
not prove that anything serves at the address it names. Probing is the coordinator's rather than Envoy's active
health checks because Envoy's default engines cluster (`original_dst`) has no endpoint list to check, and the
coordinator's table is what decides routing in both cluster kinds.

A probe is one HTTP/1.1 request on a connection of its own, read up to the status line, over plain asyncio: the
coordinator does not import an HTTP client library at start for it (aiohttp's import, a quarter of a second or
more, was part of a restarted coordinator's time out of service).
"""

from __future__ import annotations

import asyncio

from tandem.netaddr import split_host_port

#: One probe's deadline.
PROBE_TIMEOUT_S = 1.0
#: Delay between probes of an instance that did not answer yet.
PROBE_INTERVAL_S = 0.5


async def health_answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when `GET http://<address>/health` answers 200 within `timeout_s` (a redirect or any other status is
    no answer; so is an address that does not parse, a refused or reset connection, or silence)."""
    try:
        host, port = split_host_port(address)
    except ValueError:
        return False
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"GET /health HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            status_line = await reader.readline()
    except (TimeoutError, OSError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
    parts = status_line.split()
    return len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1] == b"200"


class HealthProber:
    """Asks an engine's `/health` (`health_answers`) with the coordinator's deadline and retry interval."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S, interval_s: float = PROBE_INTERVAL_S) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s

    async def answers(self, address: str) -> bool:
        """True when `http://<address>/health` answers 200 within the deadline."""
        return await health_answers(address, self.timeout_s)

    async def close(self) -> None:
        """Nothing to release (each probe closes its connection); kept for the registry's shutdown."""
