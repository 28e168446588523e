"""Parameters of policies: frozen dataclasses filled from raw config mappings, with errors naming the key."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

P = TypeVar("P")


def parse_params(cls: type[P], raw: Mapping[str, Any] | None, policy: str) -> P:
    """An instance of dataclass `cls` from `raw`; ValueError `"<policy>.<key>: ..."` on an unknown key, a bad type
    (ints are accepted for float fields; booleans never stand for numbers) or a negative number (every policy
    parameter is a weight, threshold, count or seed). A `check()` method on `cls` adds its own rules."""
    raw = dict(raw or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            raise ValueError(f"{policy}.{key}: unknown parameter (known: {', '.join(fields)})")
        expected = hints[key]
        literal = typing.get_args(expected) if typing.get_origin(expected) is typing.Literal else None
        if literal is not None:
            if value not in literal:
                raise ValueError(
                    f"{policy}.{key}: must be one of {', '.join(map(repr, literal))}, got {value!r}"
                )
        elif expected is float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{policy}.{key}: must be a number, got {value!r}")
            value = float(value)
        elif expected is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{policy}.{key}: must be an integer, got {value!r}")
        elif expected is bool and not isinstance(value, bool):
            raise ValueError(f"{policy}.{key}: must be true or false, got {value!r}")
        if expected in (int, float) and value < 0:
            raise ValueError(f"{policy}.{key}: must be >= 0, got {value}")
        values[key] = value
    params = cls(**values)
    check = getattr(params, "check", None)
    if check is not None:
        problem = check()
        if problem:
            raise ValueError(f"{policy}.{problem}")
    return params


def as_dict(params: Any) -> dict[str, Any]:
    """The parameters with defaults filled in (for the effective config)."""
    return dataclasses.asdict(params)
