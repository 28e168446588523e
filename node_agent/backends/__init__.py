"""Engine backends as plug-ins: `interface` defines them, one module per backend, `registry` lists them."""

from node_agent.backends.interface import Backend, ProcessLayout
from node_agent.backends.registry import backend_types, get_backend, register

__all__ = ["Backend", "ProcessLayout", "backend_types", "get_backend", "register"]
