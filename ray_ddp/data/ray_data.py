"""Ray Data input: ``train_data=`` / ``val_data=`` a ``ray.data.Dataset``, or ``--data PATH
--ray-data`` (parquet read by ``ray.data.read_parquet``). Ray Train's own path: the driver
hands the datasets to the trainer (``datasets=``), each worker reads its shard with
``ray.train.get_dataset_shard`` and ``iter_torch_batches`` (prefetching, on the worker's
device), and the preprocessing (``map_batches``...) runs where Ray Data puts it, CPU
nodes included. Runs on the driver (shape, trainer arguments) and on workers (sources).

What holds, as Ray Data gives it (docs/data.md#ray-data):
- training: each epoch's rows are split over the workers with ``streaming_split(equal=True)``
  (Ray Train's DataConfig): every rank the same number of rows, each row at most once per
  epoch; up to world size - 1 rows an epoch are left out to make the parts equal;
- validation: not split; every rank iterates the whole set in a fixed order and keeps
  every world-th batch, so each row is counted exactly once (each rank reads it all);
- a resume mid-epoch skips the steps already trained, but Ray Data hands out blocks as
  workers ask, so the rows of those steps are not the same ones: some rows of that epoch
  may be seen twice and others not at all; epoch boundaries are exact. A resize (another
  world size) re-splits from the next epoch the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pyarrow.fs as pafs

from ray_ddp.data.table_stats import CheckedTable, column_width, pick_columns
from ray_ddp.errors import ConfigError
from ray_ddp.storage import resolve_storage

TRAIN, VAL = "train", "val"


def is_ray_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("ray.data") and hasattr(obj, "streaming_split")


@dataclass(frozen=True)
class RayDataTables:
    """What a worker needs to read its shards: the columns the driver checked (a
    CheckedTable: features, targets, task, classes) of the training set and of the
    validation set, each None where that set is not a Ray Dataset."""

    table: Optional[CheckedTable] = None
    val_table: Optional[CheckedTable] = None


def plan_ray_data(cfg, shape, train, val) -> Optional[tuple[dict[str, Any], Any, RayDataTables]]:
    """On the driver, once Ray is up: the trainer's ``datasets`` and ``dataset_config``
    and the workers' RayDataTables; None when no set is read through Ray Data."""
    train_ds = train if is_ray_dataset(train) else read_parquet_dataset(cfg.data) if cfg.ray_data else None
    val_ds = shape.val_dataset if shape is not None and shape.val_dataset is not None else (
        read_parquet_dataset(cfg.val_data).materialize() if cfg.ray_data and cfg.val_data else None)
    if train_ds is None and val_ds is None:
        return None
    quiet_ray_data(cfg.verbose)
    datasets, data_config = trainer_datasets(train_ds, val_ds)
    return datasets, data_config, RayDataTables(shape.table if train_ds is not None else None,
                                                shape.val_table if val_ds is not None else None)


