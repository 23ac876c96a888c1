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

import bisect
import itertools
from typing import Callable, Optional

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


def accumulation_for(global_batch: int, world: int, batch_size: int) -> int:
    """Micro-batches per step on each of ``world`` ranks, so that no micro-batch holds
    more than ``batch_size`` rows of a ``global_batch``-row step (elastic runs redo this
    for every world size they get)."""
    return max(1, -(-global_batch // (world * batch_size)))


def part_span(total: int, parts: int, k: int) -> tuple[int, int]:
    """(start, count) of part ``k`` when ``total`` rows are cut into ``parts`` contiguous
    parts whose sizes differ by at most one, larger first (as torch.tensor_split cuts)."""
    size, extra = divmod(total, parts)
    return k * size + min(k, extra), size + (1 if k < extra else 0)


# ----------------------------------------------------------------------------- sources
# A source hands a rank the rows of one micro-batch of a step, and ``share``: the rows
# each rank owns in that step on average (global rows / world size). The loss of a
# micro-batch is its summed error / share, so DDP's average over ranks is the exact mean
# over the global batch, however the rows were split (unequal last steps included).


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


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the rows in an epoch: a permutation fixed by (seed, epoch)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch + 1) % (1 << 63))
    return torch.randperm(n, generator=g)


def rows_of_step(order: torch.Tensor, step: int, rank: int, micro: int, world: int,
                 global_batch: int, grad_accum: int) -> tuple[torch.Tensor, float]:
    """Row indices of one micro-batch, and each rank's share of the step's rows.

    Step ``s`` takes rows ``order[s*G:(s+1)*G]`` (G: the global batch; the last step
    takes what is left) split in order into world x accum parts, so every row is seen
    once per epoch and the global batch does not depend on the split."""
    rows = order[step * global_batch:(step + 1) * global_batch]
    parts = torch.tensor_split(rows, world * grad_accum)
    return parts[rank * grad_accum + micro], len(rows) / world


class IndexedSource:
    """Rows that can be fetched by index (a table in memory, text windows, a user's
    Dataset), in an order fixed by (seed, epoch): step s takes the next global batch of
    that order (``rows_of_step``), so every row is seen exactly once per epoch, with no
    padding, and a step holds the same rows whatever the world size, as long as the
    global batch is the same. A rank whose part of the last step is empty trains on an
    empty batch (zero gradient), so every rank takes the same steps."""

    def __init__(self, rows: int, fetch: Callable[[torch.Tensor], tuple], seed: int, rank: int,
                 world: int, global_batch: int, grad_accum: int):
        self.rows, self.fetch, self.seed = rows, fetch, seed
        self.rank, self.world, self.global_batch, self.grad_accum = rank, world, global_batch, grad_accum
        self._order_epoch, self._order = -1, None

    def micro_batch(self, epoch: int, step: int, micro: int):
        if epoch != self._order_epoch:
            self._order_epoch, self._order = epoch, epoch_order(self.rows, self.seed, epoch)
        idx, share = rows_of_step(self._order, step, self.rank, micro, self.world,
                                  self.global_batch, self.grad_accum)
        x, y = self.fetch(idx)
        return x, y, share


def tensor_fetcher(x: torch.Tensor, y: torch.Tensor) -> Callable[[torch.Tensor], tuple]:
    """fetch(indices) -> rows of two tensors held in memory."""
    return lambda idx: (x[idx], y[idx])


def rows_fetcher(dataset, collate: Optional[Callable] = None) -> Callable:
    """fetch(indices) -> (inputs, targets) of a map-style Dataset, collated; an empty index
    list gives an empty batch of the right structure (``default_collate([])`` fails)."""
    from torch.utils.data import default_collate

    collate = collate or default_collate
    empty = []

    def fetch(idx: torch.Tensor):
        if len(idx) == 0:
            if not empty:
                empty.append(empty_batch(collate([dataset[0]])))
            x, y = empty[0]
        else:
            x, y = collate([dataset[i] for i in idx.tolist()])
        return as_float32(x), as_float32(y)

    return fetch


