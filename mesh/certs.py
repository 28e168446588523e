"""`tandem certs`: a local certificate authority and one certificate per mesh component.

Every component-to-component connection of a mesh is mutually authenticated TLS. A component proves who it is
with a certificate whose URI SAN is its identity (`tandem.tls`: `spiffe://tandem/coordinator`,
`spiffe://tandem/agent/<node_id>`, ...); each server authorises calls by that identity. This module makes the
files, with the `cryptography` package:

    <dir>/ca.pem                             the mesh CA's certificate (every component trusts it)
    <ca-dir>/ca-key.pem                      the CA's private key, in a directory of its own (mode 0700, default
                                             `<dir>-ca` beside `<dir>`): only `tandem certs` and `tandem up` read
                                             it, no component is ever given its path
    <dir>/<name>.pem, <name>-key.pem         one per component: coordinator, conductor, envoy, operator,
                                             agent-<node_id>

Bring your own CA: put `ca.pem` in `<dir>` and `ca-key.pem` in `<ca-dir>` first (a `ca-key.pem` found in `<dir>`, the
layout before, is moved into `<ca-dir>`).

A file that exists is kept (so a deployment may bring any of them); `tandem certs --force` issues new leaves from
the same CA (rotation: see docs/security.md). Keys are written mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh.config import MeshConfig
from tandem import tls
from tandem.netaddr import split_host_port

CA_DAYS = 3650
LEAF_DAYS = 365
#: Names every server certificate answers to besides its role's own (`<role>.tandem`): loopback.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class CertError(Exception):
    """Certificates cannot be made or are missing (one line: which file and why)."""


@dataclass(frozen=True)
class Leaf:
    """One component certificate to issue."""

    name: str  # file stem: coordinator, agent-node1, ...
    identity: str  # the URI SAN
    hosts: tuple[str, ...]  # DNS names and IP literals servers are reached at


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Iterable[str], identity: str | None) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    if identity:
        names.append(x509.UniformResourceIdentifier(identity))
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def default_ca_dir(directory: Path) -> Path:
    """Where the CA's key of the certificates in `directory` lives unless told: `<directory>-ca`, beside it."""
    return directory.parent / f"{directory.name}-ca"


