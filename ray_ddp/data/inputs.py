"""What a worker trains and validates on, built from the config and the objects the
Python API passed (a Dataset, a validation Dataset). Runs on workers.

Training rows come from one Source (data/sources.py), chosen in one place
(``source_kind``): a Ray Dataset's shard, parquet streamed row group by row group, a
user's Dataset (``--dataset`` or ``train_data=``) read by loader processes or in this
thread, a parquet table or text windows (``--task lm``) in memory, or synthetic rows.
Validation rows come from a Ray Dataset, ``val_data=``, ``--val-data`` (read like
``--data``), or ``--val-fraction`` of the training rows: a split fixed by the seed,
taken out of training.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional
import torch
from ray_ddp.config.train import TrainConfig
from ray_ddp.plan import BatchCut, RunPlan
from ray_ddp.data.sources import IndexedSource, Source, StreamSource, ValBatches, part_bounds, tensor_fetcher
from ray_ddp.data.synth import SyntheticSource, teacher_weights
from ray_ddp.data.user import load_user_dataset, rows_fetcher
from ray_ddp.config.callables import load_callable
from ray_ddp.data.loader import LoaderSource, default_loader_workers, loader_val_batches
from ray_ddp.data.ray_data import RayDataSource, RayValSet
from ray_ddp.data.table_stats import inspect_table
from ray_ddp.data.tables import list_row_groups, load_table, row_group_reader
from ray_ddp.data.text import is_text, read_text_bytes, text_windows


@dataclass
class ValSet:
    """Validation rows and how to fetch them. Rank r evaluates the contiguous part
    ``part_bounds(rows, world)[r:r+2]``: every row is counted exactly once across the
    ranks, with no padding (DistributedSampler would repeat rows to even the parts)."""

    rows: int
    fetch: Callable[[torch.Tensor], tuple]
    # --loader-workers: the batches of these index lists, read by DataLoader workers
    load: Optional[Callable[[list[torch.Tensor]], Iterator[tuple]]] = None

    def batches(self, rank: int, world: int, batch_size: int, equal_counts: bool = False) -> Iterator[tuple]:
        """This rank's batches; ``equal_counts``: as many on every rank (the shorter parts
        end with an empty batch), for a forward that is a collective (FSDP)."""
        bounds = part_bounds(self.rows, world)
        count = -(-(bounds[rank + 1] - bounds[rank]) // batch_size)
        if equal_counts:
            count = max(-(-(bounds[r + 1] - bounds[r]) // batch_size) for r in range(world))
        lists = []
        for b in range(count):
            start = min(bounds[rank] + b * batch_size, bounds[rank + 1])
            lists.append(torch.arange(start, min(start + batch_size, bounds[rank + 1])))
        return self.load(lists) if self.load is not None else (self.fetch(idx) for idx in lists)


def split_rows(rows: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows) for ``--val-fraction``: a permutation fixed by the
    seed (apart from the epochs' orders), its first ``round(fraction x rows)`` held out."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 104_729)
    order = torch.randperm(rows, generator=g)
    held = max(1, round(fraction * rows))
    return order[held:].sort().values, order[:held].sort().values


# What trains a rank, in the order they are chosen (``source_kind``); each is a Source.
SOURCE_KINDS = {
    "ray-data": "a Ray Dataset's shard (train_data= a Ray Dataset, or --data with --ray-data)",
    "stream": "parquet read row group by row group (--stream)",
    "loader": "a user's Dataset read by DataLoader processes (--loader-workers)",
    "rows": "rows in memory: a parquet table, text windows, or a user's Dataset read in this thread",
    "synthetic": "synthetic regression rows made at each step",
}


def source_kind(run: RunPlan, objects: dict[str, Any], ray_data=None) -> str:
    """Which Source trains this run: the one place that decides (a key of SOURCE_KINDS)."""
    cfg = run.config
    if ray_data is not None and ray_data.table is not None:
        return "ray-data"
    if cfg.stream:
        return "stream"
    if objects.get("train_data") is not None or cfg.dataset is not None:
        return "loader" if loader_workers(run) else "rows"
    return "synthetic" if cfg.data == "synthetic" else "rows"


def build_inputs(run: RunPlan, cut: BatchCut, rank: int, device: torch.device,
                 objects: dict[str, Any], ray_data=None) -> tuple[Source, Optional[ValBatches]]:
    """This rank's training source for the batch plan's ``cut`` at this world size, and
    the validation set (None without validation); ``ray_data``: a RayDataTables, where a
    set comes through Ray Data. The sizes the data decided are the plan's (``run``)."""
    cfg = run.config
    kind = source_kind(run, objects, ray_data)
    world = cut.world
    collate = objects.get("collate") or (load_callable(cfg.collate, what="collate") if cfg.collate else None)
    given_val = functools.partial(_given_val_set, run, objects, collate, device, ray_data)
    if kind == "ray-data":
        return RayDataSource(ray_data.table, cut.micro_rows, cut.grad_accum, device, cfg.seq_len), given_val()
    if kind == "stream":
        # the driver fitted the counts to the data: a worker reads footers, never a column
        # (the model's output size bounds the labels and token ids each row group is checked against)
        table = inspect_table(cfg.data, cfg.features, cfg.target, run.task, stream=True,
                              num_classes=run.num_classes,
                              vocab_size=cfg.vocab_size if cfg.model == "gpt" else run.output_dim)
        return (StreamSource(list_row_groups(table), row_group_reader(table, cfg.seq_len), cfg.seed,
                             rank, world, run.steps_per_epoch, cut.grad_accum), given_val())
    if kind == "synthetic":
        teacher = teacher_weights(cfg.seed, run.input_dim, run.output_dim).to(device)
        return SyntheticSource(teacher, cfg.seed, rank, world, cut.global_batch, cut.grad_accum), given_val()
    if kind == "loader":
        return _loader_inputs(run, cut, rank, device, _user_dataset(cfg, objects), collate, given_val)
    rows, fetch = _training_rows(run, _user_dataset(cfg, objects), collate)
    make = functools.partial(IndexedSource, seed=cfg.seed, rank=rank, world=world,
                             global_batch=cut.global_batch, grad_accum=cut.grad_accum)
    if cfg.val_fraction:
        train_idx, val_idx = split_rows(rows, cfg.val_fraction, cfg.seed)
        return (make(len(train_idx), lambda idx: fetch(train_idx[idx])),
                ValSet(len(val_idx), lambda idx: fetch(val_idx[idx])))
    return make(rows, fetch), given_val()


