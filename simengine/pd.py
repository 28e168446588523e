"""P/D connector behaviours over real sockets.

Handoff (NixlConnector / MooncakeConnector, prefill first): the prefill engine answers a request carrying
`kv_transfer_params.do_remote_decode` with the facts a decode engine needs and keeps the blocks; the decode
engine, given those facts, connects to `remote_host:remote_port` over TCP and pulls the blocks (a scaled-down
payload sized from the block count), then frees them on the prefill side. Invalid facts or a failed pull fall
back to a local prefill, counted in `simengine:kv_transfer_fallbacks_total`.

Trigger (vLLM-Ascend MooncakeLayerwiseConnector, decode first): the decode engine allocates blocks, POSTs the
callback body to the `metaserver` URL (3 tries) and waits for a prefill engine to push the KV to its own
`remote_host:remote_port`; the prefill engine, given those facts as its `kv_transfer_params`, pushes after its
prefill. The decode request fails with a clear error when nothing arrives in time.

Storage (ExampleConnector, vLLM's CPU-friendly P/D): a producer writes every finished prompt's KV (a file sized
from its block count) under `kv_connector_extra_config.shared_storage_path`, keyed by its block-aligned prompt
tokens; a consumer that finds the file for a new request's prompt loads it instead of computing those tokens.

Mooncake (MooncakeConnector / MooncakeConnectorV1, handoff): when the Mooncake transfer engine is installed (the
`mooncake` extra, Debian libibverbs1), the bytes go through it instead, with vLLM-Ascend's handshake (see
simengine/mooncake.py); without it the connector logs why and uses the plain TCP path below.

Wire of the KV listener (one TCP connection per transfer): a JSON header line, then `nbytes` raw bytes.
`{"op":"pull","remote_request_id":..}` -> `{"ok":true,"num_tokens":N,"nbytes":B}\\n` + B bytes;
`{"op":"push","request_id":..,"num_tokens":N,"nbytes":B}\\n` + B bytes -> `{"ok":true}\\n`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import uuid
from array import array
from typing import Any

import aiohttp

from simengine import mooncake
from simengine.config import EngineConfig
from simengine.engine import Engine
from simengine.request import Request

log = logging.getLogger("simengine.pd")

_CHUNK = b"\0" * 65536
_HELD_TIMEOUT_S = 120.0


def _read_file(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def block_pattern(block_id: int) -> int:
    """The byte a prefill engine writes into a block it hands over (never 0, so untouched memory differs)."""
    return block_id % 251 + 1


def _flat_block_ids(value: Any) -> list[int] | None:
    """`[[1,2]]` (per KV cache group) or `[1,2]` -> `[1,2]`; None when malformed."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if isinstance(value, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        return value
    return None


