"""`tandem top`: a live terminal view of a mesh, read once a second from the coordinator's Admin API through Envoy's
control listener with the operator's certificate (as grpcurl and `tandem agent stop` reach it).

What it shows, and where each figure comes from (nothing is estimated here that Admin does not give):

- per instance (`Admin/ListInstances`): health (and drained), the engine's running and waiting requests and KV cache
  use (its last heartbeat), the requests the coordinator has in flight there, the prompt tokens committed and not
  yet prefilled ("queued prefill") and the decode tokens committed, and the engine's prefix-cache hit rate: found
  cached over prompt tokens computed, from the counters its heartbeats carry (`RankProgress`), over the last ten
  seconds and since the engine started, its last heartbeat's age and how long it has been registered (`UP`: an
  engine its agent restarted registers again, so a restart faster than a refresh still shows as a short `UP`). An
  instance that was listed and is no longer is shown `GONE` (an engine whose agent deregistered it) until it comes
  back;
- per service tier (`Admin/GetStats` `ttft_slo`, `queues`): TTFT objective attainment (streamed requests whose
  first token came within the tier's `ttft_slo_s`), requests waiting in the admission queue, and those it shed;
- per P/D model: the legs in flight (requests in flight on its prefill and on its decode instances), the sizing
  signal's utilisation per role and the split it suggests (`sizing`).

- recent routing decisions (`Admin/ListDecisions`, the newest `DECISIONS_SHOWN`): when, the request id, model,
  policy and stage, the chosen instance(s) with the score components the policy saw for them (prompt tokens found
  cached, queued prefill, predicted TTFT), and the same, shorter, for every other candidate. The figures are the
  ones a sampled `tandem.score` trace span carries (docs/operations.md "Tracing"). A coordinator too old to serve
  `ListDecisions` is named in the panel, the rest of the screen still shown.

Pure: `Sample`, `hit_rate` and `render` decide what is shown; `run` polls and draws.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tandem.v1 import admin_pb2, admin_pb2_grpc, common_pb2

#: Seconds of samples the windowed hit rate spans.
HIT_WINDOW_S = 10.0
#: Recent decisions shown (the newest).
DECISIONS_SHOWN = 8
_HEALTH_STYLE = {"HEALTHY": "green", "STARTING": "yellow", "UNHEALTHY": "bold red", "GONE": "bold red"}


@dataclass(slots=True)
class Sample:
    """One poll of Admin: the instances and the stats, when taken (monotonic seconds)."""

    at: float
    instances: list[admin_pb2.InstanceStatus]
    stats: admin_pb2.GetStatsResponse
    #: The newest decisions, newest first; None when the coordinator does not serve `ListDecisions`.
    decisions: list[admin_pb2.Decision] | None = field(default_factory=list)


@dataclass
class History:
    """The recent samples (for rates) and every instance seen (to show one that vanished)."""

    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=64))
    seen: dict[str, admin_pb2.InstanceStatus] = field(default_factory=dict)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        while len(self.samples) > 2 and sample.at - self.samples[1].at >= HIT_WINDOW_S:
            self.samples.popleft()
        for s in sample.instances:
            self.seen[s.instance.instance_id] = s


def _progress(status: admin_pb2.InstanceStatus) -> tuple[int, int]:
    """(prefix-cache hits, prompt tokens) summed over the instance's ranks."""
    ranks = status.load.progress
    return sum(r.prefix_cache_hits_total for r in ranks), sum(r.prompt_tokens_total for r in ranks)


