"""Tools of the simengine-vs-vLLM conformance suite: start both engines the same way, send one exchange to each,
reduce answers to their structure (keys, types, list lengths; never generated text) and list the differences.

`ALLOWED` is the allow-list of known differences, by case and structure path (fnmatch patterns); docs/simengine.md
mirrors it ("Known differences from vLLM 0.32"). A difference not listed fails the suite.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from tests.helpers import free_ports, wait_until

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("TANDEM_VLLM_PYTHON", "")
MODEL = os.environ.get("TANDEM_TINY_MODEL", "")
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
#: KV blocks a request can use: vLLM's `--num-gpu-blocks-override 24` keeps one as its null block.
USABLE_BLOCKS = 23
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(slots=True)
class Engine:
    """One engine process under test with its HTTP base URL and KV event endpoints."""

    #: "vllm" or "sim".
    name: str
    url: str
    proc: subprocess.Popen
    #: ipc:// endpoints of the live PUB socket and the replay ROUTER.
    pub: str
    replay: str
    log: Path

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}"
            )
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _events_config(workdir: Path, name: str) -> tuple[str, str, str]:
    pub, replay = f"ipc://{workdir}/{name}.pub", f"ipc://{workdir}/{name}.replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
              "topic": "kv"}  # fmt: skip
    return json.dumps(config), pub, replay


def start_engines(
    workdir: Path, algo: str = "sha256", extra: tuple[str, ...] = (), environ: dict[str, str] | None = None
) -> tuple[Engine, Engine]:
    """Real vLLM and simengine with the same model, block size, limits, KV event config and hash seed (`extra`
    flags and `environ` variables given to both)."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(environ or {})}  # fmt: skip
    common = ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--block-size", str(BLOCK_SIZE),
              "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--enable-request-id-headers",
              "--prefix-caching-hash-algo", algo, *extra]  # fmt: skip
    engines = []
    for name, port in zip(("vllm", "sim"), free_ports(2), strict=True):  # one call: the two ports differ
        events, pub, replay = _events_config(workdir, f"{name}-{algo}")
        if name == "vllm":
            argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--enforce-eager",
                    "--dtype", "float32", "--num-gpu-blocks-override", str(USABLE_BLOCKS + 1)]  # fmt: skip
        else:
            argv = [sys.executable, "-m", "simengine", MODEL_NAME, "--tokenizer", MODEL, "--speedup", "20",
                    "--npu-blocks", str(USABLE_BLOCKS)]  # fmt: skip
        log = workdir / f"{name}-{algo}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*argv, *common, "--port", str(port), "--kv-events-config", events],
                cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        engines.append(Engine(name, f"http://127.0.0.1:{port}", proc, pub, replay, log))
    for engine in engines:
        wait_until(engine.healthy, 300, f"{engine.name} /health")
    return engines[0], engines[1]


# -- exchanges ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Case:
    """One request of the table, sent unchanged to both engines."""

    name: str
    path: str
    body: Any = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    #: Read the answer as SSE (`data:` lines) instead of one JSON document.
    stream: bool = False
    #: Send the body as these raw bytes (invalid JSON cases).
    raw: bytes | None = None


@dataclass(slots=True)
class Answer:
    """What an engine answered, reduced for comparison."""

    status: int
    headers: dict[str, str]
    body: Any


def send(engine: Engine, case: Case) -> Answer:
    headers = {"Content-Type": "application/json", **case.headers} if case.method == "POST" else case.headers
    content = (
        case.raw
        if case.raw is not None
        else (json.dumps(case.body).encode() if case.body is not None else None)
    )
    with httpx.stream(
        case.method, engine.url + case.path, content=content, headers=headers, timeout=120
    ) as r:
        text = r.read().decode()
        hdrs = {k.lower(): v for k, v in r.headers.items()}
    if case.stream and r.status_code == 200:
        chunks = []
        for line in text.split("\n"):
            if line.startswith("data: "):
                payload = line[6:]
                chunks.append(payload if payload == "[DONE]" else json.loads(payload))
        return Answer(r.status_code, hdrs, chunks)
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = text
    return Answer(r.status_code, hdrs, body)


#: Maps keyed by data (token text or id), compared as "any key -> one value shape": logprobs' top alternatives.
DATA_KEYED = (".logprobs.top_logprobs[]", "prompt_logprobs[]")
#: Lists with one entry per token (a completion's logprobs alternatives per token, a chat answer's logprobs per token):
#: reduced to their distinct entry shapes, like lists of scalars, since how many tokens one stream chunk carries
#: follows timing (a busy vLLM sends two).
PER_TOKEN = (".logprobs.top_logprobs", ".logprobs.content")
#: Shape of an empty list of scalars: matches a list of any scalar type.
EMPTY = "list of nothing"


