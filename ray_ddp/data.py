"""Synthetic training data: a regression task labelled by a fixed random teacher.

Runs on workers. The rows of a step form one global batch; row ``j`` of step ``s`` in
epoch ``e`` is a pure function of (seed, e, s, j), generated in fixed blocks of 16 rows,
so:
- a rank generates only the rows it trains on (its slice of the global batch);
- the global batch is the same set of rows whatever the split: 2 workers x 64 x 2
  accumulation steps see exactly the 256 rows 1 worker x 256 sees;
- a resumed run sees exactly the batches an uninterrupted run would.
The teacher is a fixed linear map plus a little noise, so the loss really falls.
Rows are generated on the teacher's device (a worker's GPU), so feeding a fast GPU costs
no host time; each device type has its own random stream, identical run to run.
"""

from __future__ import annotations

import torch

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


def micro_batch_start(rank: int, micro: int, grad_accum: int, batch_size: int) -> int:
    """Where a rank's micro-batch begins in the global batch (ranks take contiguous runs)."""
    return (rank * grad_accum + micro) * batch_size
