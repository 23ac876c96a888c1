"""What the user asked for: TrainConfig (every option, its default and help), every
check, the ``--workers`` range and the flag table."""

from ray_ddp.config.flags import render_flag_table
from ray_ddp.config.train import TrainConfig
from ray_ddp.config.workers import parse_workers, worker_range

__all__ = ["TrainConfig", "parse_workers", "render_flag_table", "worker_range"]
