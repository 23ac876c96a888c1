"""ray_ddp: PyTorch DistributedDataParallel training on a Ray cluster (Ray Train V2).

    from ray_ddp import TrainConfig, run
    summary = run(TrainConfig(model="toy", workers=2, epochs=3))

``run`` does what ``ray-ddp train`` does and returns a RunSummary.
"""

from .config import ConfigError, TrainConfig
from .driver import RunSummary, TrainingError, run

__all__ = ["ConfigError", "RunSummary", "TrainConfig", "TrainingError", "run"]
__version__ = "0.1.0"
