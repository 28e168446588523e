"""Trigger (vLLM-Ascend's MooncakeLayerwiseConnector; decode first) over TCP.

The decode engine allocates blocks, POSTs the callback body to the `metaserver` URL its `kv_transfer_params` name
(3 tries) and waits for a prefill engine to push the KV to its own `remote_host:remote_port` (the TCP listener of
handoff.py); the prefill engine, given those facts as its `kv_transfer_params`, pushes after its prefill. The
decode request fails with a clear error when nothing arrives within `--kv-transfer-timeout`. Decode requests
without a `metaserver` are handled as handoff ones (pulled).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import aiohttp

from simengine.connectors.handoff import HandoffConnector
from tandem import tracing

if TYPE_CHECKING:
    from simengine.config import EngineConfig
    from simengine.engine import Engine
    from simengine.request import Request

log = logging.getLogger("simengine.connectors")

#: vLLM connector names simulated by this module.
NAMES = ("MooncakeLayerwiseConnector",)
#: Tries of one metaserver callback, and the pause before the next try (times the try number).
_CALLBACK_TRIES = 3
_CALLBACK_BACKOFF_S = 0.05


class TriggerConnector(HandoffConnector):
    """Decode first: the decode engine asks the metaserver for a prefill, which pushes the KV here."""

    def __init__(self, cfg: EngineConfig, engine: Engine) -> None:
        super().__init__(cfg, engine)
        #: Decode side: callback request id -> (request, future set with the token count when the push arrived).
        self._expected: dict[str, tuple[Request, asyncio.Future]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        await super().start()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self) -> None:
        await super().stop()
        if self._session is not None:
            await self._session.close()

    def _expect_kv(self, request: Request, params: dict, callback_id: str) -> None:
        if params.get("metaserver"):
            request.needs_remote_kv = True
            request.pd_callback_id = callback_id
            if tracing.ENABLED:  # the callback leaves from the engine's loop, outside the request's context
                request.traceparent = tracing.traceparent()
            return
        super()._expect_kv(request, params, callback_id)

    async def _load(self, req: Request, params: dict) -> None:
        if params.get("metaserver"):
            await self._trigger(req, params)
        else:
            await super()._load(req, params)

    def _awaited_push(self, request_id: Any) -> asyncio.Future | None:
        entry = self._expected.get(request_id)
        return None if entry is None else entry[1]

    async def _trigger(self, req: Request, params: dict) -> None:
        loop = asyncio.get_running_loop()
        callback_id = req.pd_callback_id or req.request_id[:-9]
        fut: asyncio.Future = loop.create_future()
        self._expected[callback_id] = (req, fut)
        body = {
            "token_ids": [],
            "request_id": callback_id,
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [list(req.block_ids)],
            "remote_block_size": [self.cfg.block_size],
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_tp_size": self.cfg.tp_size,
            "remote_pcp_size": 1,
            "remote_dcp_size": 1,
            "remote_cached_tokens": max(req.num_cached_tokens, 0),
        }
        try:
            if not self.cfg.fault_drop_callbacks:
                copies = 2 if self.cfg.fault_duplicate_callbacks else 1
                for _ in range(copies):
                    self._spawn(self._post_callback(params["metaserver"], body, fut, req.traceparent))
            async with asyncio.timeout(self.cfg.kv_transfer_timeout):
                tokens = await asyncio.shield(fut)
            if not req.is_finished:  # the prefill engine pushed what this engine's prefix cache lacks
                self._done(req, True, tokens, max(tokens - self._cached_blocks(req) * self.cfg.block_size, 0))
        except TimeoutError:
            self.metrics.kv_transfer_failures.inc()
            self.engine.fail(
                req,
                f"KV transfer timed out: no prefill engine pushed the KV of {callback_id} within "
                f"{self.cfg.kv_transfer_timeout:g}s (metaserver {params.get('metaserver')})",
            )
        except Exception as e:  # the callback failed for good
            self.metrics.kv_transfer_failures.inc()
            self.engine.fail(req, str(e))
        finally:
            self._expected.pop(callback_id, None)

    async def _post_callback(self, url: str, body: dict, fut: asyncio.Future, traceparent: str = "") -> None:
        last = ""
        for attempt in range(_CALLBACK_TRIES):
            self.metrics.callbacks_sent.inc()
            try:
                assert self._session is not None  # opened in start()
                headers = {tracing.TRACEPARENT: traceparent} if traceparent else None  # joins the trace
                async with self._session.post(url, json=body, headers=headers) as resp:
                    if resp.status < 300:
                        return
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < _CALLBACK_TRIES - 1:
                await asyncio.sleep(_CALLBACK_BACKOFF_S * (attempt + 1))
        log.warning("metaserver callback to %s failed %d times: %s", url, _CALLBACK_TRIES, last)
        if not fut.done():
            fut.set_exception(
                RuntimeError(f"metaserver callback to {url} failed after {_CALLBACK_TRIES} tries: {last}")
            )


def create(cfg: EngineConfig, engine: Engine) -> TriggerConnector:
    """Factory used by the connector factory."""
    return TriggerConnector(cfg, engine)
