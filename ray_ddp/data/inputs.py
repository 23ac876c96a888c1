"""What a worker trains and validates on, built from the config and the objects the
Python API passed (a Dataset, a validation Dataset). Runs on workers.

Training rows come from one of: synthetic data, a parquet table in memory, text cut into
windows (``--task lm``), a user's Dataset (``--dataset`` or ``train_data=``), or parquet
streamed row group by row group. Validation rows come from ``--val-data`` (read like
``--data``), ``val_data=``, or ``--val-fraction`` of the training rows: a split fixed by
the seed, taken out of training.

"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional
import torch
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.sources import IndexedSource, StreamSource, part_bounds, tensor_fetcher
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


def build_inputs(cfg: TrainConfig, rank: int, world: int, device: torch.device,
                 objects: dict[str, Any], ray_data=None) -> tuple[Any, Optional[ValSet]]:
    """This rank's training source, and the validation set (None without validation);
    ``ray_data``: a RayDataConfig, where a set comes through Ray Data."""
    if ray_data is not None:
        return _ray_data_inputs(cfg, rank, world, device, objects, ray_data)
    collate = objects.get("collate") or (_load(cfg.collate, "collate") if cfg.collate else None)
    make = _source_maker(cfg, rank, world)
    workers = loader_workers(cfg)
    dataset = None if cfg.stream else _user_dataset(cfg, objects)
    if workers and dataset is not None:
        return _loader_inputs(cfg, rank, world, device, objects, dataset, collate, workers)
    if cfg.stream:
        # the driver fitted the counts to the data: a worker reads footers, never a column
        # (the model's output size bounds the labels and token ids each row group is checked against)
        table = inspect_table(cfg.data, cfg.features, cfg.target, cfg.task, stream=True,
                              num_classes=cfg.num_classes,
                              vocab_size=cfg.vocab_size if cfg.model == "gpt" else cfg.output_dim)
        source = StreamSource(list_row_groups(table), row_group_reader(table, cfg.seq_len), cfg.seed,
                              rank, world, cfg.steps_per_epoch, cfg.grad_accum)
        return source, _given_val_set(cfg, objects, collate)
    rows_and_fetch = _training_rows(cfg, dataset, collate)
    if rows_and_fetch is None:
        teacher = teacher_weights(cfg.seed, cfg.input_dim, cfg.output_dim).to(device)
        source = SyntheticSource(teacher, cfg.seed, rank, world, cfg.global_batch, cfg.grad_accum)
        return source, _given_val_set(cfg, objects, collate)
    rows, fetch = rows_and_fetch
    if cfg.val_fraction:
        train_idx, val_idx = split_rows(rows, cfg.val_fraction, cfg.seed)
        return (make(len(train_idx), lambda idx: fetch(train_idx[idx])),
                ValSet(len(val_idx), lambda idx: fetch(val_idx[idx])))
    return make(rows, fetch), _given_val_set(cfg, objects, collate)


def _ray_data_inputs(cfg: TrainConfig, rank: int, world: int, device: torch.device, objects: dict[str, Any],
                     ray_data) -> tuple[Any, Any]:
    """Ray Data's shards for what comes through Ray Data, the usual inputs for the rest."""
    plain = dict(objects, **({"val_data": None} if ray_data.val_table is not None else {}))
    plain_cfg = dataclasses.replace(cfg, ray_data=False,
                                    val_data=None if ray_data.val_table is not None else cfg.val_data)
    if ray_data.table is not None:
        micro = -(-cfg.global_batch // (world * cfg.grad_accum))  # as IndexedSource cuts a step
        source = RayDataSource(ray_data.table, micro, cfg.grad_accum, device, cfg.seq_len)
        val_set = None if ray_data.val_table is not None else _given_val_set(plain_cfg, plain, None)
    else:
        source, val_set = build_inputs(plain_cfg, rank, world, device, plain)
    if ray_data.val_table is not None:
        val_set = RayValSet(ray_data.val_table, device, cfg.seq_len)
    return source, val_set


def loader_workers(cfg: TrainConfig) -> int:
    """--loader-workers, or its default from the CPUs Ray reserved for the worker."""
    return cfg.loader_workers if cfg.loader_workers is not None else \
        default_loader_workers(cfg.cpus_per_worker or 1)


def _loader_inputs(cfg: TrainConfig, rank: int, world: int, device: torch.device, objects: dict[str, Any],
                   dataset, collate, workers: int) -> tuple[Any, Optional[ValSet]]:
    """A user's Dataset read by DataLoader worker processes: the same rows, steps and
    validation as in the training thread (data/loader.py)."""
    pin = device.type == "cuda"
    source = functools.partial(LoaderSource, dataset, cfg.seed, rank, world, cfg.global_batch, cfg.grad_accum,
                               steps=cfg.steps_per_epoch, collate=collate, workers=workers, pin=pin)

    def val_set(ds, index_map=None) -> ValSet:
        fetch = rows_fetcher(ds, collate)
        return ValSet(len(ds) if index_map is None else len(index_map),
                      fetch if index_map is None else lambda idx: fetch(index_map[idx]),
                      load=lambda lists: loader_val_batches(ds, lists, collate, workers, pin, index_map))

    if cfg.val_fraction:
        train_idx, val_idx = split_rows(len(dataset), cfg.val_fraction, cfg.seed)
        return source(index_map=train_idx), val_set(dataset, val_idx)
    given = objects.get("val_data")
    return source(), val_set(given) if given is not None else _given_val_set(cfg, objects, collate)


def _user_dataset(cfg: TrainConfig, objects: dict[str, Any]):
    """The user's training Dataset (train_data= or --dataset), or None."""
    dataset = objects.get("train_data")
    if dataset is None and cfg.dataset is not None:
        dataset = load_user_dataset(cfg.dataset)
    return dataset


def _source_maker(cfg: TrainConfig, rank: int, world: int):
    return lambda rows, fetch: IndexedSource(rows, fetch, cfg.seed, rank, world, cfg.global_batch,
                                             cfg.grad_accum)


def _training_rows(cfg: TrainConfig, dataset, collate) -> Optional[tuple[int, Callable]]:
    """(rows, fetch) of the training data held in memory; None for synthetic data."""
    if dataset is not None:
        return len(dataset), rows_fetcher(dataset, collate)
    if cfg.data == "synthetic":
        return None
    x, y = load_rows(cfg, cfg.data)
    return len(x), tensor_fetcher(x, y)


def _given_val_set(cfg: TrainConfig, objects: dict[str, Any], collate) -> Optional[ValSet]:
    if objects.get("val_data") is not None:
        dataset = objects["val_data"]
        return ValSet(len(dataset), rows_fetcher(dataset, collate))
    if cfg.val_data is not None:
        x, y = load_rows(cfg, cfg.val_data)
        return ValSet(len(x), tensor_fetcher(x, y))
    return None


def load_rows(cfg: TrainConfig, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A parquet data set, or text for a language model, as (inputs, targets) in memory."""
    if cfg.task == "lm" and is_text(path):
        return text_windows(read_text_bytes(path), cfg.seq_len)
    return load_table(inspect_table(path, cfg.features, cfg.target, cfg.task), cfg.seq_len)


def _load(spec: str, what: str) -> Callable:

    return load_callable(spec, what=what)
