"""The strategy a run's config names. Runs on workers."""

from __future__ import annotations

from ray_ddp.parallel.ddp import DDPStrategy
from ray_ddp.parallel.fsdp import FSDPStrategy
from ray_ddp.parallel.strategy import Strategy


def build_strategy(cfg) -> Strategy:
    return {"ddp": DDPStrategy, "fsdp": FSDPStrategy}[cfg.strategy](cfg)
