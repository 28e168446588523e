"""Command line of `python -m simengine`: `vllm serve` names where vLLM has the option, clear names otherwise."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from simengine.block_hash import ALGORITHMS
from simengine.connectors.factory import connector_names
from simengine.kv_publisher import KVEventsConfig
from simengine.lora import DEFAULT_LOAD_MS, DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, RANKS, parse_lora_module
from simengine.profiles import PROFILES


@dataclass(slots=True)
class KVTransferConfig:
    """vLLM's `--kv-transfer-config` keys the simulator uses (others are accepted and kept)."""

    kv_connector: str | None = None
    #: kv_producer (prefill), kv_consumer (decode) or kv_both.
    kv_role: str | None = None
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    #: Base port of the KV transfer listener (+ dp_rank); 0 picks a free port.
    kv_port: int = 0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: dict) -> KVTransferConfig:
        known = {k: raw[k] for k in ("kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port") if k in raw}
        extra = {k: v for k, v in raw.items() if k not in known and k != "kv_connector_extra_config"}
        cfg = cls(
            **known, kv_connector_extra_config=dict(raw.get("kv_connector_extra_config") or {}), extra=extra
        )
        if cfg.kv_role not in (None, "kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"--kv-transfer-config: kv_role must be kv_producer, kv_consumer or kv_both, not {cfg.kv_role!r}"
            )
        if cfg.kv_connector and cfg.kv_role is None:
            raise ValueError("--kv-transfer-config: kv_role is required with kv_connector")
        if cfg.kv_connector and cfg.kv_connector not in connector_names():
            raise ValueError(f"--kv-transfer-config: unsupported kv_connector {cfg.kv_connector!r}")
        return cfg

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def _json_arg(name: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{name} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object")
        return value

    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simengine",
        description="Simulated vLLM engine: vLLM's OpenAI HTTP API, KV events and P/D connectors, no accelerator.",
    )
    v = p.add_argument_group("vLLM-compatible options (same names and meaning as `vllm serve`)")
    v.add_argument("model_tag", nargs="?", default=None, help="model name, as `vllm serve MODEL`")
    v.add_argument("--model", default=None, help="model name (default: sim-8b)")
    v.add_argument(
        "--served-model-name", nargs="+", default=None, help="names the API answers to (default: model)"
    )
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    v.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default 16; 128 on Ascend)"
    )
    v.add_argument("--max-num-seqs", type=int, default=256, help="max sequences per step (default 256)")
    v.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="token budget per step (default 8192)"
    )
    v.add_argument(
        "--max-model-len", type=int, default=32768, help="max prompt + output tokens (default 32768)"
    )
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix caching over hashed full blocks (default on)")  # fmt: skip
    v.add_argument("--kv-events-config", type=_json_arg("--kv-events-config"), default=None,
                   help='JSON, vLLM keys: {"enable_kv_cache_events":true,"publisher":"zmq","endpoint":..,'
                   '"replay_endpoint":..,"buffer_steps":..,"hwm":..,"topic":..}')  # fmt: skip
    v.add_argument("--kv-transfer-config", type=_json_arg("--kv-transfer-config"), default=None,
                   help='JSON, vLLM keys: {"kv_connector":"NixlConnector|MooncakeConnector|'
                   'MooncakeLayerwiseConnector","kv_role":"kv_producer|kv_consumer|kv_both","engine_id":..,'
                   '"kv_ip":..,"kv_port":..,"kv_connector_extra_config":{..}}')  # fmt: skip
    v.add_argument(
        "--data-parallel-rank", type=int, default=0, help="DP rank of this engine (offsets KV ports)"
    )
    v.add_argument("--data-parallel-size", type=int, default=1, help="DP size (informational)")
    v.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer directory (default: built-in)")
    v.add_argument("--prefix-caching-hash-algo", choices=ALGORITHMS, default="sha256",
                   help="block hash algorithm, as vLLM (default sha256); events carry vLLM's exact hashes")  # fmt: skip
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="accepted; reported as tp_size")
    v.add_argument("--enforce-eager", action="store_true", help="accepted and ignored")
    v.add_argument("--disable-log-requests", action="store_true", help="accepted and ignored")
    v.add_argument("--no-enable-log-requests", action="store_true", help="accepted and ignored")
    v.add_argument("--disable-uvicorn-access-log", action="store_true", help="accepted and ignored")
    v.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="accepted and ignored")
    v.add_argument("--trust-remote-code", action="store_true", help="accepted and ignored")
    v.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix cache), "
                        "as vLLM")  # fmt: skip
    v.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer every response with X-Request-Id (the request's, else a new one), as vLLM")  # fmt: skip
    v.add_argument("--otlp-traces-endpoint", default=None,
                   help="export a span per request to this OTLP/gRPC collector (URL), as vLLM")  # fmt: skip
    v.add_argument("--enable-scale-out", action="store_true",
                   help="serve the render endpoints (vLLM answers them 403 without this flag)")  # fmt: skip
    v.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: waiting requests in arrival order; priority: by (priority, arrival), the largest "
                        "preempted first (vLLM's rule); requests may set `priority` only under this policy")  # fmt: skip
    v.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: `--lora-modules` at start, `/v1/load_lora_adapter` at run time "
                        "(with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), requests naming one as `model`")  # fmt: skip
    v.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS,
                   help="adapters that may run in one step (default 1); other adapters' requests wait")  # fmt: skip
    v.add_argument("--max-lora-rank", type=int, choices=RANKS, default=DEFAULT_MAX_LORA_RANK,
                   help="largest adapter rank accepted (default 16)")  # fmt: skip
    v.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters whose weights stay in memory, least recently used evicted (default --max-loras)")  # fmt: skip
    v.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='adapters loaded at start: name=path or JSON {"name":..,"path":..,"base_model_name":..}')  # fmt: skip
    for flag in ("--disable-log-stats", "--enable-server-load-tracking"):
        v.add_argument(flag, action="store_true", help="accepted and ignored")
    v.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="accepted; chunked prefill is always on")  # fmt: skip
    for flag in ("--dtype", "--seed", "--swap-space", "--uvicorn-log-level", "--pipeline-parallel-size",
                 "--prefill-context-parallel-size", "--data-parallel-size-local", "--data-parallel-address",
                 "--data-parallel-rpc-port", "--data-parallel-start-rank", "--kv-cache-dtype", "--quantization",
                 "--load-format", "--additional-config", "--compilation-config"):  # fmt: skip
        v.add_argument(flag, default=None, metavar="VALUE", help="accepted and ignored")

    s = p.add_argument_group("simulator options")
    s.add_argument("--profile", choices=sorted(PROFILES), default="ascend-910b", help="timing profile")
    s.add_argument("--speedup", type=float, default=1.0, help="divide every simulated duration by this")
    s.add_argument("--npu-blocks", type=int, default=4096, help="KV blocks on the accelerator (medium GPU)")
    s.add_argument("--cpu-blocks", type=int, default=0, help="KV blocks in host memory (medium CPU)")
    s.add_argument("--disk-blocks", type=int, default=0, help="KV blocks on disk (medium STORAGE)")
    s.add_argument("--offload", action="store_true", help="offload evicted blocks to the next tier")
    s.add_argument("--kv-events-legacy-format", action="store_true",
                   help="publish events as positional arrays and replay without the topic frame (vLLM <= 0.23)")  # fmt: skip
    s.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a decode request waits for remote KV (trigger push or handoff pull)")  # fmt: skip
    s.add_argument("--kv-bytes-per-block", type=int, default=4096,
                   help="bytes sent over TCP per transferred block (a scaled-down stand-in for real KV)")  # fmt: skip
    s.add_argument("--lora-load-ms", type=float, default=DEFAULT_LOAD_MS,
                   help="time one adapter load takes: a load request, and a step that needs an adapter's weights "
                        "evicted from memory (default 50, CPU vLLM's for a tiny adapter; divided by --speedup)")  # fmt: skip
    s.add_argument("--hash-seed", default=None,
                   help="seed of the first block's parent hash (default as vLLM: PYTHONHASHSEED, else a fixed "
                   "seed for sha256*, a random one for xxhash*)")  # fmt: skip

    f = p.add_argument_group("fault injection")
    f.add_argument("--fault-crash-after", type=int, default=0, metavar="N", help="exit(1) after N requests")
    f.add_argument("--fault-hang", action="store_true", help="accept requests and never answer them")
    f.add_argument("--fault-latency-ms", type=float, default=0.0, help="extra latency before each answer")
    f.add_argument("--fault-error-rate", type=_fraction, default=0.0, help="share of requests answered 500")
    f.add_argument("--fault-drop-callbacks", action="store_true", help="never POST the metaserver callback")
    f.add_argument(
        "--fault-duplicate-callbacks", action="store_true", help="POST every metaserver callback twice"
    )
    f.add_argument("--fault-kv-refuse", action="store_true",
                   help="the TCP KV listener refuses every pull and push (a broken link: peers recompute)")  # fmt: skip
    f.add_argument("--fault-event-gap-every", type=int, default=0, metavar="N",
                   help="skip every Nth KV event batch (its sequence number is lost)")  # fmt: skip
    f.add_argument("--fault-seed", type=int, default=0, help="seed of the error-rate draw")
    return p