def quiet_ray_data(verbose: bool) -> None:
    """Ray Data's progress bars and INFO lines only with --verbose (as Ray's own logs)."""
    if verbose:
        return
    import logging

    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def dataset_table(cfg, ds, where: str, task: Optional[str] = None) -> CheckedTable:
    """The columns of a Ray Dataset object, checked like a parquet set's footers: its
    schema's columns (--features / --target, or f0.. / t0..), the rows counted
    (``ds.count()``: from parquet metadata where the pipeline keeps its rows, else by
    running it once), and for classification the labels' maximum (one pass). ``task``:
    the training data's, for validation rows (else --task's, or the columns')."""
    import pyarrow as pa

    task = task or cfg.task
    quiet_ray_data(cfg.verbose)
    schema = ds.schema()
    if schema is None:
        raise ConfigError(f"{where}: the Ray Dataset has no schema (is it empty?)")
    types = [t if isinstance(t, pa.DataType) else pa.from_numpy_dtype(t) for t in schema.types]
    arrow = pa.schema([pa.field(n, t) for n, t in zip(schema.names, types)])
    if task == "lm":
        raise ConfigError(f"{where}: a Ray Dataset object trains regression or classification; "
                          "for --task lm give the parquet path: --data PATH --ray-data")
    feats = pick_columns(arrow.names, cfg.features, r"f\d+", "features", where)
    targs = pick_columns(arrow.names, cfg.target, r"t\d+", "target", where)
    integer = len(targs) == 1 and pa.types.is_integer(arrow.field(targs[0]).type)
    task = task or ("classification" if integer else "regression")
    if task == "classification" and not integer:
        raise ConfigError(f"{where}: --task classification needs one integer label column; pass --target")
    classes = cfg.num_classes
    # a built-in model needs the class count for its output layer: the labels' maximum,
    # in the same pass as the count (--num-classes saves it); a user's model has its own
    if task == "classification" and classes is None and ":" not in cfg.model:
        from ray.data.aggregate import Count, Max

        found = ds.aggregate(Count(), Max(targs[0]))
        rows, classes = int(found["count()"]), int(found[f"max({targs[0]})"]) + 1
    else:
        rows = ds.count()
    if rows == 0:
        raise ConfigError(f"{where}: the Ray Dataset has no rows")
    return CheckedTable(where, feats, targs, rows, sum(column_width(arrow.field(c), where) for c in feats),
                       sum(column_width(arrow.field(c), where) for c in targs), task, classes)


def trainer_datasets(train, val) -> tuple[dict[str, Any], Any]:
    """TorchTrainer's ``datasets`` and ``dataset_config``: training split equally over the
    workers, validation given whole to each in a fixed order (above)."""
    from ray.train import DataConfig

    datasets = {**({TRAIN: train} if train is not None else {}), **({VAL: val} if val is not None else {})}
    ordered = DataConfig.default_ingest_options()
    ordered.preserve_order = True
    return datasets, DataConfig(datasets_to_split=[TRAIN], execution_options={VAL: ordered})


class RayDataSource:
    """This rank's shard as a training source (``micro_batch(epoch, step, micro)``): one
    iteration of the shard per epoch, cut into micro-batches of the rank's size; a rank
    whose shard ends before the epoch's last step trains on empty batches (every rank's
    shard is as long, so they end together)."""

    def __init__(self, table: CheckedTable, micro_rows: int, grad_accum: int, device, seq_len: int = 0):
        import ray.train

        self.shard = ray.train.get_dataset_shard(TRAIN)
        self.collate = table_collate(table, seq_len)
        self.micro_rows, self.grad_accum, self.device = micro_rows, grad_accum, device
        self._epoch, self._batches, self._step, self._buffer = None, None, -1, []
        self._a_row = None  # the first row read: stand_in()

    def micro_batch(self, epoch: int, step: int, micro: int):
        if epoch != self._epoch:  # a new epoch of the split (every rank starts it together)
            self._epoch, self._step = epoch, step - 1
            self._batches = iter(self.shard.iter_torch_batches(
                batch_size=self.micro_rows, collate_fn=self.collate, prefetch_batches=2,
                device=self.device, pin_memory=self.device.type == "cuda"))
            for _ in range(step * self.grad_accum):  # a mid-epoch resume: those steps are done
                self._keep_a_row(next(self._batches, None))
        if step != self._step:  # the step's micro-batches at once: its share counts them all
            self._step = step
            self._buffer = [next(self._batches, None) for _ in range(self.grad_accum)]
            self._keep_a_row(self._buffer[0])
        share = sum(len(b[1]) for b in self._buffer if b is not None)
        batch = self._buffer[micro]
        return (*(batch if batch is not None else self.collate.empty()), share)

    def close(self) -> None:
        """Drop the shard's iteration (and the batches it prefetched)."""
        self._epoch, self._batches, self._step, self._buffer = None, None, -1, []

    def stand_in(self):
        """A row this rank's shard gave (one of a resume's skipped steps included); None
        before any: a shard is read in order, never out of it."""
        return self._a_row

    def _keep_a_row(self, batch) -> None:
        if self._a_row is None and batch is not None and len(batch[1]):
            self._a_row = batch[0][:1], batch[1][:1]


