"""Reading YAML config files: every mistake becomes one `ConfigError` line naming the file and the key.

The runtime knows no component: the layer that composes a file (`mesh.config`) passes the pydantic model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(Exception):
    """A configuration mistake, as one line that names the file and the key."""


def read_yaml(path: str | Path) -> Any:
    """The YAML document at `path`; a missing file or a syntax error is a `ConfigError`."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} invalid YAML: {getattr(exc, 'problem', exc)}") from None


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def validate(model: type[M], data: Any, path: str) -> M:
    """`data` (a loaded YAML document) as `model`; raises ConfigError naming the first bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        where = f"{_location(err['loc'])}: " if err["loc"] else ""
        raise ConfigError(f"{path}: {where}{message}") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
