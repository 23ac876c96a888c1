"""The strategy a run's config names. Runs on workers."""

from __future__ import annotations

from ray_ddp.parallel.ddp import DDPStrategy
from ray_ddp.parallel.fsdp import FSDPStrategy
from ray_ddp.parallel.hsdp import HSDPStrategy
from ray_ddp.parallel.strategy import Strategy


def build_strategy(cfg, node_id=None) -> Strategy:
    """``node_id``: the node this rank runs on (HSDP's default shard group is a node's ranks)."""
    if cfg.strategy == "hsdp":
        return HSDPStrategy(cfg, node_id)
    return {"ddp": DDPStrategy, "fsdp": FSDPStrategy}[cfg.strategy](cfg)
