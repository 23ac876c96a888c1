"""Synthetic regression data: a fixed random teacher labels rows drawn from the seed,
the epoch and the step, so every rank makes exactly its own rows with no data at all.
Runs on workers.
"""

from __future__ import annotations

import torch
from ray_ddp.data.sources import part_span


_NOISE = 0.01


BLOCK_ROWS = 16


def teacher_weights(seed: int, input_dim: int, output_dim: int) -> torch.Tensor:
    """The fixed map the synthetic targets come from (the same on every rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    return torch.randn(input_dim, output_dim, generator=g) / input_dim**0.5


def _block(teacher: torch.Tensor, seed: int, epoch: int, step: int, block: int):
    key = seed
    for part in (epoch, step, block):  # a fixed mix, stable across Python versions
        key = (key * 1_000_003 + part + 1) % (1 << 63)
    g = torch.Generator(device=teacher.device).manual_seed(key)
    x = torch.randn(BLOCK_ROWS, teacher.shape[0], generator=g, device=teacher.device)
    noise = torch.randn(BLOCK_ROWS, teacher.shape[1], generator=g, device=teacher.device)
    # per block, so a row's target never depends on how the batch was split (matmul
    # rounding depends on the shapes it is given)
    return x, x @ teacher + _NOISE * noise


def synthetic_rows(teacher: torch.Tensor, seed: int, epoch: int, step: int, start: int,
                   count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start .. start+count-1`` of the global batch of (epoch, step)."""
    first, last = start // BLOCK_ROWS, (start + count - 1) // BLOCK_ROWS
    blocks = [_block(teacher, seed, epoch, step, b) for b in range(first, last + 1)]
    offset = start - first * BLOCK_ROWS
    x = torch.cat([b[0] for b in blocks])[offset:offset + count]
    y = torch.cat([b[1] for b in blocks])[offset:offset + count]
    return x, y


class SyntheticSource:
    """The synthetic task: every step a full global batch of fresh rows, cut into world x
    accumulation parts in order (rank r takes parts r*accum .. r*accum+accum-1)."""

    def __init__(self, teacher: torch.Tensor, seed: int, rank: int, world: int, global_batch: int,
                 grad_accum: int):
        self.teacher, self.seed, self.rank = teacher, seed, rank
        self.world, self.global_batch, self.grad_accum = world, global_batch, grad_accum
        self.share = global_batch / world

    def micro_batch(self, epoch: int, step: int, micro: int):
        start, count = part_span(self.global_batch, self.world * self.grad_accum,
                                 self.rank * self.grad_accum + micro)
        x, y = synthetic_rows(self.teacher, self.seed, epoch, step, start, count)
        return x, y, self.share

    def close(self) -> None:
        """Nothing is held open: the rows are made at each call."""

    def stand_in(self):
        return synthetic_rows(self.teacher, self.seed, 0, 0, 0, 1)
