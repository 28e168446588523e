"""The routing-quality SLI on the held-out reuse workload (issue 25: "the predicted-vs-delivered hit histograms show
the prediction error per instance"): the `policies_pressure` workload (`tenants_rag`, seed 7, 4 simengines with
1,024 blocks, 50% of round robin's capacity) replayed in real time through a `make run`-style mesh (`tandem up`,
mutual TLS) on kv_affinity, then read as an operator reads it.

    python -m bench.sli [--requests 400] [--output docs/bench/sli.md] [bench.policies' workload options]

Per instance, two sources:
- the coordinator's `/metrics` (docs/operations.md "Routing quality"): requests routed there (the count of
  `tandem_coordinator_predicted_request_hit_tokens`), the predicted hit tokens per request
  (`predicted_hit_tokens_total` over it) and the delivered ones (`delivered_hit_tokens_total`, the growth of the
  engine's `vllm:prefix_cache_hits_total` carried by heartbeats, over the same requests);
- per request, what the coordinator predicted (`Admin/ListDecisions`, through Envoy with the operator's
  certificate: the chosen instance's expected cached tokens, every tier, capped at the prompt) against what the
  engine found (its `usage.prompt_tokens_details.cached_tokens`, engines run with `--enable-prompt-tokens-details`
  as vLLM), paired by the request id the coordinator minted (the engine answers `cmpl-<that id>`): the mean
  absolute error and the share of requests whose error exceeds one KV block.

Hit counts, not timings: the machine's load changes which requests overlap (and so which prefixes are cached when
a request arrives), not how the figures are read; the load average at the start and end is in the caption.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench.policies import add_arguments, load_rate, run_row
from bench.replay import ReplayResult
from bench.trace import load_trace
from tandem.tokenizer import load_tokenizer
from tandem.version import __version__

MODEL = "tandem-sim"
BLOCK = 16  # the simengines' (and the mesh's) KV block size, tokens


@dataclass
class InstanceSli:
    """One instance's figures (see the module docstring)."""

    instance: str
    requests: int = 0  # routed there (`/metrics`)
    predicted_tokens: float = 0.0  # predicted hit tokens summed (`/metrics`)
    delivered_tokens: float = 0.0  # hit tokens the engine reported (`/metrics`)
    pairs: list[tuple[int, int]] | None = None  # per paired request: (predicted, delivered) hit tokens

    def mean(self, total: float) -> float:
        return total / self.requests if self.requests else float("nan")


