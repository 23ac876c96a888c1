"""ray_ddp: PyTorch DistributedDataParallel training on a Ray cluster (Ray Train V2).

    from ray_ddp import TrainConfig, run
    summary = run(TrainConfig(model="toy", workers=2, epochs=3))

``run`` does what ``ray-ddp train`` does and returns a RunSummary. For DDP code you
already have, ``spawn(fn, args, nprocs)`` replaces ``torch.multiprocessing.spawn`` and
``device()`` gives each process its device.

The public names are imported on first use (PEP 562): every process that Ray starts for
a run (its workers, Ray Train's controller unpickling the metrics callback, the hang
watch's actor) imports some ``ray_ddp.x.y``, which runs this file first; importing the
whole driver there would cost each of those processes seconds of CPU for nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_PUBLIC = {
    "ConfigError": "ray_ddp.errors", "ProcessFailed": "ray_ddp.errors", "TrainingError": "ray_ddp.errors",
    "TrainConfig": "ray_ddp.config.train", "RunSummary": "ray_ddp.driver.summary",
    "run": "ray_ddp.driver.run", "device": "ray_ddp.launch.devices", "devices": "ray_ddp.launch.devices",
    "spawn": "ray_ddp.launch.spawn",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.driver.run import run
    from ray_ddp.driver.summary import RunSummary
    from ray_ddp.errors import ConfigError, ProcessFailed, TrainingError
    from ray_ddp.launch.devices import device, devices
    from ray_ddp.launch.spawn import spawn


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ray_ddp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