def as_float32(batch):
    """float64 tensors (numpy's default) as float32, the models' dtype; the rest as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.float() if batch.dtype == torch.float64 else batch
    if isinstance(batch, dict):
        return {k: as_float32(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(as_float32(v) for v in batch)
    return batch


def empty_batch(batch):
    """The same structure with zero rows: what a rank trains on when its share is empty."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: empty_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(empty_batch(v) for v in batch)
    return batch


def part_bounds(rows: int, world: int) -> list[int]:
    """Streaming: rank r reads rows bounds[r] .. bounds[r+1]-1 of the epoch's order, one
    contiguous part each (sizes differ by at most one row), so no row is read twice."""
    return [rows * r // world for r in range(world + 1)]


class StreamSource:
    """A parquet data set read one row group at a time, for data larger than memory.

    Each epoch the row groups come in an order fixed by (seed, epoch), their rows
    shuffled within the group (also fixed); rank r trains on its contiguous part of
    that stream (``part_bounds``), cut into ``steps`` pieces (one per step, sizes
    differing by at most one row: about global batch / world rows), each cut into the
    step's micro-batches. Every row is seen exactly once per epoch, the order is the
    same run to run, the steps of an epoch do not depend on the world size, and any step
    can be found again (a mid-epoch resume skips whole row groups without reading them).
    A rank holds one row group in memory. Parts are per rank, so a world-size change
    inside an epoch re-cuts the rest of that epoch: there, rows may be seen twice or not
    at all (the next epoch is whole again)."""

    def __init__(self, groups: list[tuple[str, int, int]],
                 read_group: Callable[[str, int], tuple[torch.Tensor, torch.Tensor]],
                 seed: int, rank: int, world: int, steps: int, grad_accum: int):
        self.groups, self.read_group, self.seed = groups, read_group, seed
        self.rank, self.world, self.steps, self.grad_accum = rank, world, steps, grad_accum
        self.bounds = part_bounds(sum(rows for _, _, rows in groups), world)
        self._epoch, self._starts, self._order = -1, [], None
        self._cached_key, self._cached = None, None

    def micro_batch(self, epoch: int, step: int, micro: int):
        part = self.bounds[self.rank + 1] - self.bounds[self.rank]
        piece_start, piece_rows = part_span(part, self.steps, step)
        start, count = part_span(piece_rows, self.grad_accum, micro)
        x, y = self._rows(epoch, self.bounds[self.rank] + piece_start + start, count)
        return x, y, self._rows_in_step(step) / self.world

    def _rows_in_step(self, step: int) -> int:
        return sum(part_span(self.bounds[r + 1] - self.bounds[r], self.steps, step)[1]
                   for r in range(self.world))

    def _rows(self, epoch: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start .. start+count-1`` of the epoch's stream."""
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(len(self.groups), self.seed, epoch).tolist()
            # where each group starts in the epoch's stream (linear: 100k groups are common)
            self._starts = [0, *itertools.accumulate(self.groups[g][2] for g in self._order)][:-1]
        xs, ys = [], []
        while count > 0 or not xs:
            k = bisect.bisect_right(self._starts, start) - 1
            gx, gy = self._group(epoch, k)
            take = gx[start - self._starts[k]:start - self._starts[k] + count]
            xs.append(take)
            ys.append(gy[start - self._starts[k]:start - self._starts[k] + count])
            start, count = start + len(take), count - len(take)
        return torch.cat(xs), torch.cat(ys)

    def _group(self, epoch: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k-th row group of the epoch's order, its rows shuffled (the last one read is kept)."""
        index = self._order[k]
        if self._cached_key != (epoch, index):
            path, row_group, _ = self.groups[index]
            x, y = self.read_group(path, row_group)
            perm = epoch_order(len(x), self.seed * 7919 + index + 1, epoch)
            self._cached_key, self._cached = (epoch, index), (x[perm], y[perm])
        return self._cached


def steps_for_rows(rows: int, global_batch: int) -> int:
    """Steps per epoch: one pass over ``rows`` in global batches (in memory or streamed)."""
    return max(1, -(-rows // global_batch))
