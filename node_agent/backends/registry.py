"""Explicit registration of the built-in engine backends, and finding the one a config names."""

from __future__ import annotations

from node_agent.backends import simengine, vllm, vllm_ascend
from node_agent.backends.interface import Backend

_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Adds a backend under its `name`; a duplicate name is an error."""
    if backend.name in _BACKENDS:
        raise ValueError(f"engine backend {backend.name!r} is registered twice")
    _BACKENDS[backend.name] = backend


def register_builtin_backends() -> None:
    """Registers every built-in backend (idempotent, also after another backend was registered first). The one list
    of the engines Tandem launches."""
    if simengine.TYPE in _BACKENDS:
        return
    register(simengine.SimengineBackend())
    register(vllm.VllmBackend())
    register(vllm_ascend.VllmAscendBackend())


def backend_types() -> list[str]:
    """Every registered backend name, sorted."""
    register_builtin_backends()
    return sorted(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend named `name`; ValueError naming the known ones."""
    register_builtin_backends()
    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return backend
