"""Tenant quotas (pure): requests a minute, tokens a minute and requests in flight, per tenant.

The algorithm is a token bucket per tenant and per kind (requests, tokens): a bucket holds at most the per-minute
limit and refills continuously at limit/60 a second; a request takes one from the requests bucket and its token
estimate (prompt tokens plus every choice's `max_tokens`) from the tokens bucket, or is refused whole (429) when
either cannot give it. Chosen over a sliding window because it is O(1) state per tenant (a window keeps one entry
per request it counts), it never lets twice the limit through at a window's edge, a refund at the end of a request
is one addition, and it is what OpenAI's headers describe: `x-ratelimit-reset-*` is "the time until the rate limit
resets to its initial state", i.e. until the bucket is full again. A tenant that has been idle can send a whole
minute's worth at once (the bucket's size); tune the limit, not the burst.

When a request ends its token charge is corrected: prompt plus the output tokens it can at most have produced
(`output_bound`, from the size of its response: an answer carries at least a byte per token, a streamed one at
least `STREAM_BYTES_PER_TOKEN` per token, so the bound never undercharges), the difference going back into the
bucket. Concurrency is released on every end of a request: completion, the client leaving, an engine error, a
decision that never reached Envoy, a ticket that expired (`Quotas.settle`, run by the ticket's release).

**Mesh-wide, with coordinator replicas** (`coordinator.etcd`): every replica keeps a copy of every tenant's buckets,
refilled alike, and drains them with what the *other* replicas took too. Each replica publishes its own use since
it started (`share`: requests and net tokens taken per tenant, and requests in flight) to etcd every
`SHARE_INTERVAL_S`; every other replica applies the increase since the last share it saw (`peer`) to its buckets
and counts the peer's requests in flight against `max_concurrency`. How exact: a tenant can exceed a limit by
what the other replicas admitted within one share's delay (an interval plus etcd's watch latency, about 0.3 s),
i.e. by at most `(replicas - 1) x rate x delay`; docs/scheduling.md has the measurement. A replica's first share
seen is its baseline (its earlier use is not charged again); a replica that dies takes its requests in flight with
it when its key's lease ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.errors import OpenAIError
from coordinator.tenants import TenantSpec

#: The fewest bytes a streamed response spends per output token (an SSE `data:` chunk of one token is ~150 bytes).
STREAM_BYTES_PER_TOKEN = 64
#: `retry-after` when only the concurrency limit binds (no bucket says when a request in flight ends).
CONCURRENCY_RETRY_S = 1.0
#: How often a replica publishes its use for the others (mesh-wide quotas).
SHARE_INTERVAL_S = 0.2


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's `x-ratelimit-reset-*` headers write it (Go's form): `17ms`, `1s`, `6m0s`, `1.5s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


@dataclass(slots=True)
class Bucket:
    """A token bucket of `capacity`, refilled at `capacity / 60` a second."""

    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (inf when it never can)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) * 60.0 / self.capacity)

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.level) * 60.0 / self.capacity)


@dataclass(slots=True)
class TenantUsage:
    """One tenant's buckets and requests in flight."""

    requests: Bucket | None = None
    tokens: Bucket | None = None
    in_flight: int = 0
    taken_requests: int = 0  # admitted by this replica since it started (published for the others)
    taken_tokens: int = 0  # charged by this replica, net of refunds


#: A replica's published use of one tenant: (requests taken, net tokens taken, requests in flight).
Use = tuple[int, int, int]


@dataclass(slots=True)
class Admission:
    """An admitted request's hold on its tenant's quota; settled once when it ends."""

    tenant: str
    tokens: int  # charged on admission
    prompt_tokens: int
    headers: list[tuple[str, str]] = field(default_factory=list)  # the x-ratelimit-* headers of the reply
    settled: bool = False


@dataclass(slots=True)
class QuotaCounters:
    """What the quotas did since start (Admin/GetStats, metrics)."""

    admitted: dict[str, int] = field(default_factory=dict)  # by tenant
    limited: dict[str, int] = field(default_factory=dict)  # by tenant: answered 429
    refunded_tokens: dict[str, int] = field(default_factory=dict)  # by tenant