@dataclass(slots=True)
class EngineConfig:
    """Validated options."""

    model: str
    served_model_names: list[str]
    host: str
    port: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    kv_events: KVEventsConfig
    kv_transfer: KVTransferConfig
    dp_rank: int
    dp_size: int
    tp_size: int
    tokenizer: str | None
    profile: str
    speedup: float
    npu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    offload: bool
    kv_events_legacy_format: bool
    kv_transfer_timeout: float
    kv_bytes_per_block: int
    #: None: vLLM's rule (PYTHONHASHSEED, else per algorithm).
    hash_seed: str | None
    prefix_caching_hash_algo: str
    fault_crash_after: int
    fault_hang: bool
    fault_latency_ms: float
    fault_error_rate: float
    fault_drop_callbacks: bool
    fault_duplicate_callbacks: bool
    fault_kv_refuse: bool
    fault_event_gap_every: int
    fault_seed: int
    enable_request_id_headers: bool = False
    enable_prompt_tokens_details: bool = False
    enable_scale_out: bool = False
    otlp_traces_endpoint: str | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"
    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    #: None: `max_loras`, as vLLM.
    max_cpu_loras: int | None = None
    #: `--lora-modules` as (name, path, base model name or None).
    lora_modules: list[tuple[str, str, str | None]] = field(default_factory=list)
    lora_load_ms: float = DEFAULT_LOAD_MS


