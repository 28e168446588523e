"""`tandem import-vllm SCRIPT [ARG...]`: turns an existing `vllm serve` launch script into node agent config.

Reads the script as text (never runs it): `export NAME=value` and `name=value` lines, then every `vllm serve MODEL`
(or `python -m vllm.entrypoints.openai.api_server --model MODEL`) command, with backslash continuations and quoted
JSON. `$1`... are the ARGs given after the script (the templates of vLLM-Ascend's external DP launcher take the
devices, port, DP size, rank, address, RPC port and TP size that way); `$name` and `${name}` are the script's own
assignments. Each command becomes one `engines:` entry:

- parallel sizes on the command line win over `kv_connector_extra_config`'s `dp_size`/`tp_size`/`pp_size` of the
  engine's own side, which are used only when the command line has none, and are stripped from the output (the agent
  fills them in from the sizes); the other side's topology and every other field stay as written;
- `kv_role` becomes `role`; `engine_id` is dropped (the agent uses the instance id);
- cross-node commands keep `nnodes` and the master port, never a fixed master address or node rank (both are
  injected at run time on each node), and no `--headless` (node rank > 0 implies it);
- a per-rank script (`--data-parallel-rank R`, one API server per rank) becomes `data_parallel_start_rank: R` and
  `data_parallel_size_local: 1`: exactly what the script ran (widen `data_parallel_size_local` and `devices` to let
  the agent run every rank of the node); the DP address is dropped like the master address;
- `ASCEND_RT_VISIBLE_DEVICES` becomes `devices`; `VLLM_PP_LAYER_PARTITION` is dropped when the connector config
  carries the same partition (the agent exports it); other variables go to `env`;
- KV events are on (the conductor needs them): a DP engine gets `kv_events_port` from the script's
  `--kv-events-config` endpoint, else vLLM's default 5557;
- every other flag is kept, in order, in `args`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from typing import Any

import yaml

ENTRYPOINTS = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")
# Flag spellings as in vllm/engine/arg_utils.py (long names and their short aliases).
SIZE_FLAGS = {
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "-pp": "pipeline_parallel_size",
    "--data-parallel-size": "data_parallel_size",
    "-dp": "data_parallel_size",
    "--data-parallel-size-local": "data_parallel_size_local",
    "-dpl": "data_parallel_size_local",
    "--data-parallel-start-rank": "data_parallel_start_rank",
    "-dpr": "data_parallel_start_rank",
    "--data-parallel-rpc-port": "data_parallel_rpc_port",
    "-dpp": "data_parallel_rpc_port",
    "--prefill-context-parallel-size": "prefill_context_parallel_size",
    "-pcp": "prefill_context_parallel_size",
    "--nnodes": "nnodes",
    "-n": "nnodes",
    "--master-port": "master_port",
    "--block-size": "block_size",
    "--port": "port",
}
DROPPED_WITH_VALUE = {
    "--node-rank", "-r", "--master-addr", "--data-parallel-address", "-dpa",
    "--host", "--served-model-name", "--model", "--kv-transfer-config", "--kv-events-config",
}  # fmt: skip
DROPPED_FLAGS = {"--headless"}
EXTRA_SIZES = {
    "dp_size": "data_parallel_size",
    "tp_size": "tensor_parallel_size",
    "pp_size": "pipeline_parallel_size",
}
DEFAULT_KV_EVENTS_PORT = 5557  # vllm/config/kv_events.py: endpoint "tcp://*:5557"
SHELL_TOKENS = {"&", "&&", ";", "||", "|", ">", ">>", "2>", "2>&1", "&>"}
KEY_ORDER = ("instance_id", "backend", "model", "model_path", "host", "port", "role")
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "hybrid"}
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*|\d+)\}|([A-Za-z_][A-Za-z0-9_]*|\d))")


class ImportError_(ValueError):
    """The script cannot be turned into config (one line saying why)."""


def _logical_lines(text: str) -> list[str]:
    """Joins backslash continuations and quoted newlines; drops comments and blank lines."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        try:
            shlex.split(current, comments=True)
        except ValueError:  # an open quote: a JSON value over several lines
            current += " "
            continue
        lines.append(current)
        current = ""
    if current.strip():
        lines.append(current)
    return lines


