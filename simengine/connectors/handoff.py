"""Handoff (vLLM's NixlConnector, P2pNcclConnector; prefill first) over TCP, and the TCP KV listener every TCP
connector serves.

The prefill engine answers a request carrying `kv_transfer_params.do_remote_decode` with the facts a decode engine
needs and keeps the blocks; the decode engine, given those facts, connects to `remote_host:remote_port` over TCP
and pulls the blocks (a scaled-down payload sized from the block count), then the prefill side frees them (or
after 120 s when nobody pulls). Invalid facts or a failed pull fall back to a local prefill, counted in
`simengine:kv_transfer_fallbacks_total`. Under `NixlConnector` a pull is also counted in vLLM's series: a
successful one in `vllm:nixl_bytes_transferred` (histogram), a failed one in `vllm:nixl_num_failed_transfers_total`
(the node agent relays both; the coordinator's P/D choice learns failing links from them). A prefill leg whose
`kv_transfer_params` name the decode engine (`remote_host`: a trigger callback's facts, see trigger.py) pushes its
KV there before answering.

Wire of the KV listener (one TCP connection per transfer): a JSON header line, then `nbytes` raw bytes.
`{"op":"pull","remote_request_id":..,"skip_blocks":K}` -> `{"ok":true,"num_tokens":N,"nbytes":B}\\n` + B bytes
(the prompt's N leading tokens in full blocks; B the bytes of those after the K leading blocks the decode engine's
prefix cache holds, which it does not pull again, as vLLM's decode side);
`{"op":"push","request_id":..,"num_tokens":N,"nbytes":B}\\n` + B bytes -> `{"ok":true}\\n` (a push nobody waits
for: `{"ok":false,"error":..}`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

from simengine.connectors.base import ConnectorBase

#: vLLM's variable for the host its NixlConnector binds and announces (`envs.VLLM_NIXL_SIDE_CHANNEL_HOST`).
KV_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"

if TYPE_CHECKING:
    from simengine.config import EngineConfig
    from simengine.engine import Engine
    from simengine.request import Request

log = logging.getLogger("simengine.connectors")

#: vLLM connector names simulated by this module.
NAMES = ("NixlConnector", "P2pNcclConnector")
_CHUNK = b"\0" * 65536
#: How long a prefill engine keeps blocks no decode engine pulled.
_HELD_TIMEOUT_S = 120.0


def flat_block_ids(value: Any) -> list[int] | None:
    """`[[1,2]]` (per KV cache group) or `[1,2]` -> `[1,2]`; None when malformed."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if isinstance(value, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        return value
    return None