def hit_rate(before: admin_pb2.InstanceStatus | None, now: admin_pb2.InstanceStatus) -> float | None:
    """Prompt tokens found cached over prompt tokens computed between two samples of one instance (since the start
    with `before` None); None when no prompt token was computed (or the engine restarted in between)."""
    hits, prompts = _progress(now)
    if before is not None:
        hits0, prompts0 = _progress(before)
        if hits < hits0 or prompts < prompts0:
            return None
        hits, prompts = hits - hits0, prompts - prompts0
    return hits / prompts if prompts > 0 else None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _duration(seconds: float) -> str:
    """`42s`, `17m`, `5h`, `3d`: how long an instance has been registered, at a glance."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _role(status: admin_pb2.InstanceStatus) -> str:
    return common_pb2.Role.Name(status.instance.role).removeprefix("ROLE_").lower()


def _health(status: admin_pb2.InstanceStatus | None) -> str:
    if status is None:
        return "GONE"
    return common_pb2.Health.Name(status.health).removeprefix("HEALTH_")


def _instances_table(history: History, now: Sample) -> Table:
    table = Table(title="instances", title_justify="left", expand=True)
    for name in ("INSTANCE", "MODEL", "ROLE", "NODE", "HEALTH", "RUN", "WAIT", "KV%", "INFLIGHT"):
        table.add_column(name, no_wrap=True)
    for name in ("QUEUED PREFILL", "DECODE TOK", f"HIT {HIT_WINDOW_S:.0f}s", "HIT ALL", "HEARTBEAT", "UP"):
        table.add_column(name, no_wrap=True, justify="right")
    current = {s.instance.instance_id: s for s in now.instances}
    oldest = history.samples[0] if history.samples else None
    before = {s.instance.instance_id: s for s in oldest.instances} if oldest is not None else {}
    for iid in sorted(history.seen):
        status = current.get(iid)
        last = history.seen[iid]
        health = _health(status)
        style = _HEALTH_STYLE.get(health, "")
        if status is None:
            table.add_row(
                iid, last.instance.model, _role(last), last.instance.node_id, Text(health, style=style)
            )
            continue
        if status.drained:
            health += " drained"
        load = status.load
        window = hit_rate(before.get(iid), status) if oldest is not None and oldest is not now else None
        wall = time.time()
        beat = status.last_heartbeat_at.ToSeconds()
        age = f"{max(0.0, wall - beat):.1f}s" if beat else "-"
        # A restarted engine registers again: its UP starts over.
        registered = status.registered_at.ToSeconds()
        table.add_row(
            iid, status.instance.model, _role(status), status.instance.node_id, Text(health, style=style),
            str(load.running_requests), str(load.waiting_requests), f"{100 * load.kv_cache_usage:.0f}",
            str(status.inflight_requests), str(status.prefill_tokens), str(status.decode_tokens),
            _percent(window), _percent(hit_rate(None, status)), age,
            _duration(wall - registered) if registered else "-",
        )  # fmt: skip
    return table


def _tiers_table(stats: admin_pb2.GetStatsResponse) -> Table | None:
    queues: dict[str, list[int]] = {}
    for q in stats.queues:
        row = queues.setdefault(q.tier, [0, 0])
        row[0] += q.queued_now
        row[1] += q.shed_saturated + q.shed_expired + q.shed_displaced + q.shed_late
    tiers = sorted({s.tier for s in stats.ttft_slo} | set(queues))
    if not tiers:
        return None
    table = Table(title="service tiers", title_justify="left")
    for name in ("TIER", "TTFT SLO", "MEASURED", "WITHIN SLO", "ATTAINMENT", "QUEUED NOW", "SHED"):
        table.add_column(name, no_wrap=True, justify="right")
    slos = {s.tier: s for s in stats.ttft_slo}
    for tier in tiers:
        slo = slos.get(tier)
        queued, shed = queues.get(tier, ["-", "-"])
        if slo is None:
            table.add_row(tier, "-", "0", "0", "-", str(queued), str(shed))
            continue
        attained = slo.within_slo / slo.measured if slo.measured else None
        table.add_row(
            tier, f"{slo.ttft_slo_seconds:g}s", str(slo.measured), str(slo.within_slo), _percent(attained),
            str(queued), str(shed),
        )  # fmt: skip
    return table


def _pd_table(now: Sample) -> Table | None:
    legs: dict[str, dict[str, int]] = {}
    for s in now.instances:
        role = _role(s)
        if role in ("prefill", "decode"):
            counts = legs.setdefault(s.instance.model, {"prefill": 0, "decode": 0})
            counts[role] += s.inflight_requests
    if not legs:
        return None
    sizing = {z.model: z for z in now.stats.sizing}
    table = Table(title="P/D", title_justify="left")
    for name in (
        "MODEL",
        "PREFILL LEGS",
        "DECODE LEGS",
        "PREFILL UTIL",
        "DECODE UTIL",
        "INSTANCES P:D",
        "SUGGESTED",
    ):
        table.add_column(name, no_wrap=True, justify="right")
    for model in sorted(legs):
        z = sizing.get(model)
        if z is None:
            table.add_row(model, str(legs[model]["prefill"]), str(legs[model]["decode"]))
            continue
        table.add_row(
            model, str(legs[model]["prefill"]), str(legs[model]["decode"]), f"{z.prefill_utilisation:.2f}",
            f"{z.decode_utilisation:.2f}", f"{z.prefill_instances}:{z.decode_instances}",
            f"{z.suggested_prefill_instances}:{z.suggested_decode_instances}",
        )  # fmt: skip
    return table


def _seconds(value: float) -> str:
    return f"{1000 * value:.0f}ms" if value < 1 else f"{value:.2f}s"


def _hit(c: admin_pb2.CandidateScore) -> int:
    """Prompt tokens the candidate was expected to have cached, every tier."""
    return c.matched_npu_tokens + c.matched_cpu_tokens + c.matched_disk_tokens


def _decisions_table(decisions: list[admin_pb2.Decision] | None) -> Table | Text:
    if decisions is None:
        return Text("recent decisions: this coordinator does not serve Admin/ListDecisions (older version)")
    table = Table(title="recent decisions", title_justify="left", expand=True)
    for name in ("TIME", "REQUEST", "MODEL", "POLICY", "STAGE", "CHOSEN"):
        table.add_column(name, no_wrap=True)
    for name in ("PROMPT", "HIT TOK", "QUEUED", "PRED TTFT"):
        table.add_column(name, no_wrap=True, justify="right")
    table.add_column("OTHER CANDIDATES (hit tok / queued / pred ttft)", no_wrap=True, overflow="ellipsis")
    for d in decisions:
        chosen = [c for c in d.candidates if c.chosen]
        others = sorted((c for c in d.candidates if not c.chosen), key=lambda c: c.instance_id)
        ttft = (
            d.predicted_ttft_seconds if d.stage == "pair" else sum(c.predicted_ttft_seconds for c in chosen)
        )
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(d.decided_at.seconds)), d.request_id, d.model, d.policy,
            d.stage, ",".join(d.chosen), str(d.prompt_tokens), "/".join(str(_hit(c)) for c in chosen),
            "/".join(str(c.prefill_tokens) for c in chosen), _seconds(ttft),
            "  ".join(f"{c.instance_id} {_hit(c)}/{c.prefill_tokens}/{_seconds(c.predicted_ttft_seconds)}"
                      for c in others),
        )  # fmt: skip
    return table


def render(history: History, source: str, error: str | None = None) -> Group:
    """The whole screen for the latest sample of `history` (and `error`, the last poll's failure, if any)."""
    parts: list = []
    now = history.samples[-1] if history.samples else None
    header = Text(f"tandem top  {source}  {time.strftime('%H:%M:%S')}", style="bold")
    if now is not None:
        s = now.stats
        header.append(
            f"   policy {s.policy}   routed {s.requests_routed}   rejected {s.requests_rejected}"
            f"   in flight {s.requests_inflight}   committed {s.workload_tokens} tok",
            style="",
        )
    parts.append(header)
    if error:
        parts.append(Text(f"Admin unreachable: {error} (retrying every second)", style="bold red"))
    if now is not None:
        parts.append(_instances_table(history, now))
        tables: Iterable[Table | None] = (_tiers_table(now.stats), _pd_table(now))
        parts.extend(t for t in tables if t is not None)
        parts.append(_decisions_table(now.decisions))
    parts.append(Text("Ctrl-C quits.", style="dim"))
    return Group(*parts)


def poll(stub: admin_pb2_grpc.AdminStub, timeout: float = 2.0) -> Sample:
    import grpc

    instances = stub.ListInstances(admin_pb2.ListInstancesRequest(), timeout=timeout).instances
    stats = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=timeout)
    decisions: list[admin_pb2.Decision] | None
    try:
        listed = stub.ListDecisions(admin_pb2.ListDecisionsRequest(limit=DECISIONS_SHOWN), timeout=timeout)
        decisions = list(listed.decisions)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        decisions = None
    return Sample(time.monotonic(), list(instances), stats, decisions)


def _error(exc: Exception) -> str:
    import grpc

    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def run(
    channel, source: str, interval: float = 1.0, once: bool = False, console: Console | None = None
) -> int:
    """Polls Admin over `channel` every `interval` seconds and redraws, until Ctrl-C (`once`: one frame, printed;
    exit code 1 when Admin did not answer)."""
    import grpc

    stub = admin_pb2_grpc.AdminStub(channel)
    history = History()
    console = console or Console()
    if once:
        try:
            history.add(poll(stub))
        except grpc.RpcError as exc:
            console.print(render(history, source, _error(exc)))
            return 1
        console.print(render(history, source))
        return 0
    with Live(render(history, source), console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                started = time.monotonic()
                error = None
                try:
                    history.add(poll(stub))
                except grpc.RpcError as exc:
                    error = _error(exc)
                live.update(render(history, source, error), refresh=True)
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
        except KeyboardInterrupt:
            return 0