def _substitute(text: str, variables: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return _VAR.sub(value, text)


def _is_command(words: list[str]) -> tuple[bool, int]:
    """Whether `words` run vLLM's server, and where its arguments start."""
    for i, word in enumerate(words):
        base = os.path.basename(word)
        if base == "vllm" and i + 1 < len(words) and words[i + 1] == "serve":
            return True, i + 2
        if word == "-m" and i + 1 < len(words) and words[i + 1] in ENTRYPOINTS:
            start = i + 2
            if words[i + 1] == "vllm.entrypoints.cli.main" and start < len(words) and words[start] == "serve":
                start += 1
            return True, start
    return False, 0


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ImportError_(
            f"{flag} {value!r} is not a number (pass the script's arguments after it)"
        ) from None


def _json(flag: str, value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ImportError_(f"{flag}: invalid JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise ImportError_(f"{flag}: expected a JSON object")
    return parsed


class _ArgCursor:
    """Walks an argument list; `--flag=value` and `--flag value` read alike."""

    def __init__(self, argv: list[str]) -> None:
        self.argv, self.i = argv, -1
        self.word = self.flag = ""
        self.inline: str | None = None

    def next(self) -> bool:
        self.i += 1
        if self.i >= len(self.argv):
            return False
        self.word = self.argv[self.i]
        flag, eq, inline = self.word.partition("=")
        is_flag = self.word.startswith("-")
        self.flag = flag if is_flag else self.word
        self.inline = inline if is_flag and eq else None
        return True

    def peek(self) -> str | None:
        return self.argv[self.i + 1] if self.i + 1 < len(self.argv) else None

    def value(self) -> str:
        if self.inline is not None:
            return self.inline
        if self.peek() is None:
            raise ImportError_(f"{self.flag} needs a value")
        self.i += 1
        return self.argv[self.i]


def parse_command(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One engine entry from a vLLM server command's arguments and its environment."""
    engine: dict[str, Any] = {}
    args: list[str] = []
    transfer: dict | None = None
    events: dict | None = None
    model_path = None
    words = _ArgCursor(argv)
    while words.next():
        word, flag = words.word, words.flag
        if not word.startswith("-") and model_path is None:
            model_path = word
        elif flag == "--model":
            model_path = words.value()
        elif flag in SIZE_FLAGS:
            engine[SIZE_FLAGS[flag]] = _int(flag, words.value())
        elif flag in ("--data-parallel-rank", "-dpn"):
            engine["data_parallel_start_rank"] = _int(flag, words.value())
            engine["data_parallel_size_local"] = 1
        elif flag == "--host":
            engine["host"] = words.value()
        elif flag == "--served-model-name":
            engine["model"] = words.value()
            while (following := words.peek()) is not None and not following.startswith("-"):
                words.next()  # further names: the first one is the routed name
        elif flag == "--kv-transfer-config":
            transfer = _json(flag, words.value())
        elif flag == "--kv-events-config":
            events = _json(flag, words.value())
        elif flag in DROPPED_WITH_VALUE:
            words.value()
        elif flag in DROPPED_FLAGS:
            pass
        elif flag == "--distributed-executor-backend" and not words.inline and words.peek() == "mp":
            words.next()  # the agent adds it for cross-node engines; mp is also the single-node default
        else:
            args.append(word)
    if model_path is None:
        raise ImportError_("no model path in the vllm command")
    engine = {"model_path": model_path, **engine}
    engine.setdefault("model", model_path.rstrip("/").rsplit("/", 1)[-1])
    if transfer:
        _apply_transfer(engine, transfer)
    if events is not None:
        engine["kv_events"] = bool(events.get("enable_kv_cache_events", True))
    if engine.get("data_parallel_size", 1) > 1 and engine.get("kv_events", True):
        # DP ranks publish on tcp ports (base + rank): keep the script's port, else vLLM's default 5557.
        port = re.search(r"^tcp://.*:(\d+)$", str((events or {}).get("endpoint", "")))
        engine["kv_events_port"] = int(port.group(1)) if port else DEFAULT_KV_EVENTS_PORT
    _apply_env(engine, env)
    if args:
        engine["args"] = args
    return engine


def _apply_transfer(engine: dict[str, Any], transfer: dict) -> None:
    transfer = dict(transfer)
    connector = transfer.pop("kv_connector", None)
    role = ROLES.get(str(transfer.pop("kv_role", "kv_both")), "hybrid")
    transfer.pop("engine_id", None)
    if connector:
        engine["kv_connector"] = connector
    engine["role"] = role
    if "kv_port" in transfer:
        engine["kv_port"] = _int("kv_port", str(transfer.pop("kv_port")))
    extra = dict(transfer.pop("kv_connector_extra_config", None) or {})
    own = extra.get(role)
    if isinstance(own, dict):
        own = dict(own)
        for key, field in EXTRA_SIZES.items():
            if key in own:
                value = own.pop(key)
                engine.setdefault(field, _int(f"kv_connector_extra_config.{role}.{key}", str(value)))
        if own:
            extra[role] = own
        else:
            del extra[role]
    if extra:
        engine["kv_connector_extra_config"] = extra
    if transfer:
        engine["kv_transfer_config"] = transfer


def _apply_env(engine: dict[str, Any], env: dict[str, str]) -> None:
    env = dict(env)
    devices = env.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    if devices and re.fullmatch(r"\d+(,\d+)*", devices):
        engine["devices"] = [int(d) for d in devices.split(",")]
    elif devices:
        env["ASCEND_RT_VISIBLE_DEVICES"] = devices
    partition = env.get("VLLM_PP_LAYER_PARTITION")
    prefill = (engine.get("kv_connector_extra_config") or {}).get("prefill") or {}
    if partition and engine.get("role") == "prefill" and str(prefill.get("pp_layer_partition")) == partition:
        env.pop("VLLM_PP_LAYER_PARTITION")
    if env:
        engine["env"] = env


def _backend(text: str, engines: list[dict]) -> str:
    ascend = "ASCEND_" in text or "HCCL_" in text or "vllm_ascend" in text or "--quantization ascend" in text
    ascend = ascend or any(str(e.get("kv_connector", "")).startswith("Mooncake") for e in engines)
    return "vllm-ascend" if ascend else "vllm"


def import_script(text: str, positional: list[str] | None = None, node_id: str = "node-1",
                  instance_prefix: str | None = None, host: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The `node_agents` entry (a dict ready for YAML) for the vLLM commands of a launch script."""
    variables = {str(i + 1): v for i, v in enumerate(positional or [])}
    exported: dict[str, str] = {}
    engines: list[dict[str, Any]] = []
    for line in _logical_lines(text):
        assign = _ASSIGN.match(line)
        if assign and not _is_command(shlex.split(line, comments=True))[0]:
            name, raw = assign.groups()
            try:
                words = shlex.split(_substitute(raw, variables), comments=True)
            except ValueError:
                words = [raw]
            value = words[0] if words else ""
            variables[name] = value
            if line.lstrip().startswith("export "):
                exported[name] = value
            continue
        try:
            words = shlex.split(_substitute(line, variables), comments=True)
        except ValueError as exc:
            raise ImportError_(f"cannot read the line {line[:60]!r}: {exc}") from None
        is_vllm, start = _is_command(words)
        if not is_vllm:
            continue
        end = next(
            (i for i, w in enumerate(words) if w in SHELL_TOKENS or w.startswith((">", "2>"))), len(words)
        )
        words = words[:end]
        inline_env = {}
        for word in words[: start - 2]:
            if m := _ASSIGN.match(word):
                inline_env[m.group(1)] = m.group(2)
        engines.append(parse_command(words[start:], {**exported, **inline_env}))
    if not engines:
        raise ImportError_("no `vllm serve` command found")
    backend = _backend(text, engines)
    counters: dict[str, int] = {}
    for index, engine in enumerate(engines):
        prefix = instance_prefix or {"prefill": "prefill", "decode": "decode"}.get(
            engine.get("role", ""), "engine"
        )
        number = counters[prefix] = counters.get(prefix, -1) + 1
        unresolved = [k for k, v in engine.items() if isinstance(v, str) and _VAR.search(v)]
        if unresolved:
            raise ImportError_(
                f"{unresolved[0]} is {engine[unresolved[0]]!r}: pass the script's arguments after it"
            )
        engine_host = host or engine.pop("host", None)
        engine.pop("host", None)
        if engine_host in (None, "0.0.0.0", "::", ""):
            engine_host = variables.get("HCCL_IF_IP") or variables.get("local_ip") or "127.0.0.1"
        engine.update(instance_id=f"{prefix}-{number}", backend=backend, host=engine_host)
        engine.setdefault("port", 8000)
        for size in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            if engine.get(size) == 1:
                del engine[size]
        engines[index] = {k: engine[k] for k in (*KEY_ORDER, *engine) if k in engine}
    return {"node_id": node_id, "engines": engines}


def render(entry: dict[str, Any]) -> str:
    """The YAML an operator pastes under `node_agents:`."""
    return yaml.safe_dump({"node_agents": [entry]}, sort_keys=False, default_flow_style=None, width=110)


def main(
    script: str, positional: list[str], node_id: str, instance_prefix: str | None, host: str | None
) -> int:
    """CLI body: prints the YAML, or one error line and exit code 2."""
    import sys

    try:
        with open(script) as f:
            text = f.read()
        entry = import_script(text, positional, node_id, instance_prefix, host)
    except OSError as exc:
        print(f"tandem import-vllm: {script}: {exc.strerror}", file=sys.stderr)
        return 2
    except ImportError_ as exc:
        print(f"tandem import-vllm: {script}: {exc}", file=sys.stderr)
        return 2
    from node_agent.config import NodeAgentConfig

    try:
        NodeAgentConfig.model_validate(entry)
    except ValueError as exc:
        first = str(exc).splitlines()
        print(
            f"tandem import-vllm: {script}: the result does not validate: {' '.join(first[:3])}",
            file=sys.stderr,
        )
        return 2
    sys.stdout.write(render(entry))
    return 0
