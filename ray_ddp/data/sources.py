"""Which rows each rank trains on at each step: one order per epoch from the seed, cut
into a fixed global batch, each rank's share into micro-batches; and the parquet
stream's row-group order. Every row once per epoch, however many ranks. Runs on workers
(and on the driver, for the steps of an epoch).

``Source`` and ``ValBatches`` are what every input path gives the loop (data/inputs.py
chooses which, in one place): in-memory rows (``IndexedSource``), the parquet stream
(``StreamSource``), synthetic rows (data/synth.py), a Dataset read by loader processes
(data/loader.py) and Ray Data's shards (data/ray_data.py).

A Dataset's own random draws (augmentations) come from ``seeded_draws``, seeded by the
micro-batch (``draw_seed``), in the training thread as in a loader process.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import random
from typing import Any, Callable, Iterator, Protocol, runtime_checkable
import torch

try:
    import numpy as np
except ImportError:  # torch runs without numpy; its generator is then nothing to seed
    np = None


@runtime_checkable
class Source(Protocol):
    """A rank's training rows. ``micro_batch(epoch, step, micro)`` gives micro-batch
    ``micro`` of this rank's part of a step as (inputs, targets, share), ``share`` being the
    step's rows over the world size (what the loss is weighted by: worker/step.py); an
    empty part is an empty batch, so every rank takes every step. ``close()`` ends what
    the source holds open (loader processes); the loop calls it once, at its end."""

    def micro_batch(self, epoch: int, step: int, micro: int) -> tuple[Any, Any, float]: ...

    def close(self) -> None: ...

    def stand_in(self) -> Any:
        """One real row of the data as (inputs, targets), or None: what a rank runs, times
        0, in place of a micro-batch with no rows before it has trained on any (worker/step.py)."""


@runtime_checkable
class ValBatches(Protocol):
    """A validation set: this rank's batches, every row counted once across the ranks;
    ``equal_counts``: as many batches on every rank (the shorter end with an empty
    one), for a forward that is a collective (FSDP)."""

    def batches(self, rank: int, world: int, batch_size: int, equal_counts: bool = False) -> Iterator[tuple]: ...


def part_span(total: int, parts: int, k: int) -> tuple[int, int]:
    """(start, count) of part ``k`` when ``total`` rows are cut into ``parts`` contiguous
    parts whose sizes differ by at most one, larger first (as torch.tensor_split cuts)."""
    size, extra = divmod(total, parts)
    return k * size + min(k, extra), size + (1 if k < extra else 0)


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
    empty batch (zero gradient), so every rank takes the same steps. A fetch's random
    draws (a Dataset's augmentations) are the micro-batch's ``seeded_draws``: what a
    loader process draws for it (data/loader.py)."""

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
        with seeded_draws(draw_seed(self.seed, self.rank, epoch, step, micro)):
            x, y = self.fetch(idx)
        return x, y, share

    def close(self) -> None:
        """Nothing is held open: the rows are in memory."""

    def stand_in(self):
        # a Dataset's draws for it leave the training's generators where a run that never
        # needed it has them (a restarted rank must draw on as the run that never stopped)
        with seeded_draws(draw_seed(self.seed, self.rank, -1, 0, 0)):
            return self.fetch(torch.zeros(1, dtype=torch.long))


def draw_seed(seed: int, rank: int, epoch: int, step: int, micro: int) -> int:
    """The seed of a micro-batch's random draws (a Dataset's augmentations): where the
    rows fall in the run, never what the process read before, so a resumed run, a restarted
    loader iteration and any number of loader processes draw the same."""
    # blake2b, not hash(): the same in every process and every Python a resume may run on
    digest = hashlib.blake2b(f"{seed},{rank},{epoch},{step},{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@contextlib.contextmanager
def seeded_draws(seed: int) -> Iterator[None]:
    """Draws from torch's, ``random``'s and numpy's global generators inside come from
    ``seed`` (what a Dataset's augmentations use). torch's and ``random``'s are put back
    after, so the training process's own draws (dropout, which a checkpoint keeps) do not
    depend on what the data drew. numpy's is left where the data's draws left it, a
    function of ``seed`` too: ray_ddp draws nothing from it, a checkpoint does not keep it,
    and saving it costs a hundred times what the rest does (at every micro-batch). CPU
    only: torch.manual_seed would also reseed every GPU's generator."""
    saved = torch.get_rng_state(), random.getstate()
    torch.random.default_generator.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % (1 << 32))  # numpy's seeds are 32-bit
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])


def tensor_fetcher(x: torch.Tensor, y: torch.Tensor) -> Callable[[torch.Tensor], tuple]:
    """fetch(indices) -> rows of two tensors held in memory."""
    return lambda idx: (x[idx], y[idx])


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

    def close(self) -> None:
        self._cached_key, self._cached = None, None  # the row group read last

    def stand_in(self):
        x, y = self.read_group(*self.groups[0][:2])  # once, and only for a rank that has read no row
        return x[:1], y[:1]

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
