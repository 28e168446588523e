"""Open-loop replay of timed requests against an OpenAI endpoint, streaming, with TTFT and token counts."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from bench.trace import TraceRequest


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method), NaN when empty; shared by every benchmark."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass
class ReplayResult:
    """What one replay measured."""

    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    wall_s: float = 0.0
    #: Per answered request: the response's `id` (`cmpl-<the engine's X-Request-Id>`: through the mesh, the id the
    #: coordinator minted) and its final `usage` (`prompt_tokens_details` with `--enable-prompt-tokens-details`).
    answers: list[tuple[str, dict]] = field(default_factory=list)

    def pct(self, values: list[float], q: int) -> float:
        """The q-th percentile of `values`."""
        return percentile(values, q)

    def slo_share(self, ttft_slo_s: float) -> float:
        """Share of all requests (errors count as misses) whose TTFT met the SLO."""
        total = len(self.ttft_s) + self.errors
        return sum(t <= ttft_slo_s for t in self.ttft_s) / total if total else float("nan")


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, req: TraceRequest, out: ReplayResult
) -> None:
    body = {
        "model": model,
        "prompt": req.text or req.prompt,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    rid, final_usage = "", {}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                out.errors += 1
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and first is None:
                    first = time.perf_counter()
                    rid = chunk.get("id", "")
                usage = chunk.get("usage")
                if usage:
                    tokens = usage.get("completion_tokens", tokens)
                    final_usage = usage
    except (TimeoutError, aiohttp.ClientError):
        out.errors += 1
        return
    if first is None:
        out.errors += 1
        return
    out.ttft_s.append(first - start)
    out.latency_s.append(time.perf_counter() - start)
    out.output_tokens += tokens
    out.answers.append((rid, final_usage))


async def replay(url: str, model: str, requests: list[TraceRequest], progress=None) -> ReplayResult:
    """Sends each request at its arrival time (open loop) and waits for all answers."""
    out = ReplayResult()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        start = time.perf_counter()
        tasks = []
        for req in requests:
            delay = req.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(session, url, model, req, out))
            if progress is not None:
                task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
        await asyncio.gather(*tasks)
        out.wall_s = time.perf_counter() - start
    return out
