"""``package.module:callable`` specs (--model, --dataset, --loss, --collate) resolved to
the user's callables, with a one-line ConfigError when they do not resolve. Runs on the
driver (its checks) and on workers (the loop, the data readers)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from ray_ddp.errors import ConfigError


def load_callable(spec: str, what: str = "model") -> Callable[..., Any]:
    """Resolve ``package.module:callable``; raise ConfigError with the reason if it fails."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} '{spec}' must look like package.module:callable")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import-time failure of user code is the user's to fix
        raise ConfigError(
            f"{what} '{spec}': cannot import {module_name} ({type(err).__name__}: {err}); "
            "check the module is on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{what} '{spec}': {module_name} has no callable named {attr}")
    return fn
