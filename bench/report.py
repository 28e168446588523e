"""Fixed text of `docs/benchmarks.md`: what each benchmark measures and how to read it (figures come from runs)."""

from __future__ import annotations

INTRO = """# Benchmarks

Written by `make bench` (`python -m bench.all`); do not edit by hand, re-run it. Every figure is a ratio or a
side-by-side comparison measured in one run on the same engines and load, never an absolute time taken alone.
Simulated engines (`simengine`, ascend-910b timing profile) stand in for NPUs; "simulated ms" are wall-clock
milliseconds multiplied by the engines' `--speedup`. Each benchmark also runs alone with its own options (the
commands below; `--help` on each). Seeds are fixed: the fleet simulator's figures are identical from run to run;
the real-time figures vary with the machine's load (noted below), which other work on this machine shares.

Left out: the `aiperf` cross-check of our load generator (`bench/replay.py`) is not part of `make bench`; its
~1.2 GB install was not worth it on this 2-core machine. The P/D section compares the two P/D modes; the peer
routers' own P/D modes are not run."""

_NOTES = {
    "mtls": """What mutual TLS between components costs per request: two identical meshes (2 simulated engines
each, `least_load`), one with certificates (the default) and one with `security.insecure: true`, taking turns in
rounds at concurrency 32. Clients speak plain HTTP to the ingress in both; the difference is Envoy's ext_proc
stream to the coordinator and the component links, encrypted and authorised per call (the authorization
interceptor reads the peer's certificate identity on every gRPC call) in one and plain in the other. The CPU
column is the figure to read: the machine is shared (load average ~10 on 2 cores while these were measured), so
latency differences are mostly queueing behind that extra CPU. Five earlier runs the same afternoon gave +0.33,
+0.27, +0.08, +0.12 and (after the interceptor stopped rebuilding handlers per call) +0.08 s of CPU per 1k
requests with mTLS (coordinator +0.05 to +0.22, Envoy +0.02 to +0.11) and +3 to +21 ms p50: mutual TLS costs on
the order of 0.1-0.3 ms of CPU per request here, most of it in the coordinator's Python gRPC server.""",
    "overhead": """The same engines (`simengine --speedup 10`, 16 output tokens) reached directly (client-side
round-robin), through Tandem, and through `sglang-router` 0.3.2 and `vllm-router` 0.1.17 with round-robin and
cache-aware policies, both bound to 127.0.0.1 (Prometheus too). Tandem rows: the mesh as `tandem up` runs it, in
plain text between components like the peers and "before" (`security.insecure: true`; what mutual TLS adds is
measured on its own) (an aggregated mesh decides with one ext_authz Check per request, and learns request ends
from Envoy's access log),
`round_robin` and `kv_affinity` (which also asks the conductor); `tandem ext_proc`: the same coordinator behind a
second Envoy deciding with one ext_proc body message each way (the path P/D meshes use); `tandem before`: the main
branch's Envoy and coordinator (one ext_proc stream per request with headers and body, held open until the
response ends), exported from git and run in front of the same engines, so before and after come from one run.
"Decision path alone" sends non-streaming requests to a do-nothing upstream (one raw asyncio process answering at
once; the cache-aware peers need engine endpoints it lacks), so the added latency and CPU are the router's own.
Paths take turns in rounds. "+ p50/p99" is latency added over direct; TTFT is the first SSE data event, ITL the
gap between data events; "fresh connections" opens one TCP connection per request. CPU s / 1k requests counts
every process of the router (Tandem: Envoy, coordinator with its tokenizer worker, conductor). The load
generator (aiohttp, one Python process) shares the 2 cores with the engines, the routers and other work on the
machine (its load average is printed), so latencies are noisy; CPU per request is the steadier figure. The
"before" coordinator has no node agent or conductor attached (the bench registers the engines with it), so it
does less background work than the mesh's coordinator (agents' heartbeats, conductor health, config watch);
at concurrency 1 this favours it in both CPU per request and latency.""",
    "envoy_cost": """From issue 24 ("find which filters and access-log settings cost what by measuring them one
at a time against the prototype path"): the Envoy configuration `tandem up` renders for an aggregated mesh, run as
an Envoy of its own next to copies with one part taken out (the gRPC access log; the guards: connection limit
filter, overload manager, first-byte listener inspector and OpenAI-shaped local replies; the decision call's
retry policy; routing to the engine the decision names) and down to a plain proxy, every copy in front of the
same engines and of a do-nothing upstream, at the same request rate, taking turns. Only Envoy's own CPU is
counted. What it says: the guards, the access log, the retry policy and ORIGINAL_DST routing are each within the
run's noise; the per-request gRPC Check with the body is Envoy's whole added cost, on the order of the
prototypes' (`ext_authz` with the body and the access log, 0.17-0.21 CPU s per 1,000 requests over a 0.055 floor
at concurrency 32). At a fixed rate of 400 requests per second Envoy wakes for nearly every request, so every
row costs more than at concurrency 32 (`bench.overhead`), where a wake-up finds several.""",
    "profile": """From issue 24 ("profile, then cut"): py-spy samples the coordinator (with its tokenizer worker),
the conductor and the node agent while the overhead benchmark's non-streaming load runs through Envoy
(`kv_affinity`, plain text). The tables list the frames holding the most busy samples; "event loop / gRPC core"
is time with no Python frame below the event loop (gRPC's C core, uvloop, syscalls). What they say: about half of
the coordinator's busy time is gRPC message handling (the event loop's core, the Match stream's writes and reads)
and a quarter is the decision itself (understanding the body, the Match round trip, the policy), the policy's own
Python a few percent; so the cut that remains is fewer messages per request (a local replica of the index in place
of the Match round trip, or Match requests coalesced per event-loop turn), not faster Python. The conductor's is
the Match stream and the KV batches' decoding; the agent's, reading the engines' KV events and writing them to
the conductor's stream (batches that find nothing queued behind them wait 10 ms for others, so a steady load
travels in about a third of the messages). A thread blocked on a lock or a queue (an idle pool worker) counts as
waiting.""",
    "decision_stall": """The coordinator's decision service alone (its ext_proc servicer over gRPC, no Envoy, no
engines): small requests at concurrency 16 with one 1 MiB prompt per 100 of them, each variant in a fresh
coordinator process. Parsing and tokenizing inline on the event loop stalls every decision behind a huge
prompt; a thread pool does not help while the tokenizer holds the interpreter lock (the built-in one does); a
worker process for bodies above `coordinator.decision_inline_bytes` keeps the small decisions moving at the cost
of the huge ones' latency (they queue for the worker and cross a process boundary).""",
    "signal": """How each way of learning that a request's prefill is done follows the true queued prefill
(the committed prefill of requests routed to an instance that have no first token yet), sampled at every decision
on every instance, in the fleet simulator with the ledger's own code (`coordinator/workload.py`). "Engine
counters" is Tandem's signal: vLLM's `vllm:prompt_tokens_total` and `vllm:generation_tokens_total` relayed by the
node agent, applied by `WorkloadLedger.engine_progress`. The drift run replays 30 simulated minutes with client
aborts, an engine restart and a coordinator restart.""",
    "routing": """The routing-quality table: every policy on the same arrivals in the fleet simulator (the real
policy, index, ledger and engine-model objects), per workload, cache size (NPU blocks per engine: caches under
pressure at 2,048 and 4,096) and load level (60%, 90% and 120% of round robin's prefill capacity with unbounded
caches, so that small caches are overloaded sooner). `make bench` runs the quick grid (4 instances, one seed);
`python -m bench.fleet routing --full` adds 16 instances, the synthetic Mooncake trace and seeds 0-2 (hours on 2
cores). Peers use their real systems' load signals (Dynamo: exact first-token release; llm-d: metrics every 50
ms; SGLang: its own tree of routed prompts). The real peer routers (`sglang-router`, `vllm-router`) run only in
the real-time replay below: they cannot be put inside the simulator. The goal column holds for the kv_affinity
row, Tandem's default. The plot shows mean TTFT against cache size per policy.""",
    "policies": """Every row is a fresh mesh with the same 4 engines (empty caches) and the same seeded trace: the
Mooncake conversation trace, token ids synthesised per 512-token hash id (as whole-word tokens, so the prompt is
sent as text and tokenizes back to exactly those ids: `sglang-router` takes text prompts only), prompts capped
at 8192 tokens and outputs at 64. The peer routers run in their cache-aware modes straight in front of the
mesh's engines. The hit rate is the engines' own `vllm:prefix_cache_hits_total / queries_total`. "Match
fallbacks" counts requests the coordinator scored on load alone because the conductor missed the deadline
(100 ms here). Real-time
figures follow the machine's load (the step table's last column): on a 2-core machine shared with other work at
a load average near 20, engines at speedup 5 fall behind real time and every TTFT grows several-fold; compare
rows, not runs.""",
    "policies_pressure": """The regime where fleets hurt: 4 engines with 1,024 NPU blocks each (16k tokens, two or
three long prompts), a generated multi-tenant RAG workload (`tenants_rag`, seed 7: a population the simulator's
tables never tuned on), arrivals at 50% of round robin's prefill capacity with unbounded caches (queues build up
with these caches), text prompts as real clients send them. Every row is replayed three times, rows interleaved,
each in a fresh mesh; the second table gives the mean of the runs with half their range.""",
    "policies_pressure_moderate": """The section above at 25% of round robin's prefill capacity (`--load 0.25`): the
same 4 engines with 1,024 NPU blocks, the same `tenants_rag` seed 7 population as text prompts, three interleaved
runs per row in fresh meshes. Queues stay short here, so what separates the rows is where each router keeps a
tenant's prefix when a copy on an idle engine would answer sooner: the engines' hit rate column is the other half
of issue 20's check (at least the peers').""",
    "sli": """Issue 25's check: the coordinator's prediction of each request's cache hit against what the engine
found, per instance, on the held-out reuse workload of the section above (`tenants_rag`, seed 7, 1,024-block
engines, 50% load) replayed once through a mesh on kv_affinity. The first columns are what an operator reads on
the coordinator's `/metrics` (docs/operations.md "Routing quality"); the error columns pair each request's
prediction (`Admin/ListDecisions`) with the engine's own per-request `cached_tokens`. Hit counts, not timings.""",
    "validate": """Small enough to run in real time: 2 engines at speedup 2, 150 requests, arrivals x0.625 (the same
load per engine as the replay above). The real-time rows are `bench.policies` replays; the simulator replays the
same token ids with the same policies objects, the conductor's index and simengine's scheduler, cache and timing
model in virtual time. Each real-time row runs in a fresh client process, so that no row inherits another's client
state. On 2026-12-02 a kv_affinity mesh started second by the same process came out 16-25% above the simulator (four
runs) and within 4% as the first or only one; on 2026-12-07 three runs started second gave 2,272-2,296 simulated ms
against 2,291 alone and the simulator's 2,399, so that effect is gone (its cause was never found).""",
    "pd": """From issue 21: the same 4 simengines on one node serve a Mooncake slice aggregated (all hybrid,
kv_affinity) and disaggregated (2 prefill + 2 decode) in handoff and trigger mode under each `scheduler.pd_choice`,
a fresh mesh per row; then the fleet simulator replays the same slice with the same engines, split and rule, so
each row checks the simulator's P/D model (issue 21's bar: within 10% on mean TTFT). The engines run at speedup 2.5:
the mesh's own wall-clock costs (Envoy, the coordinator, HTTP, the client on the same 2 cores) count speedup times
over in simulated ms, and at speedup 5 they put the real side 7-15% above the simulator. The `adaptive` row is
further off (9-14% in runs since its ITL bound), and docs/pd.md ("The simulator against the real-time mesh") finds
why: the coordinator decides a burst's short prompts first (they are tokenized sooner) where the simulator keeps the
trace's order, and about 45 wall ms per P/D request in a burst count 2.5 times over (at speedup 1.25 the row is 6%
off). The answer to "should this
workload be disaggregated" is in the aggregated row against the others: a prompt-heavy chat slice (outputs of 32
tokens at most) with half the engines able to prefill loses TTFT to aggregated serving, as the simulator's P/D
table below finds at every split.""",
    "overload": """From issue 22: the fleet simulator's overload scenario (`bench/fleet/overload.py`, the
coordinator's own admission core, ledger and latency model in virtual time; docs/scheduling.md, "SLO-aware
admission", explains every row): four simulated 910B engines with vLLM's priority scheduling, half priority chat
and half flex batch traffic, 80% of capacity for 60 s, a burst at 1.5x or 3x for 30 s, 80% again; routing is
`least_load` in every row, among the engines the admission lets the request go to (Tandem's: those predicted to
meet its tier's SLO; Dynamo's: those not busy), so rows differ in admission only: none, Tandem's without and with
its headroom (as it ships), and the peers' admission reproduced from their sources. The plot shows each answered request's TTFT
against its arrival during the 3x burst. Issue 22's goal: priority keeps >= 99% SLO attainment during the bursts
while goodput over both tiers is >= 1.3x every peer row's; goodput is per tier in the table.""",
    "overload_mixed": """The same scenario on a mixed fleet: two of the four engines at half speed (every step
takes twice as long), capacity measured on that fleet. Tandem's latency model learns each engine's step costs, so
its admission sends each request only where it is predicted to meet its tier's SLO; the peers' rows decide as
their sources do.""",
    "lora": """Issue 26's LoRA routing in the fleet simulator (`bench/fleet/lora.py`): each request names an
adapter (Zipf popularity, s = 1, over 50 or 500 adapters; "shifting" re-ranks the adapters at random twice during
the run), every engine holds `max_loras` adapters (LRU among idle ones; a request waits while every slot holds an
adapter with requests in flight) and a cold load stalls the engine's next step; KV blocks are per adapter (each
prompt starts with its adapter's system prompt, as vLLM's per-adapter hashes separate them). A run spans about
44 simulated seconds. Rows: `kv_affinity` blind to adapters (it still sees each adapter's KV), llm-d's default
profile with its `lora-affinity-scorer` at weight 1 (llm-d-router `loraaffinity` scorer), Dynamo's LoRA controller
and filter ahead of its KV cost (ai-dynamo/dynamo `lib/llm/src/lora/`: `controller.rs`, `filter.rs`,
`routing/hrw.rs`; with its default 3 s controller and with a 0.25 s one), and Tandem's `lora_affinity`. The
goal column states issue 26's target: Tandem's mean and p99 TTFT at least 25% below every other row's and at
least 5x fewer cold loads than the adapter-blind row. Cold loads are counted for measured requests only (the
first tenth of each run warms the caches). The simulator's engines load adapters on demand; Tandem does not yet
ask agents to preload or unload adapters.""",
    "scale": """The conversation trace is tiled: one copy (disjoint hash ids: an independent user population) per
8 instances at arrivals x2.5, so the load per instance is that of the replay above at every size. TTFT and hit
rate are simulated; decision time is the wall-clock cost per request of the coordinator's and conductor's own
Python in-process (Match: chain hashing and index walk; candidates: the per-instance ledger view; pick: the
policy), which grows with the number of instances; gRPC and Envoy are not included, nor (since 2026-12-07) the
cyclic garbage collector's passes over the simulator's own heap, which the real coordinator does not hold (the
simulations run with the collector paused: `bench.fleet.runs.collector_paused`). When this section's date
predates the routing section, it was measured before issue 11 (prefill released at response end, old
kv_affinity defaults); `make bench` re-runs it.""",
    "fleet_pd": """From issue 21: the fleet simulator with prefill and decode instances (simengine's instance model
unchanged; a prefill leg holds its blocks until its KV has left, a decode leg allocates the whole prompt before any
byte moves), KV transfers over a topology's links shared by concurrent transfers (one NIC per node at 20 GB/s, an
intra-node fabric at 56 GB/s), handoff timing (prefill, transfer, decode). Every P/D rule runs at its own best P:D
split (most requests within the SLOs, then lowest mean TTFT; a quarter, half and three quarters of the fleet, then
the best one's neighbours); `aggregated` runs Tandem's default policy with every instance hybrid. Parameters and the
rules' sources: docs/pd.md. The P/D real-time step above checks this model row by row on a smaller slice.""",
    "simengine": """From issue 5: streamed tokens/s one engine process sustains at 256 concurrent streams (CPU
bound, speedup 10000), and the timing model's TTFT/ITL at speedup 1 against its profile.""",
    "conductor": """From issue 4, `--quick` size (10% of the full run): ingest rate, Match latency at 8k/64 and
32k/512 (block size 16), bytes per (block, holder) entry.""",
}


def notes(name: str, body: str) -> str:
    """The explanatory paragraph of a section."""
    return " ".join(_NOTES.get(name, "").split())
