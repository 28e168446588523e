"""Mooncake handoff (vLLM-Ascend's MooncakeConnector / MooncakeConnectorV1; prefill first) over the real Mooncake
transfer engine.

Handoff as handoff.py, but the blocks go through the transfer engine with vLLM-Ascend's handshake
(mooncake_transport.py): the prefill side writes a per-block byte pattern into its registered buffer and serves
the handshake instead of the TCP listener, the decode side reads the blocks and checks the pattern. As
vLLM-Ascend, a failed read is logged and the request goes on as if the KV had arrived (no recompute). Without the
transfer engine (the `mooncake` extra, Debian libibverbs1) these names get the TCP handoff connector instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from simengine.connectors import mooncake_transport
from simengine.connectors.handoff import HandoffConnector, flat_block_ids

if TYPE_CHECKING:
    from simengine.config import EngineConfig
    from simengine.engine import Engine
    from simengine.request import Request

log = logging.getLogger("simengine.connectors")

#: vLLM connector names simulated by this module.
NAMES = ("MooncakeConnector", "MooncakeConnectorV1")


def block_pattern(block_id: int) -> int:
    """The byte a prefill engine writes into a block it hands over (never 0, so untouched memory differs)."""
    return block_id % 251 + 1


class MooncakeConnector(HandoffConnector):
    """Handoff whose bytes move through the Mooncake transfer engine."""

    def __init__(self, cfg: EngineConfig, engine: Engine) -> None:
        super().__init__(cfg, engine)
        #: The transfer engine, its registered buffer and handshake listener; opened by `start`.
        self.transport: mooncake_transport.MooncakeTransport | None = None

    async def start(self) -> None:
        self.transport = await asyncio.to_thread(
            mooncake_transport.MooncakeTransport,
            self.host,
            self.engine_id,
            self.cfg.npu_blocks,
            self.cfg.kv_bytes_per_block,
        )
        loop = asyncio.get_running_loop()
        if self.kt.is_producer:
            self.port = self.transport.listen(
                self.port, lambda rid: loop.call_soon_threadsafe(self.engine.scheduler.release_held, rid)
            )

    async def stop(self) -> None:
        await super().stop()
        if self.transport is not None:
            self.transport.close()

    def _offer(self, blocks: list[int]) -> None:
        transport = self.transport
        assert transport is not None  # opened in start()
        for block in blocks:  # real bytes to move: a per-block pattern the decode side can check
            transport.write_pattern(block, block_pattern(block))

    async def _load(self, req: Request, params: dict) -> None:
        """Reads the prompt's blocks from the prefill engine through the transfer engine."""
        transport = self.transport
        assert transport is not None  # opened in start()
        remote = flat_block_ids(params.get("remote_block_ids")) or []
        local = req.block_ids[: len(remote)]
        tokens = len(local) * self.cfg.block_size
        # Held here already: not read again (at least one block is, which tells the prefill side to free them).
        skip = min(self._cached_blocks(req), max(len(local) - 1, 0))
        remote, local = remote[skip : len(local)], local[skip:]
        result = await asyncio.to_thread(
            transport.pull, params["remote_host"], int(params["remote_port"]),
            str(params.get("remote_request_id", "")), remote, local,
        )  # fmt: skip
        if result.ok:
            self._moved(params["remote_host"], result.nbytes)
            bad = sum(
                transport.read_block(lb)[:1] != bytes([block_pattern(rb)])
                for rb, lb in zip(remote, local, strict=False)
            )
            if bad:
                log.error(
                    "Mooncake read of %s: %d blocks hold other bytes than the prefill engine's",
                    req.request_id,
                    bad,
                )
                self.metrics.kv_transfer_failures.inc()
        else:
            log.error("Mooncake KV transfer for %s failed: %s", req.request_id, result.error)
            self.metrics.kv_transfer_failures.inc()
        await self._arrive(req, tokens, len(local) * self.cfg.block_size)


def create(cfg: EngineConfig, engine: Engine) -> HandoffConnector:
    """Factory used by the connector factory: the TCP handoff connector when the transfer engine cannot load."""
    missing = mooncake_transport.available()
    if missing is not None:
        log.warning("Mooncake transfer engine unavailable (%s); %s uses the plain TCP path",
                    missing, cfg.kv_transfer.kv_connector)  # fmt: skip
        return HandoffConnector(cfg, engine)
    return MooncakeConnector(cfg, engine)
