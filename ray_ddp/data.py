"""Synthetic training data: a regression task labelled by a fixed random teacher.

Runs on workers. Each batch is a pure function of (seed, epoch, step, rank), so a
resumed run sees exactly the batches an uninterrupted run would, with no sampler state
to save, and ranks never see the same rows. The teacher is a fixed linear map plus a
little noise, so the loss really falls as the model learns.
"""

from __future__ import annotations

import torch

_NOISE = 0.01


def teacher_weights(seed: int, input_dim: int, output_dim: int) -> torch.Tensor:
    """The fixed map the synthetic targets come from (the same on every rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    return torch.randn(input_dim, output_dim, generator=g) / input_dim**0.5


def synthetic_batch(teacher: torch.Tensor, seed: int, epoch: int, step: int, rank: int,
                    batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of one rank at one step; identical for identical arguments."""
    key = seed
    for part in (epoch, step, rank):  # a fixed mix, stable across Python versions
        key = (key * 1_000_003 + part + 1) % (1 << 63)
    g = torch.Generator().manual_seed(key)
    x = torch.randn(batch_size, teacher.shape[0], generator=g)
    y = x @ teacher + _NOISE * torch.randn(batch_size, teacher.shape[1], generator=g)
    return x, y
