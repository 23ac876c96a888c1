"""ray_ddp: PyTorch DistributedDataParallel training on a Ray cluster (Ray Train V2).

    from ray_ddp import TrainConfig, run
    summary = run(TrainConfig(model="toy", workers=2, epochs=3))

``run`` does what ``ray-ddp train`` does and returns a RunSummary. For DDP code you
already have, ``spawn(fn, args, nprocs)`` replaces ``torch.multiprocessing.spawn`` and
``device()`` gives each process its device.
"""

from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.driver.summary import RunSummary
from ray_ddp.errors import TrainingError
from ray_ddp.driver.run import run
from ray_ddp.errors import ProcessFailed
from ray_ddp.launch.devices import device, devices
from ray_ddp.launch.spawn import spawn

__all__ = ["ConfigError", "ProcessFailed", "RunSummary", "TrainConfig", "TrainingError", "device",
           "devices", "run", "spawn"]
__version__ = "0.1.0"
