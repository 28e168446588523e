"""What `Admin/GetConfig` shows of the running config: everything but secrets (a pure function).

Redacted: every value of an `env` map (engines' and stores' environments carry tokens and keys), fields whose
name says they hold a secret (`*password*`, `*secret*`, `api_key*`, `*_token`, `token`, a tenant's `keys`), and the value after an
`--api-key`-like flag in engine argument lists. API key *files* and *variable names* stay visible: they are not
the keys.
"""

from __future__ import annotations

from typing import Any

REDACTED = "<redacted>"
_SECRET_FLAGS = ("--api-key", "--hf-token", "--token", "--password")
_KEEP = frozenset({"api_keys_file", "api_keys_env"})


def _secret_name(key: str) -> bool:
    k = key.lower()
    if k in _KEEP:
        return False
    return (
        "password" in k
        or "secret" in k
        or k.startswith("api_key")
        or k == "keys"  # a tenant's API keys (`coordinator.tenants[].keys`)
        or k == "token"
        or k.endswith("_token")
        or k.endswith("-token")
    )


def _redact_args(args: list[Any]) -> list[Any]:
    out: list[Any] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        text = str(arg)
        flag, eq, _ = text.partition("=")
        if flag in _SECRET_FLAGS:
            if eq:
                out.append(f"{flag}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


def redact(value: Any, key: str = "") -> Any:
    """A copy of a config document with secrets replaced by `<redacted>`."""
    if isinstance(value, dict):
        if key == "env" or key.endswith("_env") and key not in _KEEP:
            return {k: REDACTED for k in value}
        return {
            k: (REDACTED if _secret_name(str(k)) and v is not None else redact(v, str(k)))
            for k, v in value.items()
        }
    if isinstance(value, list):
        items = _redact_args(value) if key in ("args", "extra_args", "argv") else value
        return [redact(v) for v in items]
    return value