def from_metrics(text: str, model: str = MODEL) -> dict[str, InstanceSli]:
    """Per instance of `model`, requests and predicted / delivered hit tokens from the coordinator's `/metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, InstanceSli] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != model or "instance" not in s.labels:
                continue
            row = out.setdefault(s.labels["instance"], InstanceSli(s.labels["instance"]))
            if (
                s.name == "tandem_coordinator_predicted_request_hit_tokens_count"
                and s.labels.get("tier") == "npu"
            ):
                row.requests = int(s.value)  # one observation per routed request per tier
            elif s.name == "tandem_coordinator_predicted_hit_tokens_total":
                row.predicted_tokens = s.value
            elif s.name == "tandem_coordinator_delivered_hit_tokens_total":
                row.delivered_tokens = s.value
    return out


def predicted_hits(decision) -> tuple[str, int] | None:
    """(chosen instance, its expected cached prompt tokens, every tier, capped at the prompt) of one
    `Admin/ListDecisions` decision; None for a decision with no single chosen instance."""
    if len(decision.chosen) != 1:
        return None
    (chosen,) = decision.chosen
    c = next((c for c in decision.candidates if c.instance_id == chosen), None)
    if c is None:
        return None
    return chosen, min(
        c.matched_npu_tokens + c.matched_cpu_tokens + c.matched_disk_tokens, decision.prompt_tokens
    )


def pair(decisions, answers: list[tuple[str, dict]]) -> tuple[dict[str, list[tuple[int, int]]], int]:
    """Per instance, (predicted, delivered) hit tokens of every answered request found among `decisions`
    (`Admin/ListDecisions`; delivered: the engine's `cached_tokens`), and how many answers had no decision left to
    pair with."""
    predicted = {}
    for d in decisions:
        hit = predicted_hits(d)
        if hit is not None:
            predicted[d.request_id] = hit
    pairs: dict[str, list[tuple[int, int]]] = {}
    unpaired = 0
    for rid, usage in answers:
        hit = predicted.get(rid.removeprefix("cmpl-"))
        if hit is None:
            unpaired += 1
            continue
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        pairs.setdefault(hit[0], []).append((hit[1], cached))
    return pairs, unpaired


def table(rows: dict[str, InstanceSli], block: int = BLOCK) -> str:
    """The per-instance markdown table (and the fleet's row)."""
    lines = [
        "| instance | requests | mean predicted hit tokens | mean delivered hit tokens (engine counter) "
        "| paired requests | mean predicted (paired) | mean cached_tokens (paired) | mean absolute error "
        f"| mean error (delivered - predicted) | share with abs error > {block} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    everyone = InstanceSli("all", pairs=[])
    for iid in sorted(rows):
        r = rows[iid]
        everyone.requests += r.requests
        everyone.predicted_tokens += r.predicted_tokens
        everyone.delivered_tokens += r.delivered_tokens
        everyone.pairs = [*(everyone.pairs or []), *(r.pairs or [])]
    nan = float("nan")
    for r in [*(rows[i] for i in sorted(rows)), everyone]:
        pairs = r.pairs or []
        errs = [d - p for p, d in pairs]
        predicted = statistics.fmean(p for p, _ in pairs) if pairs else nan
        delivered = statistics.fmean(d for _, d in pairs) if pairs else nan
        mae = statistics.fmean(abs(e) for e in errs) if errs else nan
        bias = statistics.fmean(errs) if errs else nan
        over = sum(abs(e) > block for e in errs) / len(errs) if errs else nan
        name = "**all**" if r is everyone else f"`{r.instance}`"
        lines.append(
            f"| {name} | {r.requests} | {r.mean(r.predicted_tokens):.1f} | {r.mean(r.delivered_tokens):.1f} "
            f"| {len(pairs)} | {predicted:.1f} | {delivered:.1f} | {mae:.1f} | {bias:+.1f} | {over:.1%} |"
        )
    return "\n".join(lines)


def _metrics(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        return resp.read().decode()


def observe(mesh, config: dict, engines: list[str], result: ReplayResult) -> dict:
    """What an operator reads after the replay: the coordinator's `/metrics` once the engines' heartbeats have
    carried every hit (the delivered total up to the engines' own, or steady for four heartbeats; at most 20 s),
    and `Admin/ListDecisions`."""
    from bench.engines import prefix_totals
    from tandem import tls
    from tandem.v1 import admin_pb2, admin_pb2_grpc

    address = config["coordinator"]["metrics_listen"]
    beat = config["coordinator"].get("heartbeat_interval_s", 2.0)
    engine_hits = prefix_totals(engines)[1]

    def delivered() -> float:
        return sum(r.delivered_tokens for r in from_metrics(_metrics(address)).values())

    deadline = time.monotonic() + 20
    last, steady_since = delivered(), time.monotonic()
    while time.monotonic() < deadline and last < engine_hits and time.monotonic() - steady_since < 4 * beat:
        time.sleep(beat / 2)  # a poll interval, not a wait for a result: the loop checks the counter
        now = delivered()
        if now != last:
            last, steady_since = now, time.monotonic()
    text = _metrics(address)
    creds = None if mesh.certs is None else tls.TlsFiles.for_role(mesh.certs, "operator")
    with tls.channel(config["envoy"]["grpc_listen"], creds, "envoy") as channel:
        listed = admin_pb2_grpc.AdminStub(channel).ListDecisions(admin_pb2.ListDecisionsRequest(), timeout=10)
    return {
        "metrics": text,
        "decisions": list(listed.decisions),
        "recorded": listed.recorded_total,
        "engine_hits": engine_hits,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.set_defaults(
        trace="tenants_rag",
        seed=7,
        requests=400,
        npu_blocks=1024,
        speedup=5.0,
        load=0.5,
        match_timeout_ms=100,
    )
    parser.add_argument("--output", help="write the markdown here (docs/bench/sli.md in `make bench`)")
    args = parser.parse_args(argv)
    if args.load:
        args.rate = load_rate(args)
    load_start = os.getloadavg()[0]
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    requests = load_trace(
        args.trace, args.requests, args.rate * args.speedup, load_tokenizer(None), args.seed, args.max_input,
        args.max_output,
    )  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="tandem-sli-"))
    row = run_row(
        "kv_affinity", args, requests, workdir,
        extra_engine_args=["--enable-prompt-tokens-details"],
        coordinator={"recent_decisions": 2 * len(requests) + 64},  # every decision kept for the pairing
        observe=observe,
    )  # fmt: skip
    load_end = os.getloadavg()[0]
    seen = row.observed
    rows = from_metrics(seen["metrics"])
    decisions = seen["decisions"]
    pairs, unpaired = pair(decisions, row.result.answers)
    for iid, paired in pairs.items():
        rows.setdefault(iid, InstanceSli(iid)).pairs = paired
    r = row.result
    text = "\n".join([
        f"Held-out reuse workload: {args.trace} seed {args.seed}, {len(requests)} requests (inputs <= "
        f"{args.max_input} tokens, outputs <= {args.max_output}) replayed in real time at {args.load:g} of round "
        f"robin's prefill capacity through a `tandem up` mesh (mutual TLS) of {args.engines} simengines "
        f"({args.npu_blocks} NPU blocks of {BLOCK} tokens, speedup {args.speedup:g}, "
        "`--enable-prompt-tokens-details`), policy kv_affinity. "
        f"{started} UTC, load average {load_start:.2f} at the start and {load_end:.2f} at the end; tandem "
        f"{__version__}.",
        "",
        table(rows),
        "",
        f"Requests: {len(requests)} sent, {len(r.answers)} answered, {r.errors} failed; {seen['recorded']} "
        f"decisions recorded, {len(decisions)} listed, {unpaired} answers without a decision to pair with. The "
        f"engines' prefix-cache hits grew by {seen['engine_hits']:.0f} tokens; the coordinator's delivered total "
        f"is {sum(x.delivered_tokens for x in rows.values()):.0f} (heartbeats carry the engines' counters). "
        "Requests, mean predicted and mean delivered are the coordinator's `/metrics` (per instance over time: "
        "delivered is the engine's counter divided by the requests routed there); the error columns pair each "
        "request's prediction (`Admin/ListDecisions`) with the engine's `cached_tokens` for it. Positive errors: "
        "the engine found more than predicted; negative: predicted hits that were not there when the request was "
        "scheduled (evicted, or still being computed by an earlier request of the same prefix). The engine counter "
        "(`vllm:prefix_cache_hits_total`) counts each request once, when the scheduler admits it (as vLLM 0.32), "
        "so the counter-based mean and the per-request `cached_tokens` agree; a request readmitted after a "
        "preemption is left out of the counter, as vLLM leaves it.",
    ])  # fmt: skip
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    return 0 if r.answers else 1


if __name__ == "__main__":
    sys.exit(main())
