"""Does `sglang_cache_aware` decide as the real sglang-router does? The router as shipped on PyPI, in front of four
recording stand-in engines, against the coordinator's re-implementation on the same prompts and the same loads.

    python -m bench.sglang_parity [--requests 160] [--held 6]

The stand-ins answer `/health`, `/model_info`, `/server_info` and `/v1/models`, record which of them each
completion reaches, and hold every completion until the replay releases it. The replay sends the prompts of a
generated reuse-heavy workload one at a time, waits until each has reached an engine, and keeps the last `--held`
requests open (releasing the oldest, and waiting for its answer, before sending the next), so the router's
in-flight counts are known exactly at every decision. The re-implementation replays the same sequence with the
same in-flight counts, once per `below_threshold` variant. Reported per variant: decisions that agree with the
router's, under the labelling of engines that agrees best (engine order is the router's own).

sglang-router 0.3.2 sends a prompt whose cached share is below `cache_threshold` to its least-loaded worker, not
to the worker with the smallest tree as the router's older documentation says: this benchmark is how that was
found, and why `below_threshold` defaults to `least_load`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from bench.harness import free_ports, wait_until
from bench.peers import start_peer, version
from bench.trace import load_trace
from coordinator.instances import InstanceInfo, InstanceState
from coordinator.scheduling.interface import Candidate, RequestFacts
from coordinator.scheduling.sglang_cache_aware import Params, SglangCacheAware
from tandem.chain_hash import chain_hashes
from tandem.tokenizer import load_tokenizer

ENGINES = 4
BLOCK = 16
MODEL = "parity"


class Recorder:
    """Four stand-in engines: which one each completion reached, each held until released."""

    def __init__(self) -> None:
        self.arrivals: list[int] = []  # engine index per completion, in arrival order
        self.gates: list[threading.Event] = []
        self.lock = threading.Lock()
        self.servers = [
            ThreadingHTTPServer(("127.0.0.1", p), self._handler(i)) for i, p in enumerate(free_ports(ENGINES))
        ]
        for s in self.servers:
            threading.Thread(target=s.serve_forever, daemon=True).start()

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.server_address[1]}" for s in self.servers]

    def _handler(self, index: int) -> type[BaseHTTPRequestHandler]:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _json(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._json(
                    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
                )

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                gate = threading.Event()
                with recorder.lock:
                    recorder.arrivals.append(index)
                    recorder.gates.append(gate)
                gate.wait(60)
                choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
                usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
                self._json({"id": "cmpl-p", "object": "text_completion", "created": 0, "model": MODEL,
                            "choices": [choice], "usage": usage})  # fmt: skip

        return Handler

    def close(self) -> None:
        for gate in self.gates:
            gate.set()
        for s in self.servers:
            s.shutdown()


def router_decisions(texts: Sequence[str], held: int, workdir: Path) -> list[int]:
    """The engine index the real router chose for each prompt, with the last `held` requests kept open."""
    recorder = Recorder()
    peer = start_peer("sglang-router cache_aware", recorder.addresses, workdir)
    open_calls: list[threading.Thread] = []
    try:
        with httpx.Client(timeout=60) as client:

            def send(text: str) -> None:
                body = {"model": MODEL, "prompt": text, "max_tokens": 1}
                client.post(peer.url + "/v1/completions", json=body).raise_for_status()

            for k, text in enumerate(texts):
                if len(open_calls) == held:
                    recorder.gates[k - held].set()
                    open_calls.pop(0).join(60)
                call = threading.Thread(target=send, args=(text,))
                call.start()
                open_calls.append(call)
                wait_until(lambda n=k + 1: len(recorder.arrivals) == n, 30, f"request {k} reached an engine")
            for gate in recorder.gates:
                gate.set()
            for call in open_calls:
                call.join(60)
    finally:
        peer.stop()
        recorder.close()
    return list(recorder.arrivals)


def _state(instance_id: str) -> InstanceState:
    return InstanceState(InstanceInfo(instance_id, MODEL, "", "hybrid", "aggregated", block_size=BLOCK))


def model_decisions(prompts: Sequence[Sequence[int]], held: int, params: Params) -> list[int]:
    """The re-implementation's choice for each prompt under the same in-flight counts as the router's replay."""
    policy = SglangCacheAware(params)
    states = [_state(f"e{i}") for i in range(ENGINES)]
    chosen: list[int] = []
    for k, prompt in enumerate(prompts):
        open_now = chosen[max(0, k - held + 1) : k]  # as the replay: the oldest released first
        inflight = [open_now.count(i) for i in range(ENGINES)]
        facts = RequestFacts(f"r{k}", MODEL, len(prompt), 1, chain_hashes(prompt, BLOCK))
        candidates = [Candidate(s, 0, 0, inflight[i]) for i, s in enumerate(states)]
        chosen.append(int(policy.pick(facts, candidates).instance_id[1:]))
    return chosen


def agreement(model: Sequence[int], router: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Decisions that agree under the best relabelling of the model's engines (the router's order is its own)."""
    best = max(
        itertools.permutations(range(ENGINES)),
        key=lambda p: sum(p[m] == r for m, r in zip(model, router, strict=True)),
    )
    return sum(best[m] == r for m, r in zip(model, router, strict=True)), best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="tenants_rag")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--held", type=int, default=6, help="requests kept open at each decision")
    parser.add_argument("--max-input", type=int, default=2048)
    parser.add_argument("--output-dir", help="write sglang-parity.md here")
    args = parser.parse_args(argv)
    requests = load_trace(
        args.workload, args.requests, 1.0, load_tokenizer(None), args.seed, args.max_input, 1
    )
    router = router_decisions(
        [r.text for r in requests], args.held, Path(tempfile.mkdtemp(prefix="tandem-parity-"))
    )
    lines = [
        f"sglang-router {version('sglang')} cache_aware (its defaults) against `sglang_cache_aware`: {len(requests)} "
        f"prompts of {args.workload} (seed {args.seed}, inputs <= {args.max_input} tokens), {args.held} requests "
        f"held open at each decision, {ENGINES} engines.",
        "",
        "| below_threshold | decisions as the router's | engines used (router / model) |",
        "|---|---:|---|",
    ]
    for variant in ("least_load", "smallest_tree"):
        model = model_decisions([r.prompt for r in requests], args.held, Params(below_threshold=variant))
        agree, relabel = agreement(model, router)
        spread = f"{[router.count(i) for i in range(ENGINES)]} / {[model.count(relabel.index(i)) for i in range(ENGINES)]}"
        lines.append(f"| {variant} | {agree}/{len(requests)} ({agree / len(requests):.0%}) | {spread} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output_dir:
        Path(args.output_dir, "sglang-parity.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