def table_collate(table: CheckedTable, seq_len: int = 0):
    """iter_torch_batches' collate_fn: a pyarrow batch to (inputs, targets) tensors, by
    the same checked conversion as a parquet table's (data/tables.py). Made on the worker
    (Ray Data hands a collate of this base class its batches as pyarrow tables)."""
    from ray.data.collate_fn import ArrowBatchCollateFn

    # here, not at the top: data/tables.py imports torch, and Ray Train's controller imports this module
    # (to unpickle the plan's RayDataTables) without torch
    from ray_ddp.data.tables import table_tensors

    class TableCollate(ArrowBatchCollateFn):
        def __init__(self):
            self.empty_batch = None

        def __call__(self, batch):
            out = table_tensors(batch, table, seq_len, table.path)
            if self.empty_batch is None:
                self.empty_batch = (out[0][:0], out[1][:0])
            return out

        def empty(self):
            return self.empty_batch

    return TableCollate()


@dataclass
class RayValSet:
    """Validation from a Ray Dataset, with ValSet's ``batches`` (data/inputs.py)."""

    table: CheckedTable
    device: Any
    seq_len: int = 0

    def batches(self, rank: int, world: int, batch_size: int, equal_counts: bool = False):
        return ray_val_batches(self.table, rank, world, batch_size, self.device, equal_counts, self.seq_len)


def ray_val_batches(table: CheckedTable, rank: int, world: int, batch_size: int, device,
                    equal_counts: bool = False, seq_len: int = 0) -> Iterator[tuple]:
    """This rank's validation batches: every world-th batch of the whole set, read in a
    fixed order; ``equal_counts``: the ranks with fewer batches end with an empty one (a
    forward that is a collective, FSDP)."""
    import ray.train

    collate = table_collate(table, seq_len)
    count, last = 0, -1
    for b, batch in enumerate(ray.train.get_dataset_shard(VAL).iter_torch_batches(
            batch_size=batch_size, collate_fn=collate, prefetch_batches=2, device=device)):
        if b % world == rank:
            count += 1
            yield batch
        last = b
    if equal_counts and collate.empty() is not None:
        most = -(-(last + 1) // world)
        for _ in range(most - count):
            yield collate.empty()


# Ray Data (2.60) reads parquet footers on a pool of actors it starts for each read_parquet:
# 32 by default, each a Python process of its own, whatever the number of files: for a
# small set, most of a run's start-up on a few cores. It reads footers in batches of 10 files.
FOOTER_READERS_ENV, FILES_PER_FOOTER_READER, MOST_FOOTER_READERS = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", 10, 32


def read_parquet_dataset(path: str):
    """``--data PATH --ray-data``: the parquet set as a Ray Dataset (read lazily, in
    parallel, by Ray Data's tasks), with one footer reader per 10 files (at most Ray's 32),
    unless RAY_DATA_PARQUET_FOOTER_NUM_ACTORS says otherwise."""
    import ray.data

    store = resolve_storage(path)
    if FOOTER_READERS_ENV in os.environ:
        return ray.data.read_parquet(store.path, filesystem=store.fs)
    readers = footer_readers_for(count_files(store.fs, store.path))
    # Ray Data reads the setting when read_parquet() plans the read, in this process
    os.environ[FOOTER_READERS_ENV] = str(readers)
    try:
        return ray.data.read_parquet(store.path, filesystem=store.fs)
    finally:
        os.environ.pop(FOOTER_READERS_ENV, None)


def footer_readers_for(files: int) -> int:
    return max(1, min(MOST_FOOTER_READERS, -(-files // FILES_PER_FOOTER_READER)))


def count_files(fs, path: str) -> int:
    if fs.get_file_info(path).type == pafs.FileType.File:
        return 1
    return sum(1 for info in fs.get_file_info(pafs.FileSelector(path, recursive=True))
               if info.type == pafs.FileType.File)