def parse_config(argv: list[str] | None = None) -> EngineConfig:
    """Parses and validates; raises SystemExit(2) with argparse's one-line message on bad input."""

    parser = build_parser()
    a = parser.parse_args(argv)
    model = a.model or a.model_tag or "sim-8b"
    try:
        kv_events = KVEventsConfig.from_json(a.kv_events_config or {})
        kv_transfer = KVTransferConfig.from_json(a.kv_transfer_config or {})
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "npu_blocks"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.speedup <= 0:
        parser.error("--speedup must be > 0")
    lora_modules = []
    for item in a.lora_modules or []:
        if item:
            try:
                lora_modules.append(parse_lora_module(item))
            except ValueError as e:
                parser.error(str(e))
    if a.max_loras < 1:
        parser.error("--max-loras must be >= 1")
    if a.max_cpu_loras is not None and a.max_cpu_loras < a.max_loras:
        parser.error(f"max_cpu_loras ({a.max_cpu_loras}) must be >= max_loras ({a.max_loras}).")
    if lora_modules and not a.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    if a.lora_load_ms < 0:
        parser.error("--lora-load-ms must be >= 0")
    if not 0 <= a.data_parallel_rank < max(a.data_parallel_size, a.data_parallel_rank + 1):
        parser.error("--data-parallel-rank must be >= 0")
    return EngineConfig(
        model=model,
        served_model_names=a.served_model_name or [model],
        host=a.host,
        port=a.port,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=min(a.max_model_len, a.npu_blocks * a.block_size),
        enable_prefix_caching=a.enable_prefix_caching,
        kv_events=kv_events,
        kv_transfer=kv_transfer,
        dp_rank=a.data_parallel_rank,
        dp_size=a.data_parallel_size,
        tp_size=a.tensor_parallel_size,
        tokenizer=a.tokenizer,
        profile=a.profile,
        speedup=a.speedup,
        npu_blocks=a.npu_blocks,
        cpu_blocks=a.cpu_blocks,
        disk_blocks=a.disk_blocks,
        offload=a.offload,
        kv_events_legacy_format=a.kv_events_legacy_format,
        kv_transfer_timeout=a.kv_transfer_timeout,
        kv_bytes_per_block=a.kv_bytes_per_block,
        hash_seed=a.hash_seed,
        prefix_caching_hash_algo=a.prefix_caching_hash_algo,
        fault_crash_after=a.fault_crash_after,
        fault_hang=a.fault_hang,
        fault_latency_ms=a.fault_latency_ms,
        fault_error_rate=a.fault_error_rate,
        fault_drop_callbacks=a.fault_drop_callbacks,
        fault_duplicate_callbacks=a.fault_duplicate_callbacks,
        fault_kv_refuse=a.fault_kv_refuse,
        fault_event_gap_every=a.fault_event_gap_every,
        fault_seed=a.fault_seed,
        enable_request_id_headers=a.enable_request_id_headers,
        enable_prompt_tokens_details=a.enable_prompt_tokens_details,
        enable_scale_out=a.enable_scale_out,
        otlp_traces_endpoint=a.otlp_traces_endpoint,
        gpu_memory_utilization=a.gpu_memory_utilization,
        scheduling_policy=a.scheduling_policy,
        enable_lora=a.enable_lora,
        max_loras=a.max_loras,
        max_lora_rank=a.max_lora_rank,
        max_cpu_loras=a.max_cpu_loras,
        lora_modules=lora_modules,
        lora_load_ms=a.lora_load_ms,
    )
