"""Service tiers and tenants (pure): which tier a request is served in, and which tenant its API key belongs to.

A request's tier is OpenAI's `service_tier` field (`priority`, `default`, `flex`; `auto` or absent: its tenant's
default), on `/v1/completions` and `/v1/chat/completions` alike. A tenant never gets a tier above its entry's
`max_tier`: a higher one asked for is served at `max_tier`, as OpenAI serves a project without access to
`priority` at `default`. A request whose key names no tenant (or a mesh without keys) is served at `default` at
most. Any other `service_tier` value is a 400 naming the field.

Engines started with vLLM's `--scheduling-policy priority` get the tier as vLLM's `priority` request field
(`ENGINE_PRIORITY`): vLLM serves a smaller value first, ties by arrival (vllm/v1/core/sched/request_queue.py,
`PriorityRequestQueue`), and refuses any non-zero value when its policy is not `priority`
(vllm/v1/engine/processor.py), so `default` is 0, what an engine gets from a client that sends nothing.

Tenants come from the mesh file (`coordinator.tenants`) and a reloadable file (`coordinator.tenants_file`, the same
list under `tenants:`); `parse_tenants_file` turns a file's text into entries or a one-line ConfigError.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from coordinator.errors import OpenAIError
from tandem.config_file import ConfigError


class Tier(StrEnum):
    """A service tier, spelled as OpenAI's `service_tier` values."""

    FLEX = "flex"
    DEFAULT = "default"
    PRIORITY = "priority"


#: Higher serves first.
TIER_RANK = {Tier.FLEX: 0, Tier.DEFAULT: 1, Tier.PRIORITY: 2}
#: vLLM's `priority` request field per tier (smaller is scheduled first; 0 is what a plain request gets).
ENGINE_PRIORITY = {Tier.PRIORITY: -1, Tier.DEFAULT: 0, Tier.FLEX: 1}
#: The values OpenAI accepts for `service_tier`.
SERVICE_TIERS = ("auto", "default", "flex", "priority")


class TenantSpec(BaseModel):
    """One tenant: its API keys, its tiers and its quotas (`coordinator.tenants[]`, or an entry of the tenants
    file). A quota left out (null) does not bind."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """The tenant's name (a metric label: letters, digits, `_.-`)."""
    keys: list[str] = Field(min_length=1)
    """Its API keys (`Authorization: Bearer <key>`); they are accepted keys of the OpenAI port too."""
    default_tier: Tier = Tier.DEFAULT
    """The tier of a request that sends no `service_tier` (or `auto`)."""
    max_tier: Tier = Tier.DEFAULT
    """The highest tier it may ask for; a higher one is served at this tier."""
    requests_per_minute: int | None = Field(default=None, gt=0)
    """Requests a minute (a token bucket of this size refilled evenly over a minute)."""
    tokens_per_minute: int | None = Field(default=None, gt=0)
    """Tokens a minute: prompt plus `max_tokens` when admitted, corrected when the request ends."""
    max_concurrency: int | None = Field(default=None, gt=0)
    """Requests in flight at once."""

    @model_validator(mode="after")
    def _default_within_max(self) -> TenantSpec:
        if TIER_RANK[self.default_tier] > TIER_RANK[self.max_tier]:
            raise ValueError(f"default_tier {self.default_tier} is above max_tier {self.max_tier}")
        if any(not k.strip() or k != k.strip() for k in self.keys):
            raise ValueError("keys: a key is empty or has surrounding spaces")
        return self


def check_unique(specs: Iterable[TenantSpec], where: str) -> list[TenantSpec]:
    """The entries, refused with a ConfigError when two share a name or a key."""
    names: set[str] = set()
    keys: set[str] = set()
    out = list(specs)
    for spec in out:
        if spec.name in names:
            raise ConfigError(f"{where}: tenant {spec.name!r} appears twice")
        names.add(spec.name)
        for key in spec.keys:
            if key in keys:
                raise ConfigError(f"{where}: tenant {spec.name!r} reuses another tenant's key")
            keys.add(key)
    return out


def parse_tenants_file(text: str, where: str = "coordinator.tenants_file") -> list[TenantSpec]:
    """The entries of a tenants file (`tenants: [...]`); a one-line ConfigError naming the first problem."""
    try:
        data = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not YAML: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
        raise ConfigError(f"{where}: expected a mapping with a `tenants:` list")
    if set(data) != {"tenants"}:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(map(str, set(data) - {'tenants'})))}")
    specs = []
    for i, entry in enumerate(data["tenants"]):
        try:
            specs.append(TenantSpec.model_validate(entry))
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            at = f"tenants[{i}]" + (f".{loc}" if loc else "")
            raise ConfigError(f"{where}: {at}: {first['msg']}") from None
    return check_unique(specs, where)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantTable:
    """Tenants by API key (kept as SHA-256 digests, compared in constant time like `ApiKeys`)."""

    def __init__(self, specs: Iterable[TenantSpec] = ()) -> None:
        self.specs: dict[str, TenantSpec] = {}
        self._keys: list[tuple[bytes, TenantSpec]] = []
        for spec in specs:
            self.specs[spec.name] = spec
            self._keys += [(_digest(k), spec) for k in spec.keys]

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def keys(self) -> list[str]:
        """Every tenant's keys (accepted by the OpenAI port)."""
        return [k for spec in self.specs.values() for k in spec.keys]

    def tenant_of(self, authorization: str | None) -> TenantSpec | None:
        """The tenant whose key `Authorization: Bearer <key>` names; None for none."""
        if not self._keys or not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        offered = _digest(key.strip())
        found = None
        for digest, spec in self._keys:  # every digest compared: the time does not say which key is near
            if hmac.compare_digest(digest, offered):
                found = spec
        return found


def requested_tier(body: dict[str, Any]) -> str | None:
    """The body's `service_tier` (None for absent or `auto`); OpenAIError 400 for a value OpenAI refuses."""
    value = body.get("service_tier")
    if value is None or value == "auto":
        return None
    if not isinstance(value, str) or value not in SERVICE_TIERS:
        raise OpenAIError(
            400,
            f"Invalid value for 'service_tier': {json.dumps(value)}. Supported values are: "
            + ", ".join(f"'{t}'" for t in SERVICE_TIERS)
            + ".",
            "service_tier",
            code="invalid_value",
        )
    return value


def resolve_tier(asked: str | None, tenant: TenantSpec | None) -> Tier:
    """The tier a request is served in: what it asked for (None: its tenant's default), never above its tenant's
    `max_tier` (`default` without a tenant)."""
    ceiling = tenant.max_tier if tenant is not None else Tier.DEFAULT
    tier = Tier(asked) if asked is not None else (tenant.default_tier if tenant is not None else Tier.DEFAULT)
    return tier if TIER_RANK[tier] <= TIER_RANK[ceiling] else ceiling