def shape(value: Any, path: str = "") -> Any:
    """Structure of a JSON value: dicts by key, lists element by element, scalars by type. Lists of scalars
    (token ids, bytes, offsets) reduce to their distinct types, per-token lists to their distinct entry shapes, maps
    keyed by data to one entry: their lengths follow the generated text, not the wire format."""
    if isinstance(value, dict):
        if path.endswith(DATA_KEYED):
            shapes = {json.dumps(shape(v, path + ".*"), sort_keys=True) for v in value.values()}
            return {"<key>": sorted(shapes)}
        return {k: shape(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        if not value:
            return [EMPTY]
        if all(not isinstance(v, dict | list) for v in value):
            return ["list of " + "|".join(sorted({shape(v) for v in value}))]
        if path.endswith(PER_TOKEN):  # a token with empty text has empty `bytes`: the same kind of entry
            distinct = {_bytes_as_ints(json.dumps(shape(v, path + "[]"), sort_keys=True)) for v in value}
            return [json.loads(s) for s in sorted(distinct)]
        return [shape(v, path + "[]") for v in value]
    if value is None:
        return "null"
    return type(value).__name__


def _bytes_as_ints(dumped: str) -> str:
    """A dumped shape with its empty lists counted as lists of ints (an empty token text's `bytes`)."""
    return dumped.replace(f'"{EMPTY}"', '"list of int"')


def stream_shapes(chunks: list[Any]) -> dict[str, Any]:
    """A stream as its first chunk, its last, and the set of distinct chunk shapes in between: how many token
    chunks there are and how choices interleave follow timing, not the wire format."""
    shapes = [shape(c) for c in chunks]
    # an empty token text has empty `bytes`: the same kind of chunk as one with bytes
    middle = sorted({_bytes_as_ints(json.dumps(s, sort_keys=True)) for s in shapes[1:-1]})
    return {"first": shapes[0] if shapes else None, "last": shapes[-1] if shapes else None, "kinds": middle}


def differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, vLLM side, simengine side) for every place the two shapes differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(a) + [k for k in b if k not in a]:
            p = f"{path}.{k}" if path else k
            if k not in a:
                out.append((p, "<missing>", _brief(b[k])))
            elif k not in b:
                out.append((p, _brief(a[k]), "<missing>"))
            else:
                out.extend(differences(a[k], b[k], p))
        return out
    if isinstance(a, list) and isinstance(b, list):
        if EMPTY in (a[:1] + b[:1]) and all(isinstance(x, str) and x.startswith("list of") for x in a + b):
            return []
        out = []
        if len(a) != len(b):
            out.append((f"{path}#len", len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            out.extend(differences(x, y, f"{path}[{i}]"))
        return out
    return [] if a == b else [(path, _brief(a), _brief(b))]


def _brief(value: Any) -> Any:
    text = json.dumps(value)
    return text if len(text) < 120 else text[:117] + "..."


def compare(case: Case, real: Answer, sim: Answer) -> list[tuple[str, Any, Any]]:
    """Status, the headers that matter, and the body structure (streams collapsed) of one exchange."""
    out: list[tuple[str, Any, Any]] = []
    if real.status != sim.status:
        out.append(("status", real.status, sim.status))
    for name in ("content-type", "x-request-id"):
        rv, sv = real.headers.get(name), sim.headers.get(name)
        if name == "content-type":
            rv, sv = (v.split(";")[0] if v else v for v in (rv, sv))
        if name == "x-request-id" and "X-Request-Id" not in case.headers:
            rv, sv = (v is not None for v in (rv, sv))  # a random id on both sides is a match
        if rv != sv:
            out.append((f"header.{name}", rv, sv))
    if case.stream and isinstance(real.body, list) and isinstance(sim.body, list):
        a, b = stream_shapes(real.body), stream_shapes(sim.body)
        out.extend(
            differences({k: a[k] for k in ("first", "last")}, {k: b[k] for k in ("first", "last")}, "sse")
        )
        out.extend(("sse.kind", x, "<missing>") for x in sorted(set(a["kinds"]) - set(b["kinds"])))
        out.extend(("sse.kind", "<missing>", y) for y in sorted(set(b["kinds"]) - set(a["kinds"])))
    else:
        out.extend(differences(shape(real.body), shape(sim.body), "body"))
    return out


def unexplained(case: str, diffs: list[tuple[str, Any, Any]], allowed: dict[str, tuple[str, ...]]) -> list:
    patterns = allowed.get(case, ()) + allowed.get("*", ())
    return [d for d in diffs if not any(fnmatch.fnmatchcase(d[0], p) for p in patterns)]


# -- KV events ------------------------------------------------------------------------------------------------


def replay(endpoint: str, start: int, timeout: float = 10.0) -> list[tuple[int, Any]]:
    """Every buffered batch from `start` on, as (seq, decoded batch), through a DEALER (docs/wire.md)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise AssertionError(f"no replay answer from {endpoint}")
            frames = sock.recv_multipart()
            seq, payload = frames[-2], frames[-1]
            if seq == END_SEQ:
                return got
            got.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    finally:
        sock.close()


def last_seq(endpoint: str) -> int:
    batches = replay(endpoint, 0)
    return batches[-1][0] if batches else -1
