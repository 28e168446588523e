"""The P/D connector interface: what the serving layer and the engine loop ask of an engine's KV connector.
Nothing else lives here.

A connector decides, per request, whether its prompt's KV comes from another engine (decode side) or must be kept
for one (prefill side), moves the KV, and says what the answer tells the other engine (`kv_transfer_params`). The
serving layer calls `prepare` when it builds a request, `complete` when the request finished (before answering)
and `finished` once its answer is done, whatever its outcome; the engine loop calls `start_transfers` with the
requests whose blocks are allocated and whose remote KV must arrive now. A transfer ends by setting the request's
`remote_kv_done` (and `remote_kv_ok`, `num_remote_tokens`) and waking the engine.
"""

from __future__ import annotations

from typing import Protocol

from simengine.request import Request


class KVConnector(Protocol):
    """One engine's P/D connector (vLLM's `--kv-transfer-config` `kv_connector`, simulated)."""

    #: The port other engines reach this one's KV on (0 when the connector has none); final after `start`.
    port: int

    async def start(self) -> None:
        """Opens what the connector serves or uses (listeners, sessions, directories)."""
        ...

    async def stop(self) -> None:
        """Cancels transfers in flight and closes what `start` opened."""
        ...

    def prepare(self, request: Request, params: dict | None, callback_id: str) -> None:
        """Decides what P/D does for a new request given its `kv_transfer_params` (None: the request has none);
        `callback_id` is the id a metaserver callback names it by."""
        ...

    def start_transfers(self, requests: list[Request]) -> None:
        """Starts bringing the remote KV of requests the scheduler allocated blocks for (called by the engine)."""
        ...

    async def complete(self, request: Request) -> dict | None:
        """A finished request's P/D work before its answer: the `kv_transfer_params` the answer carries, or None.
        Raises OSError, ValueError or TimeoutError when KV the answer depends on could not be sent."""
        ...

    def finished(self, request: Request) -> None:
        """Called once the request's answer is done (streamed or not, whatever its outcome)."""
        ...
