"""Decode-first trigger mode (`concurrent_engine_sync`): the decode request out, the metaserver callback in,
the prefill leg out.

1. `open`: the request goes to the decode engine with `kv_transfer_params {"do_remote_decode": false,
   "do_remote_prefill": true, "metaserver": <URL naming this coordinator>}` and `X-Request-Id: <root>#a<n>`.
2. The decode engine allocates blocks and POSTs its facts to the URL; Envoy transcodes the POST into
   `Metaserver.Trigger`, which lands in `AttemptRegistry.callback`.
3. `run_leg` (once per attempt, when every expected child called back): a prefill instance is chosen (KV-aware,
   `ISL - matched_tokens` committed) and gets the client's body with `kv_transfer_params` = the decode engine's
   facts (several children: `batch_kv_transfer_params` too), `stream: false`, `max_tokens: 1`, `min_tokens: 1`,
   the same `X-Request-Id`. It pushes KV to the decode engine, which streams the answer to the client via Envoy.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import Any

from google.protobuf import json_format

from coordinator import metrics
from coordinator.attempts import Attempt, AttemptRegistry, UnknownAttempt
from coordinator.callback_checks import TOKEN_REFUSED, callback_problem, mint_token
from coordinator.handoff import HandoffRunner
from coordinator.picker import Pick
from tandem.netaddr import split_host_port
from tandem.v1 import metaserver_pb2

log = logging.getLogger(__name__)


def _integral(value: Any) -> Any:
    """JSON numbers in protobuf `Value`s are doubles: give whole numbers back as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def callback_facts(req: metaserver_pb2.TriggerRequest) -> dict[str, Any]:
    """The decode engine's callback body, as it posted it (minus the URL's replica)."""
    facts: dict[str, Any] = {
        "token_ids": list(req.token_ids),
        "request_id": req.request_id,
        "do_remote_prefill": req.do_remote_prefill,
        "do_remote_decode": req.do_remote_decode,
        "remote_block_ids": _integral(json_format.MessageToDict(req.remote_block_ids)),
        "remote_block_size": _integral(json_format.MessageToDict(req.remote_block_size))
        if req.HasField("remote_block_size")
        else None,
        "remote_engine_id": req.remote_engine_id,
        "remote_host": req.remote_host,
        "remote_port": req.remote_port,
        "remote_tp_size": req.remote_tp_size,
        "remote_pcp_size": req.remote_pcp_size,
        "remote_dcp_size": req.remote_dcp_size,
        "remote_cached_tokens": req.remote_cached_tokens,
    }
    for extra in ("remote_pp_size", "remote_dp_size"):
        if getattr(req, extra):
            facts[extra] = getattr(req, extra)
    return facts


def trigger_prefill_body(body: dict[str, Any], attempt: Attempt) -> dict[str, Any]:
    """The prefill leg's body: the client's, with the decode engine's facts."""
    leg = copy.deepcopy(body)
    first = attempt.facts[attempt.expected[0]]
    leg["kv_transfer_params"] = first
    if len(attempt.expected) > 1:
        leg["batch_kv_transfer_params"] = {cid: attempt.facts[cid] for cid in attempt.expected}
    leg["stream"] = False
    leg["max_tokens"] = 1
    leg["min_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    return leg


class CallbackRefused(Exception):
    """A callback that does not belong to its attempt (`coordinator.callback_checks`); the message says why."""


class TriggerCoordinator:
    """Opens attempts for decode requests and runs their prefill legs."""

    def __init__(
        self,
        runner: HandoffRunner,
        registry: AttemptRegistry,
        metaserver_url: str,
        kv_hosts: list[str] | None = None,
    ) -> None:
        self.runner = runner
        self.registry = registry
        self.metaserver_url = metaserver_url
        self.kv_hosts = kv_hosts or []

    def open(self, pick: Pick, path: str) -> tuple[Attempt, bytes]:
        """Registers the request's attempt; returns it and the body for the decode engine."""
        attempt = self.registry.open(
            pick.request_id, pick.request.api, len(pick.request.prompts), (pick, path)
        )
        attempt.token = mint_token()
        url = f"{self.metaserver_url}/{attempt.token}"
        params = {"do_remote_decode": False, "do_remote_prefill": True, "metaserver": url}
        return attempt, json.dumps({**pick.request.body, "kv_transfer_params": params}).encode()

    async def callback(self, req: metaserver_pb2.TriggerRequest) -> None:
        """One decode-engine callback (see `AttemptRegistry.callback` for the rules)."""
        facts = callback_facts(req)
        try:
            attempt = self.registry.find(req.request_id)
        except UnknownAttempt:
            # Refused as a wrong token is: a caller without an attempt's token learns nothing, not even whether an
            # attempt with that id is open (a 404 here would confirm guessed ids).
            raise CallbackRefused(f"callback for {req.request_id!r} refused: {TOKEN_REFUSED}") from None
        pick, _ = attempt.context
        info = pick.target.instance.info
        index = attempt.expected.index(req.request_id) if req.request_id in attempt.expected else 0
        prompts = pick.request.prompts
        prompt_tokens = len(prompts[index]) if index < len(prompts) else pick.request.prompt_tokens
        problem = callback_problem(
            attempt.token,
            req.token,
            facts,
            split_host_port(info.address)[0],
            prompt_tokens,
            info.block_size,
            self.kv_hosts,
        )
        if problem is not None:
            raise CallbackRefused(f"callback for {req.request_id!r} refused: {problem}")
        await self.registry.callback(req.request_id, facts, self.run_leg)

    async def run_leg(self, attempt: Attempt) -> None:
        """The attempt's prefill leg, retried on another prefill instance up to the configured attempts."""
        pick, path = attempt.context
        metrics.CALLBACK_PATH_SECONDS.observe(time.monotonic() - attempt.opened_at)
        body = trigger_prefill_body(pick.request.body, attempt)
        await self.runner.prefill(pick, path, body, attempt.engine_request_id, want_params=False)
