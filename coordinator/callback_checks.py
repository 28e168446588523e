"""Checks on a decode engine's metaserver callback before it may start a prefill leg (pure functions).

A callback makes a prefill engine push KV bytes to the `remote_host:remote_port` it names, so a forged one could
aim a prefill engine at any address. The coordinator therefore accepts a callback only when:
- its URL carries the attempt's token: a random value minted per request attempt and sent only in the body of
  that attempt's decode request (compared in constant time);
- `remote_host` is the host of the decode instance the coordinator chose for the attempt (both loopback counts
  as the same host), or one of `coordinator.callback_kv_hosts` (networks for deployments whose KV NIC differs
  from the HTTP address);
- `remote_port` is a port number, and the blocks it announces fit the prompt: per KV cache group at most one block
  more than the prompt fills in blocks of the decode instance's registered `block_size` (the callback's own
  `remote_block_size` and its group count are the caller's word, so neither widens the bound), and at most
  `MAX_KV_GROUPS` groups.

A handoff's prefill answer is checked the same way before its `kv_transfer_params` reach the decode engine
(`handoff_params_problem`): its `remote_host` must be the prefill instance's registered host (or in
`coordinator.callback_kv_hosts`), its `remote_port` a port number and its blocks must fit the prompt.
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


#: KV cache groups one request may announce blocks for (hybrid-attention models have a few: full and
#: sliding-window attention, Mamba state); each group is bounded by the prompt on its own.
MAX_KV_GROUPS = 4


def blocks_problem(remote_block_ids: Any, prompt_tokens: int, block_size: int) -> str | None:
    """Why the announced blocks cannot belong to a `prompt_tokens` prompt in blocks of the registered
    `block_size`; None when they fit."""
    ids = remote_block_ids
    nested = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
    groups = ids if nested else [ids if isinstance(ids, list) else []]
    if len(groups) > MAX_KV_GROUPS:
        return f"{len(groups)} KV cache groups announced (at most {MAX_KV_GROUPS})"
    per_group = math.ceil(prompt_tokens / max(block_size, 1)) + 1
    blocks = max(len(g) for g in groups)
    if blocks > per_group:
        return (
            f"{blocks} KV blocks announced for a {prompt_tokens}-token prompt in {block_size}-token blocks "
            f"(at most {per_group} per group)"
        )
    return None


def _port_problem(port: Any, lowest: int = 1) -> str | None:
    if not isinstance(port, int) or isinstance(port, bool) or not lowest <= port < 65536:
        return f"remote_port {port!r} is not a port number"
    return None


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
    return _port_problem(facts.get("remote_port")) or blocks_problem(
        facts.get("remote_block_ids"), prompt_tokens, block_size
    )


def handoff_params_problem(
    params: dict[str, Any],
    prefill_host: str,
    prompt_tokens: int,
    block_size: int,
    networks: Sequence[str] = (),
) -> str | None:
    """Why a prefill engine's `kv_transfer_params` must not reach the decode engine (which connects to the
    `remote_host:remote_port` they name and pulls the blocks they list); None when they may. Connectors that name
    no host (or no blocks) are not checked for them."""
    host = params.get("remote_host")
    if host is not None and not (isinstance(host, str) and host_allowed(host, prefill_host, networks)):
        return f"remote_host {host!r} is not the host of the prefill instance that answered ({prefill_host})"
    if "remote_port" in params:
        problem = _port_problem(params["remote_port"], lowest=0)  # vLLM answers 0 when it has no side channel
        if problem is not None:
            return problem
    if "remote_block_ids" in params:
        return blocks_problem(params["remote_block_ids"], prompt_tokens, block_size)
    return None
