"""`host:port` strings with IPv4, IPv6 (bracketed) and names."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Sequence
from typing import Annotated

from pydantic import AfterValidator


def split_host_port(address: str) -> tuple[str, int]:
    """`"127.0.0.1:80"` -> `("127.0.0.1", 80)`; `"[::1]:80"` -> `("::1", 80)`. Raises ValueError on bad input."""
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad address {address!r}: expected [ipv6]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"bad address {address!r}: expected host:port (bracket IPv6 hosts)")
    if not host:
        raise ValueError(f"bad address {address!r}: missing host")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"bad address {address!r}: port is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"bad address {address!r}: port out of range")
    return host, port


@functools.lru_cache(maxsize=1024)
def join_host_port(host: str, port: int) -> str:
    """The inverse of `split_host_port`: brackets IPv6 literals. Cached: a node agent joins each engine's address
    for every probe and read, and parsing the host as an IP address each time was a visible share of an idle agent's
    CPU (about 4% of its busy samples)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def is_ip(host: str) -> bool:
    """True for an IPv4 or IPv6 address (not a name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_wildcard(host: str) -> bool:
    """True for 0.0.0.0 and ::, which can be listened on but not advertised."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Replicas on one host listen on the configured port + this * i.
REPLICA_PORT_STEP = 10


def replica_listen(listen: str, index: int) -> str:
    """Where replica `index` of several on one host listens: `listen` with the port + 10 * index."""
    host, port = split_host_port(listen)
    return join_host_port(host, port + REPLICA_PORT_STEP * index)


def replica_endpoint(listen: str, index: int, addresses: Sequence[str]) -> str:
    """Where replica `index` is reached: `addresses[index]` when the config lists one address per replica (replicas
    on different hosts, e.g. Kubernetes pods), else its `replica_listen` (replicas on one host)."""
    return addresses[index] if addresses else replica_listen(listen, index)


def check_replica_addresses(listen: str, replicas: int, addresses: Sequence[str]) -> None:
    """ValueError unless `addresses` is empty or has one reachable address per replica, and unless a wildcard
    `listen` comes with them (a wildcard can be bound, not dialled)."""
    if addresses and len(addresses) != replicas:
        raise ValueError(f"replica_addresses: {len(addresses)} addresses for {replicas} replicas (one each)")
    wild = [a for a in addresses if is_wildcard(split_host_port(a)[0])]
    if wild:
        raise ValueError(
            f"replica_addresses: {wild[0]!r} is a wildcard address; list where each replica is reached"
        )
    if not addresses and is_wildcard(split_host_port(listen)[0]):
        raise ValueError(
            f"listen: {listen!r} is a wildcard address (it can be bound, not reached): list where each replica is "
            "reached in replica_addresses"
        )


def checked_address(address: str) -> str:
    """`address` unchanged when it is a valid `host:port`; ValueError otherwise (for config validation)."""
    split_host_port(address)
    return address


#: A config field holding `host:port` (IPv6 bracketed), validated at load.
Address = Annotated[str, AfterValidator(checked_address)]
