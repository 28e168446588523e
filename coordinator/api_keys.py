"""API keys on the public OpenAI port (like vLLM's `--api-key`): optional, several at once, from a file or an
environment variable. A pure core: the ext_proc shell passes the `Authorization` header and answers 401.

Keys are kept as SHA-256 digests and compared in constant time; a key is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from tandem.config_file import ConfigError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, separator: str | None = None) -> list[str]:
    """Keys from a file's text (one per line, `#` comments) or an env value (`separator`-separated)."""
    if separator is not None:
        return [k.strip() for k in text.split(separator) if k.strip()]
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class ApiKeys:
    """The accepted keys; `enabled` is False when none are configured (the port is open)."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = [_digest(k) for k in dict.fromkeys(keys)]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def load(cls, file: str | None, env: str | None, source: str = "coordinator") -> ApiKeys:
        """The keys of `coordinator.api_keys_file` and `coordinator.api_keys_env`; ConfigError naming the key
        when a named file or variable is missing or holds no key."""
        keys: list[str] = []
        if file:
            try:
                keys += parse_keys(Path(file).read_text())
            except OSError as exc:
                raise ConfigError(f"{source}.api_keys_file: cannot read {file!r}: {exc.strerror}") from None
            if not keys:
                raise ConfigError(f"{source}.api_keys_file: {file!r} holds no key")
        if env:
            value = os.environ.get(env)
            if not value or not parse_keys(value, ","):
                raise ConfigError(f"{source}.api_keys_env: environment variable {env} is unset or empty")
            keys += parse_keys(value, ",")
        return cls(keys)

    def accepts(self, authorization: str | None) -> bool:
        """True when the port is open, or `Authorization: Bearer <key>` names an accepted key."""
        if not self._digests:
            return True
        if not authorization:
            return False
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        offered = _digest(key.strip())
        ok = False
        for digest in self._digests:  # every digest compared: the time does not say which key is near
            ok |= hmac.compare_digest(digest, offered)
        return ok
