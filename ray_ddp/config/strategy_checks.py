"""The checks of --strategy and the options that go with it (--fsdp-wrap,
--fsdp-shard-size, DDP's own settings), each refused in one line. Runs on the driver."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_ddp.config.choices import SHARDED_STRATEGIES, STRATEGIES
from ray_ddp.config.workers import worker_range
from ray_ddp.errors import ConfigError

if TYPE_CHECKING:
    from ray_ddp.config.train import TrainConfig


def check_strategy(cfg: TrainConfig) -> None:
    if cfg.strategy not in STRATEGIES:
        raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {cfg.strategy}")
    if cfg.strategy in SHARDED_STRATEGIES:
        _check_sharded(cfg)
    elif cfg.fsdp_wrap is not None:
        raise ConfigError("--fsdp-wrap is for --strategy fsdp; add --strategy fsdp or drop it")
    if cfg.fsdp_shard_size is not None and cfg.strategy != "hsdp":
        raise ConfigError("--fsdp-shard-size is for --strategy hsdp; add --strategy hsdp or drop it")


def _check_sharded(cfg: TrainConfig) -> None:
    """What FSDP (and HSDP) cannot combine with, each refused in one line."""
    named = f"--strategy {cfg.strategy}"
    if cfg.model == "toy-mp":
        raise ConfigError(f"toy-mp splits the model over a GPU pair by hand; {named} shards every layer "
                          f"across the ranks instead: use --model toy (or mlp) with {named}")
    if cfg.gpus_per_worker == 2:
        raise ConfigError(f"{named} gives each worker one GPU (it shards the model across the "
                          "workers instead); use --gpus-per-worker 1")
    if cfg.amp == "fp16":
        raise ConfigError(f"{named} trains in bf16 (FSDP2's mixed precision), not fp16 with "
                          "a gradient scaler; use --amp bf16")
    sizes = worker_range(cfg.workers)
    size = cfg.fsdp_shard_size
    if size and sizes is not None:
        lo, hi = sizes
        if lo == hi and lo % size:
            raise ConfigError(f"--fsdp-shard-size {size} does not divide --workers {lo}; give a divisor of {lo}")
        odd = [n for n in range(lo, hi + 1) if n % size]
        if lo != hi and odd:  # an elastic run may come to any size of its range
            raise ConfigError(f"--fsdp-shard-size {size} does not divide every world size of --workers {lo}-{hi} "
                              f"({odd[0]} is not a multiple of it); give a range of multiples of {size}, "
                              f"or shard size 1")
    if cfg.find_unused_parameters:
        raise ConfigError("--find-unused-parameters is a DDP setting; FSDP handles a forward that "
                          "skips parameters itself: drop the flag")
    for flag, value in (("--plain-ddp", cfg.plain_ddp), ("--static-graph", cfg.static_graph),
                        ("--bucket-mb", cfg.bucket_mb)):
        if value:
            raise ConfigError(f"{flag} is a DDP setting; drop it with {named}")
    if cfg.fsdp_wrap is not None and not [c for c in cfg.fsdp_wrap.split(",") if c.strip()]:
        raise ConfigError("--fsdp-wrap needs at least one class name, e.g. torch.nn.TransformerEncoderLayer")
