"""How a YAML file and a plain dict's values become a config's: the file read as one
mapping, each value turned into its field's type, every mistake one ConfigError line.
Runs on the driver (and on workers, where TrainConfig is rebuilt from its dict).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray_ddp.errors import ConfigError


def read_yaml_mapping(path: str) -> dict[str, Any]:
    """The YAML file's mapping of keys to values (an empty file: none)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}; pass an existing YAML file to --config")
    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}; fix the syntax") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return values


def coerce_value(f: dataclasses.Field, value: Any, key: str) -> Any:
    """Turn a YAML/JSON value into the field's type, or say which key is wrong."""
    kind = str(f.type)
    if value is None:
        if "Optional" in kind:
            return None
        raise ConfigError(f"config key '{key}' needs a value")
    if "parse" in f.metadata:
        return f.metadata["parse"](value)
    try:
        if "bool" in kind:
            if isinstance(value, bool):
                return value
            raise ValueError
        if "int" in kind:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if "float" in kind:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        want = kind.replace("Optional[", "").rstrip("]")
        raise ConfigError(f"config key '{key}' must be {want}, got {value!r}") from None