def _limit_headers(spec: TenantSpec, usage: TenantUsage) -> list[tuple[str, str]]:
    headers = []
    for kind, bucket in (("requests", usage.requests), ("tokens", usage.tokens)):
        if bucket is None:
            continue
        headers += [
            (f"x-ratelimit-limit-{kind}", str(int(bucket.capacity))),
            (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(bucket.level)))),
            (f"x-ratelimit-reset-{kind}", go_duration(bucket.reset_s)),
        ]
    return headers


class RateLimited(OpenAIError):
    """429 in OpenAI's shape: `{"error": {"message", "type": "requests"|"tokens", "param": null, "code":
    "rate_limit_exceeded"}}`, with `retry-after` (seconds) and `retry-after-ms`, and the x-ratelimit-* headers."""

    def __init__(self, message: str, kind: str, retry_after_s: float, headers: list[tuple[str, str]]) -> None:
        super().__init__(429, message, None, code="rate_limit_exceeded")
        self.kind = kind
        self.retry_after_s = retry_after_s
        retry = []
        if math.isfinite(retry_after_s):  # a request that can never fit gets none: retrying cannot help
            retry = [
                ("retry-after", str(max(1, math.ceil(retry_after_s)))),
                ("retry-after-ms", str(max(1, math.ceil(retry_after_s * 1000)))),
            ]
        self.headers = headers + retry

    def __reduce__(self):
        return (RateLimited, (self.message, self.kind, self.retry_after_s, self.headers))

    @property
    def type(self) -> str:
        return self.kind


