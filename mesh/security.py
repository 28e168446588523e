"""Which certificates a process of the mesh uses: the layer above the components resolves them and hands each
component its `tandem.tls.TlsFiles` (None when the mesh file says `security.insecure: true`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from mesh.config import MeshConfig
from tandem.config_file import ConfigError
from tandem.tls import CERTS_ENV, TlsFiles

__all__ = ["CERTS_ENV", "certs_dir", "component_tls", "engine_tls_env"]


def certs_dir(mesh: MeshConfig, override: str | None = None) -> Path | None:
    """The certificate directory: `--certs-dir`, else $TANDEM_CERTS_DIR, else `security.certs_dir` (relative to the
    mesh file); None in insecure mode. ConfigError when TLS is on and none is named."""
    if mesh.security.insecure:
        return None
    chosen = override or os.environ.get(CERTS_ENV)
    if chosen:
        return Path(chosen).resolve()
    if mesh.security.certs_dir:
        base = Path(mesh.path).resolve().parent if mesh.path and not mesh.path.startswith("<") else Path.cwd()
        return (base / mesh.security.certs_dir).resolve()
    raise ConfigError(
        f"{mesh.path}: security.certs_dir: required to start a component with TLS (or pass --certs-dir; "
        "`tandem certs --config FILE --dir DIR` creates them; `security.insecure: true` turns TLS off)"
    )


def component_tls(mesh: MeshConfig, role: str, override: str | None = None) -> TlsFiles | None:
    """The files of `role` (`coordinator`, `agent/<node_id>`, ...), checked to exist, with the roles its servers
    refuse (`security.revoked_nodes`); None in insecure mode."""
    directory = certs_dir(mesh, override)
    if directory is None:
        return None
    revoked = frozenset(f"agent/{node}" for node in mesh.security.revoked_nodes)
    return dataclasses.replace(TlsFiles.for_role(directory, role), revoked=revoked)


def engine_tls_env(mesh: MeshConfig, override: str | None = None, into: Path | None = None) -> dict[str, str]:
    """Environment for engines, so that they trust Envoy's callback listener (HTTPS with the mesh CA): OpenSSL's
    `SSL_CERT_FILE` (aiohttp, httpx, urllib) and `REQUESTS_CA_BUNDLE` (requests) name `ca-bundle.pem`, the system's
    CAs plus the mesh CA (`tandem certs` writes it; `ca.pem` alone when absent). Empty in insecure mode.

    With `into` (the node agent's runtime directory) the bundle is copied there and the engines are given the copy:
    they never learn where the certificate directory (with the agent's and the operator's keys) is."""
    directory = certs_dir(mesh, override)
    if directory is None:
        return {}
    bundle = directory / "ca-bundle.pem"
    source = bundle if bundle.is_file() else directory / "ca.pem"
    if into is not None:
        into.mkdir(parents=True, exist_ok=True)
        copy = into / "ca-bundle.pem"
        shutil.copyfile(source, copy)
        source = copy
    path = str(source)
    return {"SSL_CERT_FILE": path, "REQUESTS_CA_BUNDLE": path}
