"""Losses that are not the task's own: a model's (a Hugging Face model given ``labels``
computes its loss and returns it in ``.loss``) and a user's (``--loss`` / ``loss=``).
Either is a mean over the micro-batch's units; times those units it is the sum the loop
needs, so the result over ranks and accumulation steps stays the exact global mean.
Metrics (accuracy, perplexity) still come from the logits and the task. Runs on
workers."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ray_ddp.errors import BatchError
from ray_ddp.tasks.batches import batch_rows, labels_of, logits_of, loss_of, zero_like_graph
from ray_ddp.tasks.builtin import IGNORE_INDEX, Task
from ray_ddp.tasks.targets import check_label_range

def unknowable_reduction(model_name: str) -> str:
    """The one line for a model whose own loss is a mean over sequence labels that nothing
    says how to count: next-token (shifted) or as they are."""
    return (f"{model_name} computes its own loss from a sequence of class labels per row, but neither "
            "its class name nor its loss_type names a Hugging Face head ray_ddp knows, so what that "
            "loss is a mean over (the tokens after each row's first, as a causal LM shifts them, or "
            "every token) cannot be known, and with it the "
            "weight of each micro-batch: set model.loss_type ('ForCausalLM' shifts, 'ForMaskedLM' or "
            "'ForTokenClassification' does not), or pass --loss (loss= in Python) to compute the loss "
            "from its output")


class ModelLossTask(Task):
    """The model's own loss, weighted by the units it is a mean over (``units``, from
    ``tasks.build.loss_units_of``: label tokens that are not -100, shifted by one for a
    causal LM; rows; or, for a model that does not say, rows when its labels are one per
    row, every element for float labels (multi-label, regression), and a refusal for
    sequences of class labels: shifted or not, nothing tells). ``classes``: the classes
    of a classifier's labels (tasks.build.class_count_of), checked before the forward,
    where the model computes its loss."""

    def __init__(self, base: Task, units: str | None, model_name: str = "the model",
                 classes: Optional[int] = None):
        self.base, self.units, self.model_name, self.classes = base, units, model_name, classes
        self.name, self.metric, self.units_per_row = base.name, base.metric, base.units_per_row
        self.variable_units = units != "rows"

    def check_batch(self, inputs: Any, target: Any) -> None:
        labels = labels_of(inputs)
        if self.classes is not None and labels is not None:
            check_label_range(labels, self.classes)

    def count_units(self, inputs: Any, target: Any) -> float:
        return float(self._units(inputs, target))

    def _units(self, inputs: Any, target: Any):
        labels = labels_of(inputs)
        if labels is None or self.units == "rows" or (self.units is None and labels.dim() <= 1):
            return float(batch_rows(target if labels is None else labels))
        if self.units is None and not labels.is_floating_point():
            raise BatchError(unknowable_reduction(self.model_name))
        if self.units == "shifted":
            labels = labels[..., 1:]
        return (labels != IGNORE_INDEX).sum().float()

    def sums(self, output: Any, target: Any, inputs: Any = None) -> dict[str, torch.Tensor]:
        loss = loss_of(output)
        if loss is None:
            raise BatchError("the batch hands the model labels, but its output has no loss: return "
                             "one in .loss (or drop 'labels' from the batch and let the task compute it)")
        units = self._units(inputs, target)
        # no rows, or no label to learn from (a prompt-only row, an answer cut off): the
        # model's mean over nothing is NaN, and it counts for nothing
        if batch_rows(target) == 0 or float(units) == 0:
            return {"loss": zero_like_graph(output, leave_out=loss), "units": 0.0}
        sums = {"loss": loss.float() * units, "units": units}
        logits = logits_of(output)
        if self.metric == "accuracy" and isinstance(logits, torch.Tensor):
            labels = labels_of(inputs) if labels_of(inputs) is not None else target
            sums["correct"] = (logits.argmax(dim=-1) == labels).sum().float()
        return sums

    def metrics(self, totals):
        return self.base.metrics(totals)


class UserLossTask(Task):
    """A user's ``loss(output, target) -> scalar``, the mean over the batch's rows (as
    PyTorch's losses are by default): times the rows, it is the sum the loop needs. An
    empty micro-batch adds nothing (a mean over no rows would be NaN)."""

    def __init__(self, fn: Callable, base: Task):
        self.fn, self.base = fn, base
        self.name, self.units_per_row, self.metric = base.name, 1, base.metric

    def sums(self, output, target, inputs=None):
        rows = batch_rows(target)
        if rows == 0:
            return {"loss": zero_like_graph(output), "units": 0.0}
        loss = self.fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"the loss function must return a scalar tensor, got "
                            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        sums = {"loss": loss.float() * rows, "units": float(rows)}
        logits = logits_of(output)
        if self.metric == "accuracy" and isinstance(logits, torch.Tensor):  # the task's metric still counts
            sums["correct"] = (logits.argmax(dim=-1) == target).sum().float()
        return sums

    def metrics(self, totals):
        return self.base.metrics(totals)
