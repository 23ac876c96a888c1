"""Tasks: what one step means for a kind of problem. Runs on workers (and on the driver,
which picks the task from the data).

A task decides three things, and the loop only calls it:
- how a batch reaches the device (``to_device``: tensors, tuples/lists or dicts of them);
- how the model is called on an input (``forward``: a tuple/list is spread over the
  forward's arguments, anything else is passed as one);
- the loss and the metrics, as *sums* (``sums``): the loss summed over the micro-batch's
  units (rows; tokens for a language model), the units counted (a Python number: it is
  known on the host, and a tensor made from it would cost a copy to the GPU every
  micro-batch), the correct predictions.
Sums, not means, cross the wire: the loss for backward is the summed loss over the rank's
share of the step's units, so DDP's average over ranks is the exact mean over the global
batch however it is split across ranks and micro-batches, and an all-reduce of the sums
gives exact validation figures however many ranks there are.
"""

from __future__ import annotations

from ray_ddp.errors import TargetShapeError

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

TASKS = ("regression", "classification", "lm")


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a tensor, or every tensor of a tuple/list/dict, to ``device`` (non-blocking)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_rows(batch: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch
    for value in values:
        return batch_rows(value)
    return 0


def forward(model: Callable, inputs: Any) -> Any:
    """Call the model: a tuple/list of inputs is spread over its arguments (a forward of
    several tensors); a tensor or a dict is passed as one argument."""
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)




def _shapes(output: torch.Tensor, target: torch.Tensor) -> str:
    rows = "(rows" if output.dim() else "("
    return (f"the model's output has shape {rows}{_tail(output)}) per batch but the target "
            f"{rows}{_tail(target)})")


def _tail(t: torch.Tensor) -> str:
    return "".join(f", {d}" for d in t.shape[1:])


def match_regression_target(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The target in the output's shape. A lone trailing column is added or dropped (a
    scikit-learn ``(N,)`` target against a ``(N, 1)`` output, or a model that squeezes its
    output against a one-column table): anything else would broadcast ``(B, 1) - (B,)``
    to ``(B, B)`` and train the wrong objective without a word, so it is refused."""
    if output.shape == target.shape:
        return target
    if output.dim() == 2 and output.shape[1] == 1 and target.shape == output.shape[:1]:
        return target.unsqueeze(1)
    if output.dim() == 1 and target.dim() == 2 and target.shape == (len(output), 1):
        return target.squeeze(1)
    raise TargetShapeError(f"{_shapes(output, target)}; make them match (for example a target "
                           "of one value per row against an output of one column)")


def match_class_target(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Class labels of shape (rows,) for logits (rows, classes): a one-column label table
    ``(N, 1)`` is squeezed; float targets of the logits' shape are class probabilities."""
    if target.is_floating_point() and target.shape == output.shape:
        return target
    if not target.is_floating_point() and target.dim() == 2 and target.shape[1] == 1 \
            and output.dim() == 2 and len(target) == len(output):
        target = target.squeeze(1)
    if target.is_floating_point() or target.shape != output.shape[:-1]:
        kind = "float" if target.is_floating_point() else "integer"
        raise TargetShapeError(f"{_shapes(output, target)} ({kind}); classification needs integer "
                               "labels of one per row (or float probabilities of the output's shape)")
    return target


class Task:
    """Regression: mean squared error over each row's targets, summed over rows."""

    name = "regression"
    units_per_row = 1  # how many loss units one row holds (a language model: its tokens)
    metric: Optional[str] = None  # the metric beside the loss: accuracy, perplexity

    def match_target(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The target as the loss pairs it with ``output``; TargetShapeError if it cannot."""
        return match_regression_target(output, target)

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        out = output.float()
        squared = (out - self.match_target(out, target).float()).pow(2)
        per_row = squared.flatten(1).mean(dim=1) if squared.dim() > 1 else squared
        return {"loss": per_row.sum(), "units": float(len(out))}

    def metrics(self, totals: dict[str, float]) -> dict[str, Optional[float]]:
        """Means from the sums: loss per unit, and the task's metric."""
        return {"loss": totals["loss"] / totals["units"] if totals["units"] else float("nan")}


class ClassificationTask(Task):
    """Cross-entropy over integer class labels; also counts correct predictions."""

    name = "classification"
    metric = "accuracy"

    def match_target(self, output, target):
        return match_class_target(output, target)

    def sums(self, output, target):
        out = output.float()
        target = self.match_target(out, target)
        labels = target.argmax(dim=-1) if target.is_floating_point() else target
        return {"loss": F.cross_entropy(out, target, reduction="sum"), "units": float(len(out)),
                "correct": (out.argmax(dim=-1) == labels).sum().float()}

    def metrics(self, totals):
        out = super().metrics(totals)
        out["accuracy"] = totals["correct"] / totals["units"] if totals["units"] else float("nan")
        return out


class LanguageModelTask(Task):
    """Next-token cross-entropy: output (rows, T, vocab) against targets (rows, T), the
    inputs shifted by one token; the loss is per token."""

    name = "lm"
    metric = "perplexity"

    def __init__(self, seq_len: int):
        self.units_per_row = seq_len

    def match_target(self, output, target):
        if target.shape != output.shape[:-1] or target.is_floating_point():
            raise TargetShapeError(f"{_shapes(output, target)}; a language model needs integer "
                                   "token targets of the output's shape without its vocabulary")
        return target

    def sums(self, output, target):
        out = output.float()
        return {"loss": F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="sum"),
                "units": float(target.numel())}

    def metrics(self, totals):
        out = super().metrics(totals)
        out["perplexity"] = math.exp(min(out["loss"], 700.0)) if totals["units"] else float("nan")
        return out


class UserLossTask(Task):
    """A user's ``loss(output, target) -> scalar``, the mean over the batch's rows (as
    PyTorch's losses are by default): times the rows, it is the sum the loop needs. An
    empty micro-batch adds nothing (a mean over no rows would be NaN)."""

    def __init__(self, fn: Callable, base: Task):
        self.fn, self.base = fn, base
        self.name, self.units_per_row, self.metric = base.name, 1, base.metric

    def sums(self, output, target):
        rows = batch_rows(target)
        if rows == 0:
            return {"loss": _zero_like_graph(output), "units": 0.0}
        loss = self.fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"the loss function must return a scalar tensor, got "
                            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        sums = {"loss": loss.float() * rows, "units": float(rows)}
        if self.metric == "accuracy":  # the task's metric still counts
            sums["correct"] = (output.argmax(dim=-1) == target).sum().float()
        return sums

    def metrics(self, totals):
        return self.base.metrics(totals)


def _zero_like_graph(output: Any) -> torch.Tensor:
    """0, still connected to the model's outputs, so DDP's hooks fire on an empty batch."""
    if isinstance(output, torch.Tensor):
        return output.float().sum() * 0.0
    values = output.values() if isinstance(output, dict) else output
    return sum(_zero_like_graph(v) for v in values)


def build_task(name: str, seq_len: int = 0, loss: Optional[Callable] = None) -> Task:
    base = {"regression": Task, "classification": ClassificationTask}.get(name)
    task = base() if base is not None else LanguageModelTask(seq_len)
    return UserLossTask(loss, task) if loss is not None else task