def loader_workers(run: RunPlan) -> int:
    """--loader-workers, or its default from the CPUs the plan reserved for the worker."""
    given = run.config.loader_workers
    return given if given is not None else default_loader_workers(run.cpus_per_worker or 1)


def _loader_inputs(run: RunPlan, cut: BatchCut, rank: int, device: torch.device, dataset, collate,
                   given_val: Callable[..., Optional[ValBatches]]) -> tuple[Source, Optional[ValBatches]]:
    """A user's Dataset read by DataLoader worker processes: the same rows, steps and
    validation as in the training thread (data/loader.py)."""
    cfg, workers, pin = run.config, loader_workers(run), device.type == "cuda"
    source = functools.partial(LoaderSource, dataset, cfg.seed, rank, cut.world, cut.global_batch, cut.grad_accum,
                               steps=run.steps_per_epoch, collate=collate, workers=workers, pin=pin)
    if cfg.val_fraction:
        train_idx, val_idx = split_rows(len(dataset), cfg.val_fraction, cfg.seed)
        return source(index_map=train_idx), _dataset_val_set(dataset, collate, workers, pin, val_idx)
    return source(), given_val(workers=workers, pin=pin)


def _dataset_val_set(dataset, collate, workers: int = 0, pin: bool = False, index_map=None) -> ValSet:
    """Validation rows of a Dataset (``index_map``: those rows of it), read by ``workers``
    loader processes (in this thread without)."""
    fetch = rows_fetcher(dataset, collate)
    rows = len(dataset) if index_map is None else len(index_map)
    if index_map is not None:
        fetch = (lambda direct: lambda idx: direct(index_map[idx]))(fetch)
    load = (lambda lists: loader_val_batches(dataset, lists, collate, workers, pin, index_map)) if workers else None
    return ValSet(rows, fetch, load=load)


def _user_dataset(cfg: TrainConfig, objects: dict[str, Any]):
    """The user's training Dataset (train_data= or --dataset), or None."""
    dataset = objects.get("train_data")
    if dataset is None and cfg.dataset is not None:
        dataset = load_user_dataset(cfg.dataset)
    return dataset


def _training_rows(run: RunPlan, dataset, collate) -> tuple[int, Callable]:
    """(rows, fetch) of the training data held in memory: a user's Dataset, or --data's."""
    if dataset is not None:
        return len(dataset), rows_fetcher(dataset, collate)
    x, y = load_rows(run, run.config.data)
    return len(x), tensor_fetcher(x, y)


def _given_val_set(run: RunPlan, objects: dict[str, Any], collate, device: torch.device, ray_data=None,
                   workers: int = 0, pin: bool = False) -> Optional[ValBatches]:
    """The validation set given apart from the training rows: a Ray Dataset's, val_data=
    (read by ``workers`` loader processes where the training rows are), or --val-data's."""
    cfg = run.config
    if ray_data is not None and ray_data.val_table is not None:
        return RayValSet(ray_data.val_table, device, cfg.seq_len)
    if objects.get("val_data") is not None:
        return _dataset_val_set(objects["val_data"], collate, workers, pin)
    if cfg.val_data is not None:
        x, y = load_rows(run, cfg.val_data)
        return ValSet(len(x), tensor_fetcher(x, y))
    return None


def load_rows(run: RunPlan, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A parquet data set, or text for a language model, as (inputs, targets) in memory."""
    cfg = run.config
    if run.task == "lm" and is_text(path):
        return text_windows(read_text_bytes(path), cfg.seq_len)
    return load_table(inspect_table(path, cfg.features, cfg.target, run.task), cfg.seq_len)
