"""The coordinator's CPU per decision with tracing off, at sample ratio 0 and at ratio 1 (docs/operations.md,
"Tracing"): the decision core (`Decider.route`, the kv_affinity policy over 4 instances, no conductor) is run
in a fresh process per mode, each decision under the trace context Envoy sends (ratio 0: `traceparent` with the
sampled flag off; ratio 1: on), and the process's CPU time (exporter thread included) is divided by the
decisions. Ratio 1 exports to a small OTLP receiver in this process.

    python -m bench.tracing_cost [--decisions N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import subprocess
import sys
import time


def _measure(mode: str, endpoint: str, decisions: int) -> float:
    """µs of CPU per decision in this process (run in a child, one mode each)."""
    from coordinator.decision import new_request_ids
    from tandem import tracing
    from tandem.tracing_config import TracingConfig
    from tests.coordinator.test_ext_proc import decider_for
    from tests.helpers import make_picker

    if mode != "off":
        tracing.setup(
            TracingConfig(otlp_endpoint=endpoint, sample_ratio=1.0 if mode == "ratio1" else 0.0), "b"
        )
    decider = decider_for(make_picker("kv_affinity", instances=4))
    flags = "01" if mode == "ratio1" else "00"
    body = json.dumps({"model": "m", "prompt": "a prompt of a few words " * 20, "max_tokens": 4}).encode()

    async def run() -> float:
        async def one() -> None:
            # What the transport does per call (the context from the call's metadata), in every mode.
            metadata = ((tracing.TRACEPARENT, f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"),)
            trace = tracing.metadata_context(metadata) if tracing.ENABLED else None
            outcome = await decider.route("/v1/completions", body, new_request_ids(None), trace=trace)
            decider.tickets.end(outcome.ticket.id, response_bytes=100)  # type: ignore[union-attr]

        for _ in range(200):  # warm up (tokenizer, caches)
            await one()
        start = time.process_time()
        for _ in range(decisions):
            await one()
        tracing.shutdown(5.0)  # the exporter's work is part of the cost
        return (time.process_time() - start) / decisions * 1e6

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "ENDPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(_measure(args.child[0], args.child[1], args.decisions))
        return 0
    from tests.helpers import OtlpReceiver

    receiver = OtlpReceiver().start()
    try:
        results: dict[str, list[float]] = {"off": [], "ratio0": [], "ratio1": []}
        for _ in range(args.repeats):
            for mode in results:  # interleaved: machine load drifts alike for every mode
                argv_ = [sys.executable, "-m", "bench.tracing_cost", "--decisions", str(args.decisions)]
                out = subprocess.run(
                    [*argv_, "--child", mode, receiver.address], capture_output=True, text=True, check=True
                )
                results[mode].append(float(out.stdout.strip().splitlines()[-1]))
        for mode, values in results.items():
            best = min(values)
            print(
                f"{mode:7s} CPU per decision: best {best:7.1f} µs  (runs: {', '.join(f'{v:.1f}' for v in values)})"
            )
        print(f"spans received at ratio 1: {len(receiver.spans)}")
    finally:
        receiver.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