class Quotas:
    """Every tenant's quota state; `admit` on a request's decision, `settle` at its end. `clock`: monotonic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.usage: dict[str, TenantUsage] = {}
        self.counters = QuotaCounters()
        self.peers: dict[str, dict[str, Use]] = {}  # the other replicas' last share seen, by replica

    def share(self) -> dict[str, Use]:
        """This replica's use per tenant since it started, for the other replicas."""
        return {
            name: (u.taken_requests, u.taken_tokens, u.in_flight)
            for name, u in self.usage.items()
            if u.taken_requests or u.in_flight
        }

    def peer(self, replica: str, share: dict[str, Use] | None, specs: dict[str, TenantSpec]) -> None:
        """Another replica's share (None: it is gone): its use since its last share drains this replica's buckets
        (a refund fills them); its requests in flight count against `max_concurrency`. The first share of a
        replica is only its baseline."""
        if share is None:
            self.peers.pop(replica, None)
            return
        before = self.peers.get(replica)
        self.peers[replica] = share
        if before is None:
            return
        now = self.clock()
        for name, (requests, tokens, _) in share.items():
            spec = specs.get(name)
            if spec is None:
                continue
            usage = self._usage(spec, now)
            old_requests, old_tokens, _ = before.get(name, (0, 0, 0))
            if usage.requests is not None:
                usage.requests.level -= requests - old_requests
            if usage.tokens is not None:
                usage.tokens.level = min(usage.tokens.capacity, usage.tokens.level - (tokens - old_tokens))

    def peers_in_flight(self, tenant: str) -> int:
        """The tenant's requests in flight on the other replicas, as they last said."""
        return sum(share.get(tenant, (0, 0, 0))[2] for share in self.peers.values())

    def _usage(self, spec: TenantSpec, now: float) -> TenantUsage:
        usage = self.usage.get(spec.name)
        if usage is None:
            usage = self.usage[spec.name] = TenantUsage()
        # Buckets follow the spec (a reload may change or remove a limit; a changed size keeps the level, capped).
        for kind, limit in (("requests", spec.requests_per_minute), ("tokens", spec.tokens_per_minute)):
            bucket = getattr(usage, kind)
            if limit is None:
                setattr(usage, kind, None)
            elif bucket is None:
                setattr(usage, kind, Bucket(float(limit), float(limit), now))
            else:
                bucket.refill(now)
                if bucket.capacity != limit:
                    bucket.capacity = float(limit)
                    bucket.level = min(bucket.level, bucket.capacity)
        return usage

    def in_flight(self, tenant: str) -> int:
        usage = self.usage.get(tenant)
        return usage.in_flight if usage is not None else 0

    def full(self, spec: TenantSpec) -> bool:
        """Whether `spec`'s requests in flight (here and on the other replicas) are at its `max_concurrency`."""
        limit = spec.max_concurrency
        return limit is not None and self.in_flight(spec.name) + self.peers_in_flight(spec.name) >= limit

    def admit(self, spec: TenantSpec, prompt_tokens: int, max_tokens: int) -> Admission:
        """Takes one request and `prompt_tokens + max_tokens` tokens from `spec`'s quota; RateLimited (429) when
        a limit binds (nothing is taken then)."""
        now = self.clock()
        usage = self._usage(spec, now)
        tokens = prompt_tokens + max_tokens
        name = spec.name
        waits: list[tuple[float, str, str]] = []
        if usage.requests is not None and usage.requests.level < 1:
            limit = int(usage.requests.capacity)
            wait = usage.requests.wait_for(1)
            waits.append(
                (
                    wait,
                    "requests",
                    f"Rate limit reached for tenant {name} on requests per min (RPM): Limit {limit}.",
                )
            )
        if usage.tokens is not None and usage.tokens.level < tokens:
            limit = int(usage.tokens.capacity)
            wait = usage.tokens.wait_for(tokens)
            if math.isinf(wait):
                message = (
                    f"Request too large for tenant {name} on tokens per min (TPM): Limit {limit}, Requested "
                    f"{tokens} (prompt plus max_tokens). Lower max_tokens or shorten the prompt."
                )
            else:
                used = limit - max(0, math.floor(usage.tokens.level))
                message = (
                    f"Rate limit reached for tenant {name} on tokens per min (TPM): Limit {limit}, Used {used}, "
                    f"Requested {tokens}."
                )
            waits.append((wait, "tokens", message))
        if self.full(spec):
            waits.append(
                (
                    CONCURRENCY_RETRY_S,
                    "requests",
                    f"Rate limit reached for tenant {name} on requests in flight: Limit {spec.max_concurrency}.",
                )
            )
        if waits:
            wait, kind, message = max(waits, key=lambda w: w[0])
            if math.isfinite(wait):
                message += f" Please try again in {go_duration(wait)}."
            self.counters.limited[name] = self.counters.limited.get(name, 0) + 1
            raise RateLimited(message, kind, wait, _limit_headers(spec, usage))
        if usage.requests is not None:
            usage.requests.level -= 1
        if usage.tokens is not None:
            usage.tokens.level -= tokens
        usage.in_flight += 1
        usage.taken_requests += 1
        usage.taken_tokens += tokens
        self.counters.admitted[name] = self.counters.admitted.get(name, 0) + 1
        return Admission(name, tokens, prompt_tokens, _limit_headers(spec, usage))

    def settle(self, admission: Admission, output_bound: int | None = None, served: bool = True) -> None:
        """The request ended: releases its place in flight and gives back the tokens it did not use: past the
        prompt and `output_bound` output tokens; none when `output_bound` is None (unknown); all of them when it
        never reached an engine (`served` False). Once per admission."""
        if admission.settled:
            return
        admission.settled = True
        usage = self.usage.get(admission.tenant)
        if usage is None:
            return
        usage.in_flight = max(0, usage.in_flight - 1)
        if usage.tokens is None or (served and output_bound is None):
            return
        used = admission.prompt_tokens + max(0, output_bound or 0) if served else 0
        refund = admission.tokens - used
        if refund > 0:
            usage.taken_tokens -= refund
            usage.tokens.refill(self.clock())
            usage.tokens.level = min(usage.tokens.capacity, usage.tokens.level + refund)
            name = admission.tenant
            self.counters.refunded_tokens[name] = self.counters.refunded_tokens.get(name, 0) + refund


def output_bound(response_bytes: int, stream: bool, max_tokens: int) -> int:
    """The most output tokens a response of `response_bytes` can carry (see the module doc)."""
    per_token = STREAM_BYTES_PER_TOKEN if stream else 1
    return min(max_tokens, math.ceil(max(0, response_bytes) / per_token))
