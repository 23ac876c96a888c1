"""ray_ddp: PyTorch DistributedDataParallel training on a Ray cluster (Ray Train V2).

    from ray_ddp import TrainConfig, run
    summary = run(TrainConfig(model="toy", workers=2, epochs=3))

``run`` does what ``ray-ddp train`` does and returns a RunSummary. For DDP code you
already have, ``spawn(fn, args, nprocs)`` replaces ``torch.multiprocessing.spawn`` and
``device()`` gives each process its device.
"""

from .config import ConfigError, TrainConfig
from .driver import RunSummary, TrainingError, run
from .spawn import ProcessFailed, device, devices, spawn

__all__ = ["ConfigError", "ProcessFailed", "RunSummary", "TrainConfig", "TrainingError", "device",
           "devices", "run", "spawn"]
__version__ = "0.1.0"
