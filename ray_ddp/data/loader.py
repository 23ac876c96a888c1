"""A user's map-style Dataset read through torch's DataLoader (``--loader-workers N``):
worker processes read and collate the items, a few batches ahead of the training loop,
into pinned memory on a GPU, while the rows stay exactly the ones ray_ddp assigns the
rank. Runs on workers.

The DataLoader is fed by ``StepBatchSampler``: one list of indices per micro-batch, the
same ``rows_of_step`` cut that ``IndexedSource`` fetches in the training thread, so
every guarantee stays (each row once per epoch, the global batch fixed across world
sizes, an exact resume mid-epoch: the sampler starts at the resumed step and never
reads the rows of the steps before it). ``LoaderSource`` is the training source: the
interface of ``IndexedSource``, the same (inputs, targets, share) for every (epoch,
step, micro-batch), checked against a cursor kept beside the sampler (a caller that
asks for another micro-batch than the next gets it, from a restarted iterator, never
the wrong rows). ``loader_val_batches`` reads the validation batches the same way.

A rank whose part of a step is empty (the last step of an epoch, more ranks than rows
left) gets the empty batch ``rows_fetcher`` makes, without the loader.

A Dataset's random draws (augmentations) are seeded per micro-batch (``draw_seed``: run
seed, rank, epoch, step, micro-batch), in the loader process that reads it, around the
items and the collate: torch seeds loader processes once, when they start, and they
persist from epoch to epoch, so their own generators would make a resumed run draw
otherwise than one that never stopped. So any number of loader processes, none included
(the training thread's ``IndexedSource``), draws the same.
"""

from __future__ import annotations

import functools
import multiprocessing
import sys
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ray_ddp.data.sources import draw_seed, epoch_order, rows_of_step, seeded_draws, steps_for_rows
from ray_ddp.data.user import collate_items, rows_fetcher

_PREFETCH = 2  # batches each worker process reads ahead (torch's default)


class MicroBatch(list):
    """A micro-batch's dataset rows (a list of indices, as a batch sampler yields) and the
    seed of its random draws (``draw_seed``), which travels with it to the loader process."""

    def __init__(self, indices: list[int], seed: int):
        super().__init__(indices)
        self.seed = seed


