"""LoRA adapters as vLLM 0.32 serves them: the API's table of loaded adapters, the engine's CPU cache of adapter
weights (LRU), and the per-step slot rule. Mechanism only: the HTTP routes (`api_server`), the scheduler and the
engine loop call it.

Facts read from vLLM 0.32 (vllm/entrypoints/openai/models/serving.py, vllm/lora/peft_helper.py,
vllm/lora/worker_manager.py, vllm/config/lora.py, vllm/v1/core/sched/scheduler.py) and checked on the wire against
CPU vLLM with a local adapter (tests/vllm/test_lora_conformance.py):
- `--max-lora-rank` is one of `RANKS` (default 16); `--max-loras` (default 1) adapters may run in one step: a
  waiting request whose adapter would be one more is skipped for that step; `--max-cpu-loras` (default
  `max_loras`, never below it) adapters' weights stay in memory, least recently used evicted first. An adapter
  evicted from that cache stays loaded for the API: its next request loads its weights again (a step's cost).
- Loading checks, in order: both names given (400), the name is not a served base model (400), not loaded already
  unless `load_inplace` (400); then the engine reads the adapter: no `adapter_config.json` at the path is 404
  `Loading lora <name> failed: No adapter found for <path>`, a rank above `--max-lora-rank` a 500. A reload in
  place keeps the adapter's integer id; a new name gets the next one (1, 2, ...).
- Unloading only forgets the name (404 when unknown): the engine keeps the weights cached.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

#: vLLM's `MaxLoRARanks`: the values `--max-lora-rank` takes.
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16
DEFAULT_MAX_LORAS = 1
#: What one adapter load cost real CPU vLLM 0.32 for the tiny test adapter (rank 8, q/v of 2 layers): 35-121 ms
#: over 9 loads, median about 50 ms (docs/simengine.md). Real adapters on accelerators are larger; set the flag.
DEFAULT_LOAD_MS = 50.0


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One loaded adapter (vLLM's `LoRARequest`)."""

    name: str
    #: Where its weights were read from; part of every block hash of its requests, as in vLLM.
    path: str
    #: vLLM's `lora_int_id` (events' `lora_id`): 1, 2, ... in load order, kept by a reload in place.
    int_id: int
    rank: int
    #: The base model it adapts (`/v1/models` `parent`).
    parent: str


class LoraError(Exception):
    """A load or unload refused as vLLM refuses it: message, OpenAI error type and HTTP status."""

    def __init__(self, message: str, kind: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.status = status


def adapter_rank(path: str) -> int:
    """The largest rank of the adapter at `path` (`r` and `rank_pattern` of its `adapter_config.json`);
    FileNotFoundError when there is none, ValueError when it is unreadable."""
    config_file = Path(path) / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {config_file}: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int):
        raise ValueError(f"{config_file}: `r` (the adapter's rank) must be an integer")
    pattern = config.get("rank_pattern") or {}
    ranks = [v for v in pattern.values() if isinstance(v, int)] if isinstance(pattern, dict) else []
    return max([config["r"], *ranks])


class LoraRegistry:
    """The adapters an engine serves and the weights it keeps in memory."""

    def __init__(
        self, base_names: list[str], max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None
    ) -> None:
        self.base_names = base_names
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        #: Loaded adapters by name, in load order (`/v1/models` lists them so).
        self.adapters: dict[str, LoraAdapter] = {}
        #: Adapter ids whose weights are in memory, least recently used first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._next_id = 0

    def get(self, name: str) -> LoraAdapter | None:
        return self.adapters.get(name)

    def check_load(self, name: str, path: str, load_inplace: bool = False) -> None:
        """The API's checks before the engine reads anything (all 400)."""
        if not name or not path:
            raise LoraError("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name in self.base_names:
            raise LoraError(
                f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400
            )
        if not load_inplace and name in self.adapters:
            raise LoraError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )

    def read(self, name: str, path: str) -> int:
        """What the engine's load validates: the adapter exists (404) and fits `--max-lora-rank` (500)."""
        try:
            rank = adapter_rank(path)
        except FileNotFoundError:
            raise LoraError(
                f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404
            ) from None
        except ValueError as e:
            raise LoraError(str(e), "InternalServerError", 500) from None
        if rank > self.max_lora_rank:
            raise LoraError(
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.",
                "InternalServerError",
                500,
            )
        return rank

    def add(self, name: str, path: str, rank: int, parent: str | None = None) -> LoraAdapter:
        """Registers a read adapter (after `check_load` and `read`) and caches its weights."""
        previous = self.adapters.get(name)
        if previous is not None:
            int_id = previous.int_id
        else:
            self._next_id += 1
            int_id = self._next_id
        adapter = LoraAdapter(name, path, int_id, rank, parent or self.base_names[0])
        self.adapters[name] = adapter
        self._cached.pop(int_id, None)
        self.touch(adapter)
        return adapter

    def remove(self, name: str) -> None:
        if not name:
            raise LoraError(
                "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400
            )
        if name not in self.adapters:
            raise LoraError(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.adapters[name]  # as vLLM: the weights stay in the engine's cache

    def touch(self, adapter: LoraAdapter) -> bool:
        """Marks the adapter's weights most recently used; True when they had to be read again (evicted before),
        which costs the step a load. Evicts the least recently used beyond `max_cpu_loras`."""
        cached = self._cached
        hit = adapter.int_id in cached
        if hit:
            cached.move_to_end(adapter.int_id)
        else:
            cached[adapter.int_id] = None
            while len(cached) > self.max_cpu_loras:
                cached.popitem(last=False)
        return not hit

    @property
    def cached_ids(self) -> list[int]:
        """Ids of the adapters in memory, least recently used first."""
        return list(self._cached)


def may_schedule(active: set[int], adapter: LoraAdapter | None, max_loras: int) -> bool:
    """vLLM's slot rule for a waiting request: the base model always fits; an adapter fits when it already runs
    in this step or fewer than `max_loras` adapters do."""
    return adapter is None or adapter.int_id in active or len(active) < max_loras


def parse_lora_module(item: str) -> tuple[str, str, str | None]:
    """One `--lora-modules` value: `name=path`, or JSON `{"name", "path", "base_model_name"?}`."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return name, path, None
    try:
        raw = json.loads(item)
    except json.JSONDecodeError:
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("name"), str)
        or not isinstance(raw.get("path"), str)
    ):
        raise ValueError(f"Invalid fields for --lora-modules: {item}")
    base = raw.get("base_model_name")
    return raw["name"], raw["path"], base if isinstance(base, str) else None
