"""Simulated vLLM engine: vLLM's OpenAI HTTP API, KV events on ZMQ, P/D connector behaviours and a timing model,
without an accelerator. Run it with `python -m simengine --help`."""

from simengine.config import EngineConfig, KVTransferConfig, parse_config
from simengine.kv_cache_manager import KVCacheManager
from simengine.profiles import PROFILES, Profile
from simengine.scheduler import Scheduler

__all__ = [
    "EngineConfig",
    "KVCacheManager",
    "KVTransferConfig",
    "PROFILES",
    "Profile",
    "Scheduler",
    "parse_config",
]
