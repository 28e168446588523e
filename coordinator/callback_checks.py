"""Checks on a decode engine's metaserver callback before it may start a prefill leg (pure functions).

A callback makes a prefill engine push KV bytes to the `remote_host:remote_port` it names, so a forged one could
aim a prefill engine at any address. The coordinator therefore accepts a callback only when:
- its URL carries the attempt's token: a random value minted per request attempt and sent only in the body of
  that attempt's decode request (compared in constant time);
- `remote_host` is the host of the decode instance the coordinator chose for the attempt (both loopback counts
  as the same host), or one of `coordinator.callback_kv_hosts` (networks for deployments whose KV NIC differs
  from the HTTP address);
- `remote_port` is a port number, and the blocks it announces fit the prompt (at most one block more than the
  prompt fills).
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import secrets
from collections.abc import Sequence
from typing import Any


def mint_token() -> str:
    """A fresh per-attempt callback token (URL-safe)."""
    return secrets.token_urlsafe(18)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def host_allowed(remote_host: str, decode_host: str, networks: Sequence[str] = ()) -> bool:
    """True when `remote_host` is the decode instance's host (or both are loopback), or in `networks`."""
    remote, decode = remote_host.strip("[]"), decode_host.strip("[]")
    if remote and remote == decode:
        return True
    rip, dip = _ip(remote), _ip(decode)
    if rip is not None and dip is not None and rip.is_loopback and dip.is_loopback:
        return True
    if rip is None and remote in ("localhost",) and dip is not None and dip.is_loopback:
        return True
    for net in networks:
        try:
            if rip is not None and rip in ipaddress.ip_network(net, strict=False):
                return True
        except ValueError:
            if remote == net:
                return True
    return False


def block_count(remote_block_ids: Any) -> int:
    """Blocks announced in `remote_block_ids` (a list, or a list of lists per group)."""
    if not isinstance(remote_block_ids, list):
        return 0
    return sum(len(x) if isinstance(x, list) else 1 for x in remote_block_ids)


def _block_size(value: Any, fallback: int) -> int:
    if isinstance(value, list) and value:
        value = value[0]
    return int(value) if isinstance(value, int | float) and value >= 1 else max(fallback, 1)


#: Why a callback whose URL token is not that of an open request attempt is refused (also when no attempt with
#: its id is open: the two are not told apart).
TOKEN_REFUSED = "the callback URL's token does not belong to an open request attempt"


def callback_problem(
    expected_token: str,
    token: str,
    facts: dict[str, Any],
    decode_host: str,
    prompt_tokens: int,
    block_size: int,
    networks: Sequence[str] = (),
) -> str | None:
    """Why a callback must be refused; None when it may proceed."""
    if not token or not hmac.compare_digest(expected_token.encode(), token.encode()):
        return TOKEN_REFUSED
    host = str(facts.get("remote_host") or "")
    if not host_allowed(host, decode_host, networks):
        return f"remote_host {host!r} is not the host of the decode instance chosen for this request ({decode_host})"
    port = facts.get("remote_port")
    if not isinstance(port, int) or not 0 < port < 65536:
        return f"remote_port {port!r} is not a port number"
    size = _block_size(facts.get("remote_block_size"), block_size)
    # Layer-wise groups repeat the block list per group; the bound is per group.
    ids = facts.get("remote_block_ids")
    groups = len(ids) if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids) else 1
    limit = (math.ceil(prompt_tokens / size) + 1) * groups
    blocks = block_count(ids)
    if blocks > limit:
        return f"{blocks} KV blocks announced for a {prompt_tokens}-token prompt (at most {limit})"
    return None