class StepBatchSampler(Sampler[list[int]]):
    """The index lists of one epoch's micro-batches for one rank, from a start (step,
    micro-batch) to the end of the epoch: for each step and each micro-batch, the rows
    ``rows_of_step(epoch_order(rows, seed, epoch), step, rank, micro, ...)``, mapped
    through ``index_map`` (row k of the source is dataset row ``index_map[k]``: a
    ``--val-fraction`` training subset), each a ``MicroBatch`` that carries its draw
    seed. Empty lists are left out: the source makes those batches itself. ``start``
    aims it at another epoch or step; an iteration already begun keeps the start it
    began with."""

    def __init__(self, rows: int, seed: int, rank: int, world: int, global_batch: int,
                 grad_accum: int, steps: int, epoch: int = 0, start_step: int = 0,
                 start_micro: int = 0, index_map: Optional[torch.Tensor] = None):
        self.rows, self.seed, self.rank, self.world = rows, seed, rank, world
        self.global_batch, self.grad_accum, self.steps = global_batch, grad_accum, steps
        self.index_map = index_map
        self._order_epoch, self._order = -1, None
        self.start(epoch, start_step, start_micro)

    def start(self, epoch: int, step: int = 0, micro: int = 0) -> None:
        self.epoch, self.start_step, self.start_micro = epoch, step, micro

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's order of the rows (the last one made is kept)."""
        if epoch != self._order_epoch:
            self._order_epoch, self._order = epoch, epoch_order(self.rows, self.seed, epoch)
        return self._order

    def rows_of(self, epoch: int, step: int, micro: int) -> tuple[torch.Tensor, float]:
        """(the source's row indices, each rank's share of the step): ``rows_of_step``."""
        return rows_of_step(self.order(epoch), step, self.rank, micro, self.world,
                            self.global_batch, self.grad_accum)

    def plan(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(step, micro, dataset row indices) of every non-empty micro-batch from the start."""
        epoch, first_step, first_micro = self.epoch, self.start_step, self.start_micro
        order = self.order(epoch)  # its own: the cache may move on to another epoch meanwhile
        for step in range(first_step, self.steps):
            for micro in range(first_micro if step == first_step else 0, self.grad_accum):
                idx, _ = rows_of_step(order, step, self.rank, micro, self.world, self.global_batch,
                                      self.grad_accum)
                if len(idx):
                    yield step, micro, idx if self.index_map is None else self.index_map[idx]

    def __iter__(self) -> Iterator[MicroBatch]:
        epoch = self.epoch  # read when the iteration begins, as plan() reads it
        for step, micro, idx in self.plan():
            yield MicroBatch(idx.tolist(), draw_seed(self.seed, self.rank, epoch, step, micro))

    def __len__(self) -> int:
        return sum(1 for _ in self.plan())


class LoaderSource:
    """Training rows of a map-style Dataset, read by a DataLoader with ``workers`` worker
    processes: the interface of ``IndexedSource`` (``micro_batch(epoch, step, micro) ->
    (inputs, targets, share)``) and the same batches, collated by ``collate`` (torch's
    ``default_collate`` without one) and made float32 as ``rows_fetcher`` makes them.

    One iteration per epoch, begun at the epoch's first ``micro_batch`` call from that
    call's step (a resumed run never reads the steps it skips). Each call is checked
    against the cursor (the micro-batch the loader yields next); any other
    call restarts the iteration there (``restarts`` counts them). ``steps``: steps per
    epoch (the data's, ``steps_for_rows``, without one); a step past them, or an empty
    share, is fetched in this thread. ``pin``: pinned host memory, for non-blocking
    copies to a GPU (pass ``device.type == "cuda"``)."""

    def __init__(self, dataset, seed: int, rank: int, world: int, global_batch: int, grad_accum: int,
                 steps: Optional[int] = None, collate: Optional[Callable] = None, workers: int = 0,
                 pin: bool = False, index_map: Optional[torch.Tensor] = None,
                 prefetch_factor: int = _PREFETCH):
        rows = len(dataset) if index_map is None else len(index_map)
        self.dataset, self.rows, self.workers = dataset, rows, workers
        self.seed, self.rank = seed, rank
        steps = steps_for_rows(rows, global_batch) if steps is None else steps
        self.sampler = StepBatchSampler(rows, seed, rank, world, global_batch, grad_accum, steps,
                                        index_map=index_map)
        direct = rows_fetcher(dataset, collate)  # empty shares (and steps past ``steps``)
        self._fetch = direct if index_map is None else (lambda idx: direct(index_map[idx]))
        self._new_loader = functools.partial(_data_loader, _SeededBatches(dataset, collate), self.sampler,
                                             _only_item, workers, pin, seed, persistent=True,
                                             prefetch_factor=prefetch_factor)
        self._loader = self._new_loader()
        self._batches: Optional[Iterator] = None  # the loader's iteration
        self._cursor: Optional[Iterator] = None  # what it yields, in order: (epoch, step, micro)
        self._next: Optional[tuple[int, int, int]] = None
        self.restarts = 0  # iterations begun before the one under way had ended (jumps)

    def micro_batch(self, epoch: int, step: int, micro: int):
        idx, share = self.sampler.rows_of(epoch, step, micro)
        key = (epoch, step, micro)
        if len(idx) and self._next != key:
            self._begin(key)
        if len(idx) == 0 or self._next != key:  # empty, or past the sampler's steps: not the loader's
            with seeded_draws(draw_seed(self.seed, self.rank, *key)):  # what the loader would draw
                x, y = self._fetch(idx)
            return x, y, share
        try:
            x, y = next(self._batches)
        except BaseException as err:  # (a Dataset's error, re-raised): the loader would go on
            self._next = None  # with the next micro-batch, so the next call begins again instead
            # Without torch's frames (the message holds the loader process's traceback):
            # they hold the loader's iteration, which the error would then keep in a
            # reference cycle, and when the garbage collector ends an iteration its loader
            # processes get no stop signal: 5 s of waiting for each, at a random later moment.
            raise err.with_traceback(None)
        self._next = next(self._cursor, None)
        return x, y, share

    def _begin(self, key: tuple[int, int, int]) -> None:
        """Start the loader's iteration (and the cursor beside it) at ``key``."""
        epoch, step, micro = key
        if self._next is not None:  # the iteration under way had not ended: a jump
            self.restarts += 1
        self.sampler.start(epoch, step, micro)
        self._cursor = ((epoch, s, m) for s, m, _ in self.sampler.plan())
        self._next = next(self._cursor, None)
        # persistent workers: the same processes; the rest of a previous iteration is dropped
        self._batches = iter(self._loader)

    def stand_in(self):
        """The data set's first row, read in this thread (its draws seeded apart: IndexedSource's)."""
        with seeded_draws(draw_seed(self.seed, self.rank, -1, 0, 0)):
            return self._fetch(torch.zeros(1, dtype=torch.long))

    def close(self) -> None:
        """Stop the worker processes (they also stop with this process): the loader that
        kept them (persistent workers) is dropped, and with the last reference to its
        iteration torch stops them; a later call begins again with a new loader."""
        self._batches = self._cursor = self._next = None
        self._loader = self._new_loader()


def loader_val_batches(dataset, index_lists: Iterable[torch.Tensor], collate: Optional[Callable] = None,
                       workers: int = 0, pin: bool = False,
                       index_map: Optional[torch.Tensor] = None) -> Iterator[tuple[Any, Any]]:
    """The (inputs, targets) batch of each index tensor in ``index_lists`` (dataset rows,
    or rows of ``index_map`` as in ``--val-fraction``), in order, read by a DataLoader
    with ``workers`` processes (begun with the first batch, stopped with the last), as
    ``rows_fetcher`` collates them; an empty list gives its empty batch, without the
    loader. For ``ValSet.batches``' index ranges."""
    lists = [idx if index_map is None else index_map[idx] for idx in index_lists]
    direct = rows_fetcher(dataset, collate)
    batch_lists = [idx.tolist() for idx in lists if len(idx)]
    batches = iter(_data_loader(dataset, batch_lists, _Float32Collate(collate), workers, pin, 0, persistent=False)
                   if batch_lists else ())
    try:
        for idx in lists:
            x, y = direct(idx) if len(idx) == 0 else next(batches)
            yield x, y
    finally:
        del batches  # a consumer that stops early stops the worker processes


def default_loader_workers(cpus_per_worker: int) -> int:
    """Loader processes for a training worker that Ray gave ``cpus_per_worker`` CPUs: one
    CPU stays with the training process (its Python loop, the optimizer, kernel launches
    and collectives), each loader process keeps about one busy; none on one CPU (they
    would only take turns with training), and at most 8: past that the returns are small
    and each process holds its own copy of what it touches of the Dataset (fork shares
    pages until reference counts write to them)."""
    return max(0, min(8, int(cpus_per_worker) - 1))


class _Float32Collate:
    """``collate``, then float64 as float32, in the loader's process, before pinning (a
    conversion after it would copy into unpinned memory). A class, not a closure, so it
    pickles where workers are spawned."""

    def __init__(self, collate: Optional[Callable]):
        self.collate = collate

    def __call__(self, items):
        return collate_items(items, self.collate)


class _SeededBatches(Dataset):
    """A Dataset of micro-batches: ``__getitems__(MicroBatch)`` reads and collates its
    rows as ``rows_fetcher`` does (float32, a ``__getitems__`` of the Dataset used), all
    under the micro-batch's ``seeded_draws``, and hands the batch on as its one item
    (``_only_item``): the collate draws too (a masking collator). A class, so it pickles
    where loader processes are spawned."""

    def __init__(self, dataset, collate: Optional[Callable]):
        self.dataset, self.collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, batch: MicroBatch) -> list:
        with seeded_draws(batch.seed):
            return [rows_fetcher(self.dataset, self.collate)(torch.as_tensor(list(batch), dtype=torch.long))]


def _only_item(items: list):
    """The loader's collate of ``_SeededBatches``: its one item is the collated batch."""
    return items[0]


def _worker_init(worker_id: int) -> None:
    # one intra-op thread per loader process: torch would otherwise size each one's pool
    # to every core of the node (not the CPUs Ray reserved), so N processes would start
    # N x cores threads against the training process; reading and collating items gains
    # nothing from intra-op threads. (torch's worker loop does this too; said here so it
    # holds whatever torch does.)
    torch.set_num_threads(1)


def _worker_context():
    """The start method of the loader's processes: the interpreter's default (None),
    except on Linux where no one chose one and the default is no longer fork (Python 3.14
    made it forkserver): fork there too, as before, so a Dataset or collate that does not
    pickle (a lambda, a class in ``__main__``) still works and processes start at once.
    A method set with ``set_start_method`` is kept."""
    if (sys.platform.startswith("linux") and sys.version_info >= (3, 14)
            and multiprocessing.get_start_method(allow_none=True) is None
            and "fork" in multiprocessing.get_all_start_methods()):
        return multiprocessing.get_context("fork")
    return None


def _data_loader(dataset, batch_sampler, collate_fn: Callable, workers: int, pin: bool,
                 seed: int, persistent: bool, prefetch_factor: int = _PREFETCH) -> DataLoader:
    # a generator of its own: each iteration draws the loader processes' base seed from
    # it, which would otherwise come from (and move) the training process's global RNG
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers,
                      collate_fn=collate_fn, pin_memory=pin,
                      prefetch_factor=prefetch_factor if workers > 0 else None,
                      persistent_workers=persistent and workers > 0,
                      worker_init_fn=_worker_init if workers > 0 else None,
                      multiprocessing_context=_worker_context() if workers > 0 else None,
                      generator=torch.Generator().manual_seed(seed))