class KVConnector:
    """One per engine when `--kv-transfer-config` names a P/D connector."""

    def __init__(self, cfg: EngineConfig, engine: Engine) -> None:
        self.cfg = cfg
        self.kt = cfg.kv_transfer
        self.mode = self.kt.mode
        self.engine = engine
        self.metrics = engine.metrics
        self.engine_id = self.kt.engine_id or str(uuid.uuid4())
        self.host = self.kt.kv_ip
        base = int(self.kt.kv_connector_extra_config.get("kv_port", self.kt.kv_port) or 0)
        self.port = base + cfg.dp_rank * cfg.tp_size if base else 0
        self._server: asyncio.base_events.Server | None = None
        #: trigger decode side: callback request id -> (request, future set when the push arrived)
        self._expected: dict[str, tuple[Request, asyncio.Future]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        engine.on_remote_kv = self._start_loads
        extra = self.kt.kv_connector_extra_config
        self.storage_path = str(extra.get("shared_storage_path") or "/tmp/simengine-kv-storage")
        #: The real Mooncake transfer engine for the Mooncake handoff connectors, when it can be loaded.
        self.mooncake: mooncake.MooncakeTransport | None = None
        self._use_mooncake = False
        if self.mode == "handoff" and (self.kt.kv_connector or "").startswith("MooncakeConnector"):
            missing = mooncake.available()
            if missing is None:
                self._use_mooncake = True
            else:
                log.warning("Mooncake transfer engine unavailable (%s); %s uses the plain TCP path",
                            missing, self.kt.kv_connector)  # fmt: skip

    async def start(self) -> None:
        if self.mode == "storage":
            os.makedirs(self.storage_path, exist_ok=True)
            return
        if self._use_mooncake:
            self.mooncake = await asyncio.to_thread(
                mooncake.MooncakeTransport,
                self.host,
                self.engine_id,
                self.cfg.npu_blocks,
                self.cfg.kv_bytes_per_block,
            )
            loop = asyncio.get_running_loop()
            if self.kt.is_producer:
                self.port = self.mooncake.listen(
                    self.port, lambda rid: loop.call_soon_threadsafe(self.engine.scheduler.release_held, rid)
                )
            return
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            self._server.close()
        if self.mooncake is not None:
            self.mooncake.close()
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- request setup (serving layer) ------------------------------------------------------------------------

    def prepare(self, request: Request, params: dict | None, callback_id: str) -> None:
        """Decides what P/D does for a request given its `kv_transfer_params` (None: nothing)."""
        if self.mode == "storage":
            if self.kt.is_consumer and os.path.exists(self._storage_file(request)):
                request.needs_remote_kv = True
            return
        if not params or not isinstance(params, dict):
            return
        request.kv_transfer_params = params
        if params.get("do_remote_decode") and self.kt.is_producer:
            request.hold_blocks_for_remote = True
            return
        if params.get("do_remote_prefill") and self.kt.is_consumer:
            if self.mode == "trigger" and params.get("metaserver"):
                request.needs_remote_kv = True
                request.pd_callback_id = callback_id
                return
            if self._valid_handoff(params):
                # As vLLM: no full block on the prefill side means nothing to pull; compute here, no fallback.
                request.needs_remote_kv = bool(_flat_block_ids(params.get("remote_block_ids")))
                return
            log.warning("invalid kv_transfer_params for a remote prefill; computing the prompt locally")
            self.metrics.kv_transfer_fallbacks.inc()

    @staticmethod
    def _valid_handoff(params: dict) -> bool:
        port = params.get("remote_port")
        return (
            isinstance(params.get("remote_host"), str)
            and bool(params.get("remote_host"))
            and isinstance(port, int)
            and 0 < port < 65536
            and isinstance(params.get("remote_request_id"), str)
            and _flat_block_ids(params.get("remote_block_ids")) is not None
        )

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
        if self.mooncake is not None:
            for block in full:  # real bytes to move: a per-block pattern the decode side can check
                self.mooncake.write_pattern(block, block_pattern(block))
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
        if self.kt.kv_connector and self.kt.kv_connector.startswith("Mooncake"):
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

    # -- shared storage (ExampleConnector) ----------------------------------------------------------------------

    def _storage_tokens(self, request: Request) -> int:
        """Prompt tokens the storage holds for a request: block-aligned, leaving at least one to compute."""
        bs = self.cfg.block_size
        return (request.num_prompt_tokens - 1) // bs * bs

    def _storage_file(self, request: Request) -> str:
        tokens = request.prompt_token_ids[: self._storage_tokens(request)]
        key = hashlib.sha256(array("q", tokens).tobytes()).hexdigest()[:32]
        return os.path.join(self.storage_path, f"{key}.kv")

    def _save_storage(self, request: Request) -> None:
        num = self._storage_tokens(request)
        if num <= 0 or not request.output_token_ids:
            return
        path = self._storage_file(request)
        if os.path.exists(path):
            return
        nbytes = num // self.cfg.block_size * self.cfg.kv_bytes_per_block
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(bytes(nbytes))
        os.replace(tmp, path)  # atomic: a reader never sees a partial file
        self.metrics.kv_transfer_bytes.inc(nbytes)

    async def _load_storage(self, req: Request) -> None:
        try:
            data = await asyncio.to_thread(_read_file, self._storage_file(req))
            self.metrics.kv_transfer_bytes.inc(len(data))
            tokens = self._storage_tokens(req)
            await asyncio.sleep(self.engine.profile.transfer_s(tokens) / self.cfg.speedup)
            if not req.is_finished:
                self._done(req, True, tokens)
        except OSError as e:
            log.warning("KV load from %s failed (%s); computing the prompt locally", self.storage_path, e)
            self.metrics.kv_transfer_failures.inc()
            self.metrics.kv_transfer_fallbacks.inc()
            self._done(req, False)

    def finished(self, request: Request) -> None:
        """Called by the serving layer when a request's response is done (whatever its outcome)."""
        if self.mode == "storage":
            if self.kt.is_producer:
                try:
                    self._save_storage(request)
                except OSError as e:
                    log.warning("KV save to %s failed: %s", self.storage_path, e)
            return
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

    def _start_loads(self, requests: list[Request]) -> None:
        for req in requests:
            params = req.kv_transfer_params or {}
            if self.mode == "storage":
                self._spawn(self._load_storage(req))
            elif self.mode == "trigger" and params.get("metaserver"):
                self._spawn(self._trigger(req, params))
            elif self.mooncake is not None:
                self._spawn(self._pull_mooncake(req, params))
            else:
                self._spawn(self._pull(req, params))

    def _done(self, req: Request, ok: bool, tokens: int = 0) -> None:
        req.remote_kv_done = True
        req.remote_kv_ok = ok
        req.num_remote_tokens = tokens
        if ok:
            self.metrics.kv_transfer_tokens.inc(tokens)
        self.engine.wake()

    async def _pull(self, req: Request, params: dict) -> None:
        timeout = self.cfg.kv_transfer_timeout
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(params["remote_host"], params["remote_port"]), timeout
            )
            try:
                header = {"op": "pull", "remote_request_id": params["remote_request_id"]}
                writer.write(json.dumps(header).encode() + b"\n")
                reply = json.loads(await asyncio.wait_for(reader.readline(), timeout))
                if not reply.get("ok"):
                    raise ConnectionError(reply.get("error", "pull refused"))
                await asyncio.wait_for(reader.readexactly(reply["nbytes"]), timeout)
                self.metrics.kv_transfer_bytes.inc(reply["nbytes"])
                tokens = int(reply.get("num_tokens", req.num_prompt_tokens))
            finally:
                writer.close()
            await asyncio.sleep(self.engine.profile.transfer_s(tokens) / self.cfg.speedup)
            if not req.is_finished:
                self._done(req, True, tokens)
        except (OSError, ValueError, KeyError, TimeoutError, asyncio.IncompleteReadError) as e:
            log.warning("KV pull for %s failed (%s); computing the prompt locally", req.request_id, e)
            self.metrics.kv_transfer_failures.inc()
            self.metrics.kv_transfer_fallbacks.inc()
            self._done(req, False)

    async def _pull_mooncake(self, req: Request, params: dict) -> None:
        """Reads the prompt's blocks from the prefill engine through the Mooncake transfer engine. As
        vLLM-Ascend, a failed read is logged and the request goes on as if the KV had arrived (no recompute)."""
        transport = self.mooncake
        assert transport is not None
        remote = _flat_block_ids(params.get("remote_block_ids")) or []
        local = req.block_ids[: len(remote)]
        result = await asyncio.to_thread(
            transport.pull, params["remote_host"], int(params["remote_port"]),
            str(params.get("remote_request_id", "")), remote, local,
        )  # fmt: skip
        tokens = len(local) * self.cfg.block_size
        if result.ok:
            self.metrics.kv_transfer_bytes.inc(result.nbytes)
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
        await asyncio.sleep(self.engine.profile.transfer_s(tokens) / self.cfg.speedup)
        if not req.is_finished:
            self._done(req, True, tokens)

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
                    self._spawn(self._post_callback(params["metaserver"], body, req, fut))
            tokens = await asyncio.wait_for(asyncio.shield(fut), self.cfg.kv_transfer_timeout)
            if not req.is_finished:
                self._done(req, True, tokens)
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

    async def _post_callback(self, url: str, body: dict, req: Request, fut: asyncio.Future) -> None:
        last = ""
        for attempt in range(3):
            self.metrics.callbacks_sent.inc()
            try:
                assert self._session is not None  # opened in start()
                async with self._session.post(url, json=body) as resp:
                    if resp.status < 300:
                        return
                    last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < 2:
                await asyncio.sleep(0.05 * (attempt + 1))
        log.warning("metaserver callback to %s failed 3 times: %s", url, last)
        if not fut.done():
            fut.set_exception(RuntimeError(f"metaserver callback to {url} failed after 3 tries: {last}"))

    async def push(self, request: Request, params: dict) -> None:
        """Prefill side of trigger: sends the finished prompt's KV to the decode engine named in `params`."""
        blocks = _flat_block_ids(params.get("remote_block_ids")) or []
        nbytes = max(len(blocks), 1) * self.cfg.kv_bytes_per_block
        header = {
            "op": "push",
            "request_id": params.get("request_id"),
            "num_tokens": request.num_prompt_tokens,
            "nbytes": nbytes,
        }
        timeout = self.cfg.kv_transfer_timeout
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(params["remote_host"], int(params["remote_port"])), timeout
        )
        try:
            writer.write(json.dumps(header).encode() + b"\n")
            await self._write_bytes(writer, nbytes)
            reply = json.loads(await asyncio.wait_for(reader.readline(), timeout) or b"{}")
            if not reply.get("ok"):
                raise ConnectionError(reply.get("error", "push refused"))
            self.metrics.kv_transfer_bytes.inc(nbytes)
        finally:
            writer.close()
            self.engine.scheduler.release_held(request.request_id)

    @staticmethod
    async def _write_bytes(writer: asyncio.StreamWriter, nbytes: int) -> None:
        left = nbytes
        while left > 0:
            n = min(left, len(_CHUNK))
            writer.write(_CHUNK[:n])
            left -= n
            await writer.drain()

    # -- KV listener --------------------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = json.loads(await reader.readline() or b"{}")
            op = header.get("op")
            if op == "pull":
                req = self.engine.scheduler.held.get(header.get("remote_request_id"))
                if req is None:
                    writer.write(b'{"ok":false,"error":"unknown or expired remote_request_id"}\n')
                    return
                num_blocks = req.num_prompt_tokens // self.cfg.block_size
                nbytes = max(num_blocks, 1) * self.cfg.kv_bytes_per_block
                reply = {"ok": True, "num_tokens": num_blocks * self.cfg.block_size, "nbytes": nbytes}
                writer.write(json.dumps(reply).encode() + b"\n")
                await self._write_bytes(writer, nbytes)
                self.engine.scheduler.release_held(req.request_id)
            elif op == "push":
                await reader.readexactly(int(header.get("nbytes", 0)))
                entry = self._expected.get(header.get("request_id"))
                if entry is None:
                    writer.write(b'{"ok":false,"error":"no request waits for this KV"}\n')
                    return
                _, fut = entry
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
