"""What every connector shares: the engine it serves, its background tasks, and how a transfer ends (the KV
arrived after the profile's transfer time, or it did not and the prompt is computed here)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simengine.config import EngineConfig
    from simengine.engine import Engine
    from simengine.request import Request


class ConnectorBase:
    """Shared state and transfer endings of the connectors; not a connector by itself."""

    def __init__(self, cfg: EngineConfig, engine: Engine) -> None:
        self.cfg = cfg
        #: The `--kv-transfer-config` keys (role, connector name, address, extra config).
        self.kt = cfg.kv_transfer
        self.engine = engine
        self.metrics = engine.metrics
        base = int(self.kt.kv_connector_extra_config.get("kv_port", self.kt.kv_port) or 0)
        #: The configured KV port, offset per DP rank as vLLM does (0: a free port); connectors that bind one
        #: replace it with the bound port.
        self.port = base + cfg.dp_rank * cfg.tp_size if base else 0
        #: Transfers and timers in flight, cancelled by `stop`.
        self._tasks: set[asyncio.Task] = set()

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _moved(self, peer: str, nbytes: int) -> None:
        """Counts one transfer this engine started (a pull or a push) of `nbytes` with the engine at `peer`."""
        self.metrics.kv_transfer_bytes.inc(nbytes)
        self.metrics.kv_transfer_peer_bytes.labels(*self.metrics.label_values, peer).inc(nbytes)

    def _done(self, req: Request, ok: bool, tokens: int = 0, moved: int | None = None) -> None:
        """Ends a request's transfer: its `tokens` leading prompt tokens are here (ok), `moved` of them (all when
        None) brought from the remote engine, the rest found in this engine's prefix cache; or none are (compute
        them)."""
        req.remote_kv_done = True
        req.remote_kv_ok = ok
        req.num_remote_tokens = tokens
        if ok:
            self.metrics.kv_transfer_tokens.inc(tokens if moved is None else moved)
        self.engine.wake()

    async def _arrive(self, req: Request, tokens: int, moved: int | None = None) -> None:
        """The KV of `moved` prompt tokens (all `tokens` when None) was received: lets the profile's transfer time
        for them pass, then hands the `tokens` leading tokens to the request unless it ended meanwhile."""
        moved = tokens if moved is None else moved
        await asyncio.sleep(self.engine.profile.transfer_s(moved) / self.cfg.speedup)
        if not req.is_finished:
            self._done(req, True, tokens, moved)

    def _cached_blocks(self, req: Request) -> int:
        """Leading prompt blocks the decode engine's prefix cache already held when the request was scheduled: as
        vLLM's decode side, it does not pull them again (NixlConnector reads only the blocks it allocated
        uncached, `get_unhashed_block_ids`; vLLM-Ascend's Mooncake connectors skip `remote_cached_tokens`)."""
        return max(req.num_cached_tokens, 0) // self.cfg.block_size

    def _fall_back(self, req: Request) -> None:
        """A transfer failed: counted, and the request computes its prompt here."""
        self.metrics.kv_transfer_failures.inc()
        self.metrics.kv_transfer_fallbacks.inc()
        self._done(req, False)
