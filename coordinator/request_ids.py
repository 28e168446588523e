"""Request ids: the engines see one the coordinator mints, never the client's.

A client's `X-Request-Id` is only a label: it is kept for the logs and echoed back to the client, but engines,
attempts and callbacks are keyed by the minted id, so two requests with the same client id (by mistake or on
purpose) never meet inside the mesh.
"""

from __future__ import annotations

import secrets

#: Longest client id kept (the rest is cut); ids are logged and echoed, never used as keys.
MAX_CLIENT_ID = 128
#: The request header the coordinator sets to the client's id, echoed back by Envoy as `x-request-id`.
CLIENT_ID_HEADER = "x-tandem-client-request-id"


def mint_request_id() -> str:
    """A fresh, unguessable engine-facing id."""
    return "tdm-" + secrets.token_hex(12)


def client_request_id(value: str | None) -> str:
    """The client's id as it may be logged and echoed: printable ASCII, at most `MAX_CLIENT_ID` characters."""
    if not value:
        return ""
    return "".join(c for c in value[:MAX_CLIENT_ID] if " " <= c <= "~")


def log_id(client_id: str, engine_id: str) -> str:
    """The id in log lines: the engine-facing one, after the client's when it sent one."""
    return f"{client_id}>{engine_id}" if client_id else engine_id
