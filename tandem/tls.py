"""Mutual TLS between mesh components: identities, credential files, and who is calling.

Identities are URIs in a certificate's SAN, issued by the mesh CA (`tandem certs`):

    spiffe://tandem/coordinator     spiffe://tandem/conductor     spiffe://tandem/envoy
    spiffe://tandem/operator        spiffe://tandem/agent/<node_id>

A *role* is the part after `spiffe://tandem/` (`coordinator`, `agent/node-1`). Servers also answer to the DNS name
`<role>.tandem` (`agent-node-1.tandem`); clients verify that name (`grpc.ssl_target_name_override`), so a
certificate of another role cannot pose as the server they meant to reach, whatever address they dialled.

Calls proxied by Envoy arrive from Envoy's identity; Envoy then forwards the original caller's certificate URI
in `x-forwarded-client-cert` (it sets that header itself and drops any a client sent), or marks a call that came
through the engines' callback listener with `tandem-listener: callback` (those callers have no certificate: the
per-attempt token in the callback URL authenticates them). `caller_role` turns all of this into one role.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tandem.config_file import ConfigError

PREFIX = "spiffe://tandem/"
#: The pseudo-role of a metaserver callback that came through Envoy's callback listener.
CALLBACK_ROLE = "callback"
#: The header Envoy sets on every request its listeners forward to a gRPC service (never taken from a client).
LISTENER_HEADER = "tandem-listener"
XFCC_HEADER = "x-forwarded-client-cert"
#: The certificate directory a component was started with (`tandem up` sets it for the components it starts). Never
#: passed on to engines: an engine gets only a copy of the CA bundle (`mesh.security.engine_tls_env`).
CERTS_ENV = "TANDEM_CERTS_DIR"

#: The role of the caller of the gRPC call being handled (set by the authorization interceptor; None when the
#: process runs without TLS).
caller_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_caller", default=None)


def identity(role: str) -> str:
    """The certificate URI of a role: `spiffe://tandem/<role>`."""
    return PREFIX + role


def role_of(uri: str) -> str | None:
    """The role of a certificate URI, None for a URI outside the mesh."""
    return uri[len(PREFIX) :] if uri.startswith(PREFIX) and len(uri) > len(PREFIX) else None


def server_name(role: str) -> str:
    """The DNS name a server of `role` answers to in its certificate."""
    return file_stem(role) + ".tandem"


def file_stem(role: str) -> str:
    """The file name stem of a role's certificate (`agent/n1` -> `agent-n1`)."""
    return role.replace("/", "-")


def agent_node(role: str | None) -> str | None:
    """The node id of an `agent/<node_id>` role, else None."""
    if role and role.startswith("agent/"):
        return role[len("agent/") :] or None
    return None


@dataclass(frozen=True)
class TlsFiles:
    """The CA bundle, certificate chain and key one process presents and trusts."""

    ca: Path
    cert: Path
    key: Path
    #: Roles refused on every server this process runs, whatever their certificate (`security.revoked_nodes`: a
    #: removed node's agent certificate is still signed by the mesh CA until it expires).
    revoked: frozenset[str] = frozenset()

    @classmethod
    def for_role(cls, directory: str | Path, role: str) -> TlsFiles:
        """The files `tandem certs` writes for `role` in `directory`; ConfigError naming a missing one."""
        d = Path(directory)
        stem = file_stem(role)
        files = cls(d / "ca.pem", d / f"{stem}.pem", d / f"{stem}-key.pem")
        for path in (files.ca, files.cert, files.key):
            if not path.is_file():
                raise ConfigError(f"{path}: missing TLS file for {identity(role)} (run `tandem certs`)")
        return files

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present our certificate, require and verify the client's."""
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: present our certificate, verify the server's against the mesh CA."""
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _options(server_role: str, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", server_name(server_role)), *options]


def aio_channel(
    address: str, tls: TlsFiles | None, server_role: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to a server of `server_role`: mutual TLS with `tls`, plain text without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=_options(server_role, options))


def channel(
    address: str, tls: TlsFiles | None, server_role: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel (CLI, tests), as `aio_channel`."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=_options(server_role, options))


def peer_uris(auth_context: dict[str, Iterable[bytes]]) -> list[str]:
    """The URI SANs of the verified peer certificate (gRPC's auth context)."""
    uris = [v.decode() for v in auth_context.get("peer_uri", ())]
    if not uris:  # older gRPC: every SAN kind in one list
        uris = [v.decode() for v in auth_context.get("x509_subject_alternative_name", ()) if b"://" in v]
    return uris


def peer_role(auth_context: dict[str, Iterable[bytes]]) -> str | None:
    """The mesh role of the verified peer, None when it has no mesh identity."""
    for uri in peer_uris(auth_context):
        role = role_of(uri)
        if role is not None:
            return role
    return None


def forwarded_role(xfcc: str) -> str | None:
    """The role in Envoy's `x-forwarded-client-cert` (`By=...;Hash=...;URI=spiffe://tandem/operator`): the last
    element is the client Envoy itself authenticated."""
    last = xfcc.split(",")[-1]
    for part in last.split(";"):
        key, _, value = part.partition("=")
        if key.strip().lower() == "uri":
            return role_of(value.strip().strip('"'))
    return None


def context_caller_role(context: Any) -> str | None:
    """`caller_role` of a `grpc.aio` call: the peer's identities (its SANs, cheaper than the whole auth context),
    and the metadata only when the peer is Envoy."""
    identities = context.peer_identities() or ()
    peer = None
    for value in identities:
        role = role_of(value.decode(errors="replace"))
        if role is not None:
            peer = role
            break
    if peer is None and not identities:  # an identity property other than the SANs: the full context
        return caller_role(context.auth_context(), context.invocation_metadata() or ())
    if peer != "envoy":
        return peer
    return caller_role({"peer_uri": [identity("envoy").encode()]}, context.invocation_metadata() or ())


def caller_role(auth_context: dict[str, Iterable[bytes]], metadata: Iterable[tuple[str, Any]]) -> str | None:
    """Who is calling: the peer's role; for a call Envoy proxied, the client Envoy authenticated, or the
    callback pseudo-role; None when unknown. A call from Envoy with neither is Envoy's own (ext_proc)."""
    peer = peer_role(auth_context)
    if peer != "envoy":
        return peer
    headers = {k: v for k, v in metadata}
    xfcc = headers.get(XFCC_HEADER)
    if xfcc:
        return forwarded_role(str(xfcc))
    listener = headers.get(LISTENER_HEADER)
    if listener == CALLBACK_ROLE:
        return CALLBACK_ROLE
    if listener:  # proxied without a client certificate: nobody we know
        return None
    return "envoy"
