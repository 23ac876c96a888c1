"""What a worker trains and validates on, built from the config and the objects the
Python API passed (a Dataset, a validation Dataset). Runs on workers.

Training rows come from one of: synthetic data, a parquet table in memory, text cut into
windows (``--task lm``), a user's Dataset (``--dataset`` or ``train_data=``), or parquet
streamed row group by row group. Validation rows come from ``--val-data`` (read like
``--data``), ``val_data=``, or ``--val-fraction`` of the training rows: a split fixed by
the seed, taken out of training.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional
import torch
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.sources import IndexedSource, StreamSource, part_bounds, tensor_fetcher
from ray_ddp.data.synth import SyntheticSource, teacher_weights
from ray_ddp.data.user import rows_fetcher


@dataclass
class ValSet:
    """Validation rows and how to fetch them. Rank r evaluates the contiguous part
    ``part_bounds(rows, world)[r:r+2]``: every row is counted exactly once across the
    ranks, with no padding (DistributedSampler would repeat rows to even the parts)."""

    rows: int
    fetch: Callable[[torch.Tensor], tuple]

    def batches(self, rank: int, world: int, batch_size: int, equal_counts: bool = False) -> Iterator[tuple]:
        """This rank's batches; ``equal_counts``: as many on every rank (the shorter parts
        end with an empty batch), for a forward that is a collective (FSDP)."""
        bounds = part_bounds(self.rows, world)
        count = -(-(bounds[rank + 1] - bounds[rank]) // batch_size)
        if equal_counts:
            count = max(-(-(bounds[r + 1] - bounds[r]) // batch_size) for r in range(world))
        for b in range(count):
            start = min(bounds[rank] + b * batch_size, bounds[rank + 1])
            yield self.fetch(torch.arange(start, min(start + batch_size, bounds[rank + 1])))


def split_rows(rows: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows) for ``--val-fraction``: a permutation fixed by the
    seed (apart from the epochs' orders), its first ``round(fraction x rows)`` held out."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 104_729)
    order = torch.randperm(rows, generator=g)
    held = max(1, round(fraction * rows))
    return order[held:].sort().values, order[:held].sort().values


def build_inputs(cfg: TrainConfig, rank: int, world: int, device: torch.device,
                 objects: dict[str, Any]) -> tuple[Any, Optional[ValSet]]:
    """This rank's training source, and the validation set (None without validation)."""
    collate = _load(cfg.collate, "collate") if cfg.collate else None
    make = _source_maker(cfg, rank, world)
    if cfg.stream:
        from ray_ddp.data.table_stats import inspect_table
        from ray_ddp.data.tables import list_row_groups, row_group_reader

        # the driver fitted the counts to the data: a worker reads footers, never a column
        # (the model's output size bounds the labels and token ids each row group is checked against)
        table = inspect_table(cfg.data, cfg.features, cfg.target, cfg.task, stream=True,
                              num_classes=cfg.num_classes,
                              vocab_size=cfg.vocab_size if cfg.model == "gpt" else cfg.output_dim)
        source = StreamSource(list_row_groups(table), row_group_reader(table, cfg.seq_len), cfg.seed,
                              rank, world, cfg.steps_per_epoch, cfg.grad_accum)
        return source, _given_val_set(cfg, objects, collate)
    rows_and_fetch = _training_rows(cfg, objects, collate)
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


def _source_maker(cfg: TrainConfig, rank: int, world: int):
    return lambda rows, fetch: IndexedSource(rows, fetch, cfg.seed, rank, world, cfg.global_batch,
                                             cfg.grad_accum)


def _training_rows(cfg: TrainConfig, objects: dict[str, Any], collate) -> Optional[tuple[int, Callable]]:
    """(rows, fetch) of the training data held in memory; None for synthetic data."""
    dataset = objects.get("train_data")
    if dataset is None and cfg.dataset is not None:
        from ray_ddp.data.user import load_user_dataset

        dataset = load_user_dataset(cfg.dataset)
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
    from ray_ddp.data.table_stats import inspect_table
    from ray_ddp.data.text import is_text, read_text_bytes, text_windows
    from ray_ddp.data.tables import load_table

    if cfg.task == "lm" and is_text(path):
        return text_windows(read_text_bytes(path), cfg.seq_len)
    return load_table(inspect_table(path, cfg.features, cfg.target, cfg.task), cfg.seq_len)


def _load(spec: str, what: str) -> Callable:
    from ray_ddp.models.build import load_callable

    return load_callable(spec, what=what)
