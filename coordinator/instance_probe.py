"""The coordinator's health probe of newly registered instances (the shell; `RegistryService` decides what to
probe and what an answer means).

An instance is routable only after `GET http://<address>/health` answered 200: an agent's registration alone does
not prove that anything serves at the address it names. Probing is the coordinator's rather than Envoy's active
health checks because Envoy's default engines cluster (`original_dst`) has no endpoint list to check, and the
coordinator's table is what decides routing in both cluster kinds.
"""

from __future__ import annotations

import aiohttp

#: One probe's deadline.
PROBE_TIMEOUT_S = 1.0
#: Delay between probes of an instance that did not answer yet.
PROBE_INTERVAL_S = 0.5


class HealthProber:
    """Asks an engine's `/health` over one pooled HTTP client."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S, interval_s: float = PROBE_INTERVAL_S) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.interval_s = interval_s
        self._session: aiohttp.ClientSession | None = None

    async def answers(self, address: str) -> bool:
        """True when `http://<address>/health` answers 200 within the deadline."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(f"http://{address}/health", allow_redirects=False) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