def _private_dir(path: Path) -> None:
    """Creates `path` (and parents) and makes it owner-only."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def create_ca(directory: Path, name: str = "Tandem mesh CA", ca_dir: Path | None = None) -> None:
    """Writes `ca.pem` in `directory` and `ca-key.pem` in `ca_dir` (default `default_ca_dir(directory)`, made
    owner-only): a self-signed P-256 CA."""
    ca_dir = ca_dir or default_ca_dir(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    _private_dir(ca_dir)
    _write_private(ca_dir / "ca-key.pem", _key_pem(key))
    (directory / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def move_ca_key(directory: Path, ca_dir: Path) -> bool:
    """Moves a `ca-key.pem` left in the certificates directory (the layout before, or a key brought there) into
    `ca_dir`; True when it did. CertError when both hold one (which is the CA's is not for this tool to guess)."""
    old, new = directory / "ca-key.pem", ca_dir / "ca-key.pem"
    if not old.exists():
        return False
    if new.exists():
        raise CertError(
            f"{old}: a CA key beside the certificates while {new} exists; remove the one not in use"
        )
    _private_dir(ca_dir)
    os.replace(old, new)
    os.chmod(new, 0o600)
    return True


def _load_ca(directory: Path, ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / "ca.pem", ca_dir / "ca-key.pem"
    if not key_path.exists():
        raise CertError(
            f"{key_path}: missing; the CA key is needed to issue certificates (or bring every file)"
        )
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise CertError(f"{directory}: cannot read the CA: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{key_path}: an EC (P-256) key is expected")
    if key.public_key() != cert.public_key():
        raise CertError(f"{key_path}: not the key of {cert_path}")
    return cert, key


def issue(directory: Path, leaf: Leaf, days: int = LEAF_DAYS, ca_dir: Path | None = None) -> None:
    """Writes `<name>.pem` (leaf then CA) and `<name>-key.pem` in `directory`, signed by the CA (`ca.pem` in
    `directory`, its key in `ca_dir`, default `default_ca_dir(directory)`)."""
    ca_cert, ca_key = _load_ca(directory, ca_dir or default_ca_dir(directory))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "tandem"),
            x509.NameAttribute(NameOID.COMMON_NAME, leaf.identity),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(_san(leaf.hosts, leaf.identity), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(directory / f"{leaf.name}-key.pem", _key_pem(key))
    chain = cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    (directory / f"{leaf.name}.pem").write_bytes(chain)


def write_bundle(directory: Path) -> Path:
    """`ca-bundle.pem`: the system's trusted CAs and the mesh CA, for engines that call Envoy's callback listener
    (their HTTP clients keep trusting public CAs, e.g. to download a model)."""
    system = ssl.get_default_verify_paths().cafile
    text = ""
    if system and os.path.isfile(system):
        text = Path(system).read_text(errors="replace").rstrip("\n") + "\n"
    bundle = directory / "ca-bundle.pem"
    bundle.write_text(text + (directory / "ca.pem").read_text())
    return bundle


def _host(address: str | None) -> list[str]:
    if not address or address.startswith("unix:"):
        return []
    host = split_host_port(address)[0].strip("[]")
    return [] if host in ("0.0.0.0", "::", "") else [host]


def mesh_leaves(mesh: MeshConfig, extra_hosts: Iterable[str] = ()) -> list[Leaf]:
    """The certificates a mesh needs, with every address its file names for each server."""
    extra = tuple(extra_hosts)
    envoy_hosts = (
        _host(mesh.envoy.grpc_listen) + _host(mesh.envoy.grpc_address) + _host(mesh.envoy.callback_listen)
    )
    envoy_hosts += _host(mesh.coordinator.metaserver_address)
    coordinator_hosts = [
        h for a in (mesh.coordinator.listen, *mesh.coordinator.replica_addresses) for h in _host(a)
    ]
    conductor_hosts = [
        h for a in (mesh.conductor.listen, *mesh.conductor.replica_addresses) for h in _host(a)
    ]
    leaves = [
        # Envoy fronts the coordinator's and conductor's services on its control listener, so it answers to
        # their names too (a node agent may reach the Registry directly or through Envoy).
        Leaf(
            "envoy",
            tls.identity("envoy"),
            (
                tls.server_name("envoy"),
                tls.server_name("coordinator"),
                tls.server_name("conductor"),
                *envoy_hosts,
                *LOOPBACK_NAMES,
                *extra,
            ),
        ),  # fmt: skip
        Leaf(
            "coordinator",
            tls.identity("coordinator"),
            (tls.server_name("coordinator"), *coordinator_hosts, *LOOPBACK_NAMES, *extra),
        ),
        Leaf(
            "conductor",
            tls.identity("conductor"),
            (tls.server_name("conductor"), *conductor_hosts, *LOOPBACK_NAMES, *extra),
        ),
        Leaf("operator", tls.identity("operator"), ()),
    ]
    for agent in mesh.node_agents:
        role = f"agent/{agent.node_id}"
        leaves.append(
            Leaf(
                tls.file_stem(role),
                tls.identity(role),
                (tls.server_name(role), *_host(agent.listen), *LOOPBACK_NAMES, *extra),
            )
        )
    return leaves


def ensure_certs(
    directory: Path,
    mesh: MeshConfig,
    force: bool = False,
    extra_hosts: Iterable[str] = (),
    ca_dir: Path | None = None,
) -> list[str]:
    """Creates the CA (when absent: certificate in `directory`, key in `ca_dir`, default
    `default_ca_dir(directory)`) and every missing component certificate; with `force`, re-issues every leaf from
    the existing CA. A CA key found in `directory` is moved to `ca_dir` first. Returns the file stems written."""
    ca_dir = ca_dir or default_ca_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    move_ca_key(directory, ca_dir)
    if not (directory / "ca.pem").exists():
        if (ca_dir / "ca-key.pem").exists():
            raise CertError(f"{directory / 'ca.pem'}: missing while {ca_dir / 'ca-key.pem'} exists")
        create_ca(directory, ca_dir=ca_dir)
    write_bundle(directory)
    written = []
    for leaf in mesh_leaves(mesh, extra_hosts):
        present = (directory / f"{leaf.name}.pem").exists() and (directory / f"{leaf.name}-key.pem").exists()
        if present and not force:
            continue
        issue(directory, leaf, ca_dir=ca_dir)
        written.append(leaf.name)
    return written


def describe(path: Path) -> str:
    """One line about a certificate file: its identity and expiry."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    return f"{path.name}: {', '.join(uris) or cert.subject.rfc4514_string()} (until {cert.not_valid_after_utc:%Y-%m-%d})"