def _int(value: Any) -> int:
    """A non-negative count from a peer's JSON; 0 when absent or malformed."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _valid_handoff(params: dict) -> bool:
    port = params.get("remote_port")
    return (
        isinstance(params.get("remote_host"), str)
        and bool(params.get("remote_host"))
        and isinstance(port, int)
        and 0 < port < 65536
        and isinstance(params.get("remote_request_id"), str)
        and flat_block_ids(params.get("remote_block_ids")) is not None
    )


class HandoffConnector(ConnectorBase):
    """Prefill first: the prefill engine hands facts back, the decode engine pulls the blocks over TCP."""

    def __init__(self, cfg: EngineConfig, engine: Engine) -> None:
        super().__init__(cfg, engine)
        #: The engine id the answers announce (`remote_engine_id`).
        self.engine_id = self.kt.engine_id or str(uuid.uuid4())
        #: The address the answers announce and the listener binds: vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST` (its node
        #: agent sets it to the engine's host), else `kv_ip` (older vLLM's field), else 127.0.0.1.
        self.host = os.environ.get(KV_HOST_ENV) or self.kt.kv_ip
        #: vLLM-Ascend's Mooncake connectors answer a few more facts than vLLM's (see `finished_params`).
        self._mooncake_fields = (self.kt.kv_connector or "").startswith("Mooncake")
        if self.kt.kv_connector == "NixlConnector":
            self.metrics.enable_nixl()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await super().stop()
        if self._server is not None:
            self._server.close()

    # -- request setup (serving layer) ------------------------------------------------------------------------

    def prepare(self, request: Request, params: dict | None, callback_id: str) -> None:
        if not params or not isinstance(params, dict):
            return
        request.kv_transfer_params = params
        if params.get("do_remote_decode") and self.kt.is_producer:
            request.hold_blocks_for_remote = True
            return
        if params.get("do_remote_prefill") and self.kt.is_consumer:
            self._expect_kv(request, params, callback_id)

    def _expect_kv(self, request: Request, params: dict, callback_id: str) -> None:
        """Decode side: the prompt's KV is pulled from the prefill engine `params` name, if they are valid."""
        if _valid_handoff(params):
            # As vLLM: no full block on the prefill side means nothing to pull; compute here, no fallback.
            request.needs_remote_kv = bool(flat_block_ids(params.get("remote_block_ids")))
            return
        log.warning("invalid kv_transfer_params for a remote prefill; computing the prompt locally")
        self.metrics.kv_transfer_fallbacks.inc()

    async def complete(self, request: Request) -> dict | None:
        params = request.kv_transfer_params
        if not params:
            return None
        if params.get("do_remote_decode") and params.get("remote_host") is not None:
            await self.push(request, params)
        return self.finished_params(request)

    def finished_params(self, request: Request) -> dict | None:
        """`kv_transfer_params` of a finished request's response (prefill side of handoff)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not self.kt.is_producer:
            return None
        if params.get("remote_host") is not None:  # trigger prefill leg: it pushed, nothing to hand back
            return None
        bs = self.cfg.block_size
        # Only full prompt blocks are sent (vLLM's `computed_block_ids`); the decode engine computes the rest.
        full = request.block_ids[: request.num_prompt_tokens // bs]
        self._offer(full)
        if full:
            self.release_later(request)
        else:
            self.engine.scheduler.release_held(request.request_id)
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(full)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.cfg.tp_size,
        }
        if self._mooncake_fields:
            out.update(
                remote_pcp_size=1,
                remote_dcp_size=1,
                remote_ptp_size=self.cfg.tp_size,
                last_token_id=request.output_token_ids[-1] if request.output_token_ids else None,
                remote_multi_nodes_meta_mapping=None,
                num_prompt_blocks=-(-request.num_prompt_tokens // bs),
                remote_block_size=bs,
            )
        return out

    def _offer(self, blocks: list[int]) -> None:
        """Makes held blocks readable by a decode engine: nothing to do here (the listener reads them when
        pulled); a connector with its own data path fills them."""

    def finished(self, request: Request) -> None:
        self.release_later(request)

    def release_later(self, request: Request) -> None:
        """Frees a finished request's held blocks if no decode engine pulls them in time (once per request)."""
        if request.hold_blocks_for_remote and request.request_id in self.engine.scheduler.held:
            request.hold_blocks_for_remote = False
            self._spawn(self._expire_held(request.request_id))

    async def _expire_held(self, request_id: str) -> None:
        await asyncio.sleep(_HELD_TIMEOUT_S)
        if self.engine.scheduler.release_held(request_id) is not None:
            log.warning(
                "freed blocks of %s: no decode engine pulled them in %ss", request_id, _HELD_TIMEOUT_S
            )

    # -- transfers started by the engine loop -----------------------------------------------------------------

    def start_transfers(self, requests: list[Request]) -> None:
        for req in requests:
            self._spawn(self._load(req, req.kv_transfer_params or {}))

    async def _load(self, req: Request, params: dict) -> None:
        """Brings one request's remote KV: a TCP pull here."""
        await self._pull(req, params)

    async def _pull(self, req: Request, params: dict) -> None:
        timeout = self.cfg.kv_transfer_timeout
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(params["remote_host"], params["remote_port"])
            try:
                skip = self._cached_blocks(req)
                header = {"op": "pull", "remote_request_id": params["remote_request_id"], "skip_blocks": skip}
                writer.write(json.dumps(header).encode() + b"\n")
                async with asyncio.timeout(timeout):
                    reply = json.loads(await reader.readline())
                if not reply.get("ok"):
                    raise ConnectionError(reply.get("error", "pull refused"))
                async with asyncio.timeout(timeout):
                    await reader.readexactly(reply["nbytes"])
                self._moved(params["remote_host"], reply["nbytes"])
                if self.metrics.nixl_bytes_transferred is not None:
                    self.metrics.nixl_bytes_transferred.observe(reply["nbytes"])
                tokens = int(reply.get("num_tokens", req.num_prompt_tokens))
            finally:
                writer.close()
            await self._arrive(
                req, tokens, reply["nbytes"] // self.cfg.kv_bytes_per_block * self.cfg.block_size
            )
        except (OSError, ValueError, KeyError, TimeoutError, asyncio.IncompleteReadError) as e:
            log.warning("KV pull for %s failed (%s); computing the prompt locally", req.request_id, e)
            if self.metrics.nixl_failed_transfers is not None:
                self.metrics.nixl_failed_transfers.inc()  # as vLLM's NIXL connector counts a failed read
            self._fall_back(req)

    async def push(self, request: Request, params: dict) -> None:
        """Sends a finished prompt's KV to the decode engine named in `params` (the prefill side of trigger)."""
        blocks = flat_block_ids(params.get("remote_block_ids")) or []
        # The decode engine's own prefix hit is not sent (vLLM-Ascend's layerwise connector starts at
        # `remote_cached_tokens`).
        cached = _int(params.get("remote_cached_tokens")) // self.cfg.block_size
        nbytes = max(len(blocks) - cached, 1) * self.cfg.kv_bytes_per_block
        header = {
            "op": "push",
            "request_id": params.get("request_id"),
            "num_tokens": request.num_prompt_tokens,
            "nbytes": nbytes,
        }
        timeout = self.cfg.kv_transfer_timeout
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(params["remote_host"], int(params["remote_port"]))
        try:
            writer.write(json.dumps(header).encode() + b"\n")
            await _write_bytes(writer, nbytes)
            async with asyncio.timeout(timeout):
                reply = json.loads(await reader.readline() or b"{}")
            if not reply.get("ok"):
                raise ConnectionError(reply.get("error", "push refused"))
            self._moved(params["remote_host"], nbytes)
        finally:
            writer.close()
            self.engine.scheduler.release_held(request.request_id)

    # -- KV listener --------------------------------------------------------------------------------------------

    def _awaited_push(self, request_id: Any) -> asyncio.Future | None:
        """The future a decode request waiting for this pushed KV resolves with, or None: nobody waits for pushes
        here (the trigger connector's decode side does)."""
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = json.loads(await reader.readline() or b"{}")
            op = header.get("op")
            if self.cfg.fault_kv_refuse:  # --fault-kv-refuse: a broken link
                writer.write(b'{"ok":false,"error":"KV transfers refused (fault injection)"}\n')
                return
            if op == "pull":
                req = self.engine.scheduler.held.get(header.get("remote_request_id"))
                if req is None:
                    writer.write(b'{"ok":false,"error":"unknown or expired remote_request_id"}\n')
                    return
                num_blocks = req.num_prompt_tokens // self.cfg.block_size
                skip = min(_int(header.get("skip_blocks")), num_blocks)
                nbytes = max(num_blocks - skip, 1) * self.cfg.kv_bytes_per_block
                reply = {"ok": True, "num_tokens": num_blocks * self.cfg.block_size, "nbytes": nbytes}
                writer.write(json.dumps(reply).encode() + b"\n")
                await _write_bytes(writer, nbytes)
                self.engine.scheduler.release_held(req.request_id)
            elif op == "push":
                await reader.readexactly(int(header.get("nbytes", 0)))
                fut = self._awaited_push(header.get("request_id"))
                if fut is None:
                    writer.write(b'{"ok":false,"error":"no request waits for this KV"}\n')
                    return
                if not fut.done():
                    fut.set_result(int(header.get("num_tokens", 0)))
                self.metrics.kv_transfer_bytes.inc(int(header.get("nbytes", 0)))
                writer.write(b'{"ok":true}\n')
            else:
                writer.write(b'{"ok":false,"error":"unknown op"}\n')
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            log.warning("KV listener: bad transfer: %s", e)
        finally:
            try:
                await writer.drain()
            except OSError:
                pass
            writer.close()


async def _write_bytes(writer: asyncio.StreamWriter, nbytes: int) -> None:
    left = nbytes
    while left > 0:
        n = min(left, len(_CHUNK))
        writer.write(_CHUNK[:n])
        left -= n
        await writer.drain()


def create(cfg: EngineConfig, engine: Engine) -> HandoffConnector:
    """Factory used by the connector factory."""
    return HandoffConnector(cfg, engine)
