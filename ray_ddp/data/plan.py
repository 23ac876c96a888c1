"""What the data decides for a run, checked on the driver before Ray starts (a mistake
costs seconds and gets one line): the task, the model's input and output sizes, the rows
of an epoch and of validation, the global batch, and so the steps per epoch. A user's
Dataset is built (or looked at) once here; driver/resolve.py makes the run's plan of it.

"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from ray_ddp.config.callables import load_callable
from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.ray_data import dataset_table, is_ray_dataset
from ray_ddp.data.sources import steps_for_rows
from ray_ddp.data.table_stats import inspect_table
from ray_ddp.data.text import is_text, text_size
from ray_ddp.data.user import as_row, check_dataset, collate_items, is_dict_rows, load_user_dataset


# Synthetic data's sizes and steps where the config names none (TrainConfig leaves them
# None: with data they are the data's).
SYNTHETIC = {"input_dim": 10, "output_dim": 5, "steps_per_epoch": 20}


@dataclass(frozen=True)
class DataShape:
    """What the data decides: training rows, the model's sizes, the task (and its classes
    or vocabulary), and the validation rows (0 without validation)."""

    rows: int
    input_dim: int
    output_dim: int
    task: str
    num_classes: Optional[int] = None
    val_rows: int = 0
    # the first rows as the workers batch them (inputs, targets), by the run's collate:
    # the driver's output and label checks, and whether batches hand the model labels
    example: Any = field(default=None, compare=False, repr=False)
    # the checked columns (a CheckedTable) of parquet or a Ray Dataset: what Ray Data's
    # batches are converted by on the workers; and the validation set's
    table: Any = field(default=None, compare=False, repr=False)
    val_table: Any = field(default=None, compare=False, repr=False)
    # a validation Ray Dataset, materialized once (data/ray_data.py: read every epoch)
    val_dataset: Any = field(default=None, compare=False, repr=False)
    # dict rows whose batch has no labels: its keys (the rows are then the loss's target)
    unlabeled_keys: Optional[tuple] = None

    @property
    def hands_labels(self) -> bool:
        """Whether batches hand the model ``labels`` (a dict with that key, from the rows
        or from the collate): the model then computes its own loss if its forward takes
        them (the Hugging Face convention; tasks.build.uses_model_loss)."""
        return self.example is not None and isinstance(self.example[0], Mapping) and "labels" in self.example[0]


def check_row_targets(shape: Optional[DataShape], has_loss: bool) -> None:
    """Dict rows are trained on their ``labels`` (the model's own loss) or by a given loss."""
    if shape is not None and shape.unlabeled_keys is not None and not has_loss:
        raise ConfigError(f"the training rows have no 'labels' (keys: {', '.join(shape.unlabeled_keys)}): "
                          "add a labels column for the model's own loss, or give loss= / --loss "
                          "(fn(output, rows) -> the batch's mean loss)")


def inspect_data(cfg: TrainConfig, train_data: Any = None, val_data: Any = None,
                 collate: Optional[Callable] = None) -> Optional[DataShape]:
    """Check the training and validation data; None for synthetic regression data.
    ``collate``: collate= (else --collate's function), which batches a Dataset's rows."""
    if collate is None and cfg.collate is not None:
        collate = load_callable(cfg.collate, what="collate")
    shape = _inspect_training(cfg, train_data, collate)
    if shape is None:
        if cfg.task not in (None, "regression"):
            raise ConfigError(f"--task {cfg.task} needs data: give --data, --dataset or train_data=")
        if cfg.val_fraction:
            raise ConfigError("--val-fraction splits --data or --dataset rows; synthetic data "
                              "has none to hold out (give --val-data)")
        shape = DataShape(0, cfg.input_dim or SYNTHETIC["input_dim"], cfg.output_dim or SYNTHETIC["output_dim"],
                                "regression")
        synthetic = True
    else:
        synthetic = False
    if is_ray_dataset(val_data):  # read every epoch by every rank: its pipeline runs once, here
        val_data = val_data.materialize()
    val_rows, val_table = _inspect_validation(cfg, shape, val_data)
    shape = dataclasses.replace(shape, val_rows=val_rows, val_table=val_table,
                                val_dataset=val_data if is_ray_dataset(val_data) else None)
    return None if synthetic and not val_rows else shape


def _inspect_training(cfg: TrainConfig, train_data: Any, collate: Optional[Callable]) -> Optional[DataShape]:
    if is_ray_dataset(train_data):
        return _shape_of_table(cfg, dataset_table(cfg, train_data, "train_data="))
    if train_data is not None or cfg.dataset is not None:
        ds = check_dataset(train_data, "train_data=") if train_data is not None else load_user_dataset(cfg.dataset)
        return _dataset_shape(cfg, ds, collate)
    if cfg.data == "synthetic":
        return None
    return _table_shape(cfg, cfg.data)


def _table_shape(cfg: TrainConfig, path: str, task: Optional[str] = None) -> DataShape:
    text = is_text(path)
    task = task or cfg.task or ("lm" if cfg.model == "gpt" or text else None)
    if task == "lm" and text:
        size = text_size(path)
        rows = (size - 1) // cfg.seq_len
        if rows < 1:
            raise ConfigError(f"--data {path} holds {size} bytes, not one window of --seq-len "
                              f"{cfg.seq_len} + 1; give more text or a shorter --seq-len")
        return DataShape(rows, cfg.seq_len, 256, "lm", num_classes=256)
    # the counts the run is given stand in for row groups whose statistics are missing, so
    # a large data set is never read whole here; the gpt's vocabulary is --vocab-size
    # whatever the data holds (another model's output size is the data's)
    table = inspect_table(path, cfg.features, cfg.target, task, stream=cfg.stream,
                          num_classes=cfg.num_classes,
                          vocab_size=cfg.vocab_size if cfg.model == "gpt" else None)
    return _shape_of_table(cfg, table)


def _shape_of_table(cfg: TrainConfig, table) -> DataShape:
    """What a checked table (parquet footers, or a Ray Dataset's schema) decides."""
    path = table.path
    if table.task == "lm":
        if table.input_dim < cfg.seq_len + 1:
            raise ConfigError(f"--data {path}: the shortest sequence has {table.input_dim} tokens; "
                              f"--seq-len {cfg.seq_len} needs {cfg.seq_len + 1}; lower --seq-len")
        return DataShape(table.rows, cfg.seq_len, table.num_classes, "lm", table.num_classes, table=table)
    classes = cfg.num_classes or table.num_classes
    if table.task == "classification" and cfg.num_classes and cfg.num_classes < table.num_classes:
        raise ConfigError(f"--data {path} has labels up to {table.num_classes - 1}, more than "
                          f"--num-classes {cfg.num_classes} allows; raise --num-classes")
    out = classes if table.task == "classification" else table.output_dim
    return DataShape(table.rows, table.input_dim, out, table.task, classes,
                           table=dataclasses.replace(table, num_classes=classes))


def _dataset_shape(cfg: TrainConfig, ds, collate: Optional[Callable] = None) -> DataShape:
    """A Dataset's first item says the sizes, and its first rows batched as the workers
    batch them (the run's collate) say the target: an integer scalar one a row (a Python
    int, a 0-d tensor or a numpy integer) makes it classification, a sequence of integers
    lm. The labels a collate adds (a causal LM's) count as the rows' own."""
    import torch

    dict_rows = is_dict_rows(ds)
    example = _example_batch(cfg, ds, collate)
    if dict_rows:  # the row is the input; its labels, if any, the target
        x = as_row(ds[0])
        y = x.get("labels")
    else:
        x, y = ds[0]
    if example is not None:  # the batch's first row: what the loss gets
        y = _first_row(example[1])
    y_t = _as_tensor(y)
    integer = y_t is not None and not torch.is_floating_point(y_t) and y_t.dtype != torch.bool
    # one integer a row is a class label; a sequence of them, tokens (a language model's)
    task = cfg.task or ("classification" if integer and y_t.dim() == 0 else
                        "lm" if integer else "regression")
    classes = cfg.num_classes
    builtin = ":" not in cfg.model and cfg.model != "gpt"
    if task == "classification" and classes is None and builtin and not dict_rows:
        # a built-in model needs the class count for its output layer: every label once
        classes = 1 + max(int(ds[i][1]) for i in range(len(ds)))
    x_t = _as_tensor(x)
    input_dim = int(x_t.numel()) if x_t is not None else cfg.input_dim
    output_dim = classes if task == "classification" and classes else (
        int(y_t.numel()) if y_t is not None else cfg.output_dim)
    batch = example[0] if example is not None and isinstance(example[0], Mapping) else x
    unlabeled = tuple(sorted(batch)) if dict_rows and "labels" not in batch else None
    return DataShape(len(ds), input_dim, output_dim, task, classes, example=example,
                           unlabeled_keys=unlabeled)


def _as_tensor(value: Any):
    """A tensor, numpy array, numpy scalar or Python number as a tensor; None otherwise."""
    import numpy as np
    import torch

    if isinstance(value, (bool, int, float, torch.Tensor, np.ndarray, np.generic)):
        return torch.as_tensor(value)
    return None


def _first_row(batch: Any) -> Any:
    """A batched tensor's first row; None for anything else (rows that are their own target)."""
    import torch

    return batch[0] if isinstance(batch, torch.Tensor) and batch.dim() else None


def _example_batch(cfg: TrainConfig, ds, collate: Optional[Callable]) -> Any:
    """The first rows batched as the workers batch them: what the driver runs through the
    model on the meta device and reads the labels from. The run's collate gets two rows
    (a padding collate pads them), and one that fails on them is one line now, not at
    every worker's first step; torch's default batches the first item twice (rows of
    different lengths may be trained one a micro-batch)."""
    import torch

    if collate is None:
        try:
            return collate_items([ds[0], ds[0]])
        except (TypeError, RuntimeError, ValueError):  # a custom item: its --collate checks it
            return None
    what = f"--collate {cfg.collate}" if cfg.collate else "collate="
    try:
        with torch.random.fork_rng(devices=[]):  # a masking collate draws: the caller's draws stay theirs
            return collate_items([ds[0], ds[min(1, len(ds) - 1)]], collate)
    except Exception as err:  # noqa: BLE001 - the user's code: any failure is theirs to fix
        message = " ".join(str(err).split()).rstrip(".")
        raise ConfigError(f"{what} raised {type(err).__name__} on the first two training rows: {message}; "
                          "make it batch the Dataset's items (a column it cannot batch, such as raw text, "
                          "can be dropped with dataset.remove_columns)") from None


def _inspect_validation(cfg: TrainConfig, shape: DataShape, val_data: Any) -> tuple[int, Any]:
    """The validation rows, and their checked columns where a table holds them."""
    if is_ray_dataset(val_data):
        val = _shape_of_table(cfg, dataset_table(cfg, val_data, "val_data=", task=shape.task))
        _check_val_matches(val, shape, "val_data=")
        return val.rows, val.table
    if val_data is not None:
        return len(check_dataset(val_data, "val_data=")), None
    if cfg.val_data is not None:
        val = _table_shape(cfg, cfg.val_data, task=shape.task)  # read as the training data is
        _check_val_matches(val, shape, f"--val-data {cfg.val_data}")
        return val.rows, val.table
    if cfg.val_fraction:
        held = max(1, round(cfg.val_fraction * shape.rows))
        if held >= shape.rows:
            raise ConfigError(f"--val-fraction {cfg.val_fraction} of {shape.rows} rows leaves none to train on")
        return held, None
    return 0, None


def _check_val_matches(val: DataShape, shape: DataShape, where: str) -> None:
    if (val.input_dim, val.task) != (shape.input_dim, shape.task):
        raise ConfigError(f"{where} does not match the training data "
                          f"({val.task} with {val.input_dim} inputs, the training data is "
                          f"{shape.task} with {shape.input_dim}); give validation rows of the same columns")


def global_batch_for(cfg: TrainConfig, max_workers: int) -> int:
    """The global batch of the run: ``--global-batch`` if given, else the largest world
    size x batch-size x grad-accum (what a fixed-size run has always had)."""
    if cfg.global_batch is not None and cfg.global_batch < max_workers:
        raise ConfigError(f"--global-batch {cfg.global_batch} gives some of the {max_workers} "
                          "workers no rows at all; give at least one row per worker")
    return cfg.global_batch or max_workers * cfg.batch_size * cfg.grad_accum


def data_decides(cfg: TrainConfig, shape: Optional[DataShape], global_batch: int) -> dict[str, Any]:
    """What the data decides: the task, the model's sizes (and classes), and the steps
    per epoch (one pass over the training rows in global batches, whatever the world
    size); the config's own values (or SYNTHETIC's) where the data is synthetic."""
    out: dict[str, Any] = dict(task=cfg.task or "regression", num_classes=cfg.num_classes,
                               **{k: getattr(cfg, k) or v for k, v in SYNTHETIC.items()})
    if shape is None:
        return out
    rows = shape.rows - (shape.val_rows if cfg.val_fraction else 0)
    out["task"] = shape.task
    if rows:  # training rows from data (not synthetic); dict rows name no sizes
        out.update(input_dim=shape.input_dim or out["input_dim"], output_dim=shape.output_dim or out["output_dim"],
                   steps_per_epoch=steps_for_rows(rows, global_batch))
    if shape.task == "classification" and shape.num_classes:
        out["num_classes"] = shape.num_classes
    if shape.task == "lm" and shape.num_classes and cfg.model == "gpt" and shape.num_classes > cfg.vocab_size:
        raise ConfigError(f"the data's token ids go up to {shape.num_classes - 1}; --vocab-size "
                          f"{cfg.vocab_size} is too small; pass --vocab-size {shape.num_classes}")
    return out
