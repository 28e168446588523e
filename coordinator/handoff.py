"""P/D handoff (`prefill_handoff_decode`): the prefill leg, sent by the coordinator before Envoy forwards.

The prefill engine gets the client's body with `kv_transfer_params {"do_remote_decode": true,
"do_remote_prefill": false}`, `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when present),
without `min_tokens` and `stream_options`, and the same `X-Request-Id`. It answers with the `kv_transfer_params`
the decode engine needs; the coordinator copies them verbatim into the body Envoy sends to the decode engine,
which streams the answer back. A failed leg is retried on another prefill instance, up to
`coordinator.prefill_attempts`, then the client gets 503. The prefill instance's workload is released when its
leg ends, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import logging
from typing import TYPE_CHECKING, Any

from coordinator import metrics
from coordinator.callback_checks import handoff_params_problem
from coordinator.errors import OpenAIError
from coordinator.instances import InstanceInfo
from coordinator.picker import EndpointPicker, Pick
from tandem import tracing
from tandem.netaddr import split_host_port

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)


#: Connectors that move KV through shared storage rather than by `kv_transfer_params` (vLLM's ExampleConnector,
#: formerly SharedStorageConnector): their prefill answers carry none and the decode engine finds the KV itself.
STORAGE_CONNECTORS = frozenset({"ExampleConnector", "SharedStorageConnector"})


class PrefillFailed(Exception):
    """The prefill leg did not produce `kv_transfer_params`."""


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body of the prefill leg."""
    leg = copy.deepcopy(body)
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("min_tokens", None)
    leg.pop("stream_options", None)
    return leg


def decode_body(body: dict[str, Any], kv_transfer_params: Any) -> bytes:
    """The client's body with the prefill engine's `kv_transfer_params`, verbatim (the body as it is when the
    connector passes KV through storage and there are none)."""
    if kv_transfer_params is None:
        return json.dumps(body).encode()
    return json.dumps({**body, "kv_transfer_params": kv_transfer_params}).encode()


class HandoffRunner:
    """Sends prefill legs over one pooled HTTP client."""

    def __init__(
        self, picker: EndpointPicker, timeout_s: float, attempts: int, kv_hosts: list[str] | None = None
    ) -> None:
        self.picker = picker
        self.kv_hosts = kv_hosts or []  # `coordinator.callback_kv_hosts`: KV NICs besides the HTTP address
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._session: aiohttp.ClientSession | None = None

    async def warm(self) -> None:
        """Imports the HTTP client in a worker thread (`coordinator.app` calls it once serving, unless the mesh is
        aggregated). Not at start: aiohttp's import, a quarter of a second or more, would be a restarted
        coordinator's time out of service. Not at the first prefill leg either: on the event loop it stalled every
        decision in flight for as long (a fresh P/D mesh's first burst waited 0.2-0.25 s, `bench.pd`)."""
        await asyncio.to_thread(importlib.import_module, "aiohttp")

    def _client(self) -> aiohttp.ClientSession:
        # Imported by `warm` already, unless a leg comes while it runs: then this waits for it, once.
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def close(self) -> None:
        """Closes the HTTP client."""
        if self._session is not None:
            await self._session.close()

    async def send(
        self, address: str, path: str, body: dict[str, Any], request_id: str, want_params: bool = True
    ) -> Any:
        """POSTs a prefill leg; returns the answer's `kv_transfer_params` (checked when `want_params`)."""
        url = f"http://{address}{path}"
        headers = {"X-Request-Id": request_id}
        if tracing.ENABLED:  # the prefill engine's span is a child of this leg's
            parent = tracing.traceparent()
            if parent:
                headers[tracing.TRACEPARENT] = parent
        client = self._client()
        import aiohttp  # loaded by `_client`

        try:
            async with client.post(url, json=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise PrefillFailed(f"HTTP {resp.status}: {text[:200]}")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise PrefillFailed(f"{type(exc).__name__}: {exc}") from None
        try:
            params = json.loads(text).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not want_params:
            return params if isinstance(params, dict) and params else None
        if not isinstance(params, dict) or not params:
            raise PrefillFailed("the answer carries no kv_transfer_params (is the engine a kv_producer?)")
        return params

    async def prefill(
        self, pick: Pick, path: str, body: dict[str, Any], request_id: str, want_params: bool = True
    ) -> Any:
        """Sends a prefill leg to an instance the policy picks, retrying on others up to `attempts`; returns the
        answer's `kv_transfer_params`. Each instance's workload is released when its leg ends."""
        tried: set[str] = set()
        last = ""
        for _ in range(self.attempts):
            leg = await self.picker.pick_prefill(pick, tried)
            iid = leg.instance.info.instance_id
            tried.add(iid)
            needs_params = want_params and leg.instance.info.kv_connector not in STORAGE_CONNECTORS
            try:
                with tracing.span("tandem.prefill_leg", attributes={"tandem.instance": iid}):
                    params = await self.send(leg.instance.info.address, path, body, request_id, needs_params)
                if want_params and isinstance(params, dict):
                    self.check_params(params, leg.instance.info, pick.request.prompt_tokens)
            except PrefillFailed as exc:
                last = f"{iid}: {exc}"
                metrics.PREFILL_LEGS.labels("failed").inc()
                log.warning("prefill leg failed", extra={"instance": iid, "error": str(exc)})
                continue
            except asyncio.CancelledError:  # the request ended: the leg's HTTP request is closed with it
                metrics.PREFILL_LEGS.labels("cancelled").inc()
                raise
            finally:
                self.picker.release(leg)  # the leg is over: completed, failed, or cancelled with the request
            metrics.PREFILL_LEGS.labels("ok").inc()
            metrics.kv_moved(*self.picker.kv_moved(pick, leg))
            return params
        raise PrefillFailed(f"the prefill leg failed on {len(tried)} instance(s); last error: {last}")

    def check_params(self, params: dict[str, Any], info: InstanceInfo, prompt_tokens: int) -> None:
        """PrefillFailed when the answer's `kv_transfer_params` would send the decode engine elsewhere than the
        prefill instance, or to more blocks than the prompt fills (`callback_checks.handoff_params_problem`)."""
        host = split_host_port(info.address)[0]
        problem = handoff_params_problem(params, host, prompt_tokens, info.block_size, self.kv_hosts)
        if problem is not None:
            metrics.PREFILL_LEGS.labels("refused").inc()
            raise PrefillFailed(f"kv_transfer_params refused: {problem}")

    async def run(self, pick: Pick, path: str) -> bytes:
        """Handoff: runs the prefill leg (with retries); returns the body for the decode engine, or 503."""
        try:
            params = await self.prefill(pick, path, prefill_body(pick.request.body), pick.request_id)
        except PrefillFailed as exc:
            raise OpenAIError(503, f"The {exc}") from None
        return decode_body(pick.request.body, params)
