"""LoRA adapters of an engine through vLLM's own HTTP routes: load, unload, and which adapters it serves.

Pure functions decide (is a path acceptable, what an engine's answer means, which `/v1/models` entries are
adapters); `EngineAdapters` only sends the requests. Facts from vLLM 0.32 (vllm/entrypoints/openai/models/
serving.py, vllm/entrypoints/serve/lora/api_router.py), checked on the wire against CPU vLLM (docs/simengine.md):
- `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`: 200 with a plain-text line; 400
  `InvalidUserInput` for a missing name, a base model's name, or a name already loaded without `load_inplace`
  ("... has already been loaded ..."); 404 `NotFoundError` when there is no adapter at the path; 500 when the
  engine refuses it (a rank above `--max-lora-rank`, no `--enable-lora`);
- `POST /v1/unload_lora_adapter {"lora_name"}`: 200, or 404 when the name is not loaded;
- both routes are 404 `{"detail": "Not Found"}` unless the engine runs with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`;
- `GET /v1/models`: the base model's entries have `parent: null`, each adapter's names its base model.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

#: A Hugging Face hub id (`org/name`), which vLLM downloads.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: How long one load may take: real adapters on accelerators take seconds (a download longer).
LOAD_TIMEOUT_S = 300.0


class Outcome(enum.Enum):
    """What an engine's answer to a load or unload means."""

    OK = "ok"
    ALREADY_LOADED = "already_loaded"  # the name is loaded (load without load_inplace)
    NOT_FOUND = "not_found"  # no adapter at the path (load) or no such name (unload)
    INVALID = "invalid"  # the request itself is wrong (a base model's name, a missing field)
    REFUSED = "refused"  # the engine cannot take it: a rank too high, LoRA not enabled, routes not mounted
    UNAVAILABLE = "unavailable"  # no answer


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    #: The engine's own message (or why there was none).
    message: str


def check_name(name: str) -> str | None:
    """Why `name` cannot be an adapter name (one line), or None."""
    if not name:
        return "adapter_name is required"
    bad = [c for c in name if c.isspace() or c in ",="]
    if bad:
        return (
            f"adapter_name {name!r} contains {bad[0]!r} (vLLM joins adapter names with commas in its metrics)"
        )
    return None


def check_path(path: str) -> str | None:
    """Why `path` is not an adapter location the agent passes on (one line), or None: an absolute local
    directory without `..` segments, or a hub id (`org/name`). Relative paths would depend on the engine's
    working directory; `..` and URL schemes are refused so that a caller names plainly what the engine reads."""
    if not path:
        return "adapter_path is required"
    if path.startswith("/"):
        if ".." in path.split("/"):
            return f"adapter_path {path!r} has a '..' segment: give the directory itself"
        return None
    if _HUB_ID.match(path) and ".." not in path:
        return None
    return f"adapter_path {path!r} is neither an absolute directory nor a hub id (org/name)"


def load_result(status: int, body: str) -> Result:
    """The meaning of the engine's answer to `/v1/load_lora_adapter`."""
    message = _message(body)
    if status == 400 and "has already been loaded" in message:
        return Result(Outcome.ALREADY_LOADED, message)
    return _result(status, message, "loading")


def unload_result(status: int, body: str) -> Result:
    """The meaning of the engine's answer to `/v1/unload_lora_adapter`."""
    return _result(status, _message(body), "unloading")


def _result(status: int, message: str, action: str) -> Result:
    """What a load or unload answer means, past the cases particular to one of them."""
    if status == 200:
        return Result(Outcome.OK, message)
    if status == 404 and message == "Not Found":
        return Result(Outcome.REFUSED, f"the engine does not serve runtime adapter {action} "
                      "(VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set)")  # fmt: skip
    if status == 404:
        return Result(Outcome.NOT_FOUND, message)
    if status == 400:
        return Result(Outcome.INVALID, message)
    return Result(Outcome.REFUSED, message or f"HTTP {status}")


def served_adapters(models: Any) -> list[str]:
    """The adapter names of a `/v1/models` answer: entries with a `parent`, in listing order."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)]


def _message(body: str) -> str:
    """`error.message` of an OpenAI error, FastAPI's `detail`, or the text itself (a success line)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(parsed.get("detail"), str):
            return parsed["detail"]
    return body.strip()


class EngineAdapters:
    """The HTTP calls, against one engine's base URL."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def load(
        self, http: aiohttp.ClientSession, name: str, path: str, load_inplace: bool = False
    ) -> Result:
        body = {"lora_name": name, "lora_path": path, "load_inplace": load_inplace}
        return await self._post(http, "/v1/load_lora_adapter", body, load_result)

    async def unload(self, http: aiohttp.ClientSession, name: str) -> Result:
        return await self._post(http, "/v1/unload_lora_adapter", {"lora_name": name}, unload_result)

    async def listed(self, http: aiohttp.ClientSession, timeout_s: float = 5.0) -> list[str] | None:
        """The adapters the engine serves now; None when it did not answer."""
        try:
            async with http.get(
                f"{self.base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    return None
                return served_adapters(json.loads(await resp.text()))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    async def _post(self, http: aiohttp.ClientSession, path: str, body: dict, meaning) -> Result:
        try:
            async with http.post(
                self.base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_S)
            ) as resp:
                return meaning(resp.status, await resp.text())
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return Result(Outcome.UNAVAILABLE, f"the engine did not answer {path}: {e or type(e).__name__}")
