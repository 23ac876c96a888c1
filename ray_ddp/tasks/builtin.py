"""The built-in tasks: regression (mean squared error), classification (cross-entropy,
accuracy) and lm (next-token cross-entropy, perplexity; label -100 ignored). Each takes
the predictions from the model's output (a tensor, ``.logits``, or a tuple's first
element). Runs on workers."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ray_ddp.errors import BatchError, TargetShapeError
from ray_ddp.tasks.batches import batch_rows, logits_of
from ray_ddp.tasks.targets import (IGNORE_INDEX, check_label_range, describe_shapes, match_class_target,
                                   match_regression_target)


class Task:
    """Regression: mean squared error over each row's targets, summed over rows."""

    name = "regression"
    units_per_row = 1  # how many loss units one row holds (a language model: its tokens)
    metric: Optional[str] = None  # the metric beside the loss: accuracy, perplexity
    # whether a step's units differ from batch to batch (masked labels): the loop then
    # counts them across the ranks before the backward
    variable_units = False

    def match_target(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The target as the loss pairs it with ``output``; TargetShapeError if it cannot."""
        return match_regression_target(output, target)

    def predictions(self, output: Any) -> torch.Tensor:
        logits = logits_of(output)
        if not isinstance(logits, torch.Tensor):
            raise BatchError(f"the model returned {type(output).__name__} with no logits (and no loss "
                             f"of its own) for the {self.name} task: return a tensor, .logits or a loss")
        return logits.float()

    def count_units(self, inputs: Any, target: Any) -> float:
        """The units a micro-batch holds, from the host copy of its batch."""
        return float(batch_rows(target))

    def check_batch(self, inputs: Any, target: Any) -> None:
        """A micro-batch the loss cannot take (a label outside the model's outputs), told
        from its host copy before it moves to the device (on a GPU the loss would stop at
        a device-side assert): BatchError. Nothing to check for regression."""

    def sums(self, output: Any, target: torch.Tensor, inputs: Any = None) -> dict[str, torch.Tensor]:
        out = self.predictions(output)
        squared = (out - self.match_target(out, target).float()).pow(2)
        per_row = squared.flatten(1).mean(dim=1) if squared.dim() > 1 else squared
        return {"loss": per_row.sum(), "units": float(len(out))}

    def metrics(self, totals: dict[str, float]) -> dict[str, Optional[float]]:
        """Means from the sums: loss per unit, and the task's metric."""
        return {"loss": totals["loss"] / totals["units"] if totals["units"] else float("nan")}


class ClassificationTask(Task):
    """Cross-entropy over integer class labels; also counts correct predictions.
    ``classes``: the model's outputs where they are known before its first forward, else
    learned from it (the logits' last dimension)."""

    name = "classification"
    metric = "accuracy"

    def __init__(self, classes: Optional[int] = None):
        self.classes = classes
        self.unchecked = 0  # host copies let through before the classes were known

    def match_target(self, output, target):
        return match_class_target(output, target)

    def check_batch(self, inputs, target):
        if self.classes is None:
            self.unchecked += 1
        elif isinstance(target, torch.Tensor):
            check_label_range(target, self.classes)

    def sums(self, output, target, inputs=None):
        out = self.predictions(output)
        target = self.match_target(out, target)
        # before the loss: on the CPU the check is free; on a GPU it waits for the device,
        # only for the batches that came before the first output told the classes
        if self.classes is None or self.unchecked or target.device.type == "cpu":
            self.classes, self.unchecked = out.shape[-1], max(0, self.unchecked - 1)
            check_label_range(target, self.classes)
        labels = target.argmax(dim=-1) if target.is_floating_point() else target
        return {"loss": F.cross_entropy(out, target, reduction="sum"), "units": float(len(out)),
                "correct": (out.argmax(dim=-1) == labels).sum().float()}

    def metrics(self, totals):
        out = super().metrics(totals)
        out["accuracy"] = totals["correct"] / totals["units"] if totals["units"] else float("nan")
        return out


class LanguageModelTask(Task):
    """Next-token cross-entropy: output (rows, T, vocab) against targets (rows, T), the
    inputs shifted by one token; the loss is per token, and a target of -100 (padding)
    counts for nothing, in the loss and in the units. Targets that are the inputs
    themselves (the Hugging Face convention, ``labels = input_ids``: the model shifts)
    are shifted here: position t predicts token t + 1, never token t."""

    name = "lm"
    metric = "perplexity"
    variable_units = True

    def __init__(self, seq_len: int):
        self.units_per_row = seq_len

    def match_target(self, output, target):
        if target.shape != output.shape[:-1] or target.is_floating_point():
            raise TargetShapeError(f"{describe_shapes(output, target)}; a language model needs integer "
                                   "token targets of the output's shape without its vocabulary")
        return target

    def count_units(self, inputs, target):
        if _targets_are_inputs(inputs, target):
            target = target[:, 1:]
        return float((target != IGNORE_INDEX).sum())

    def sums(self, output, target, inputs=None):
        out = self.predictions(output)
        target = self.match_target(out, target)
        if _targets_are_inputs(inputs, target):
            out, target = out[:, :-1], target[:, 1:]
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="sum",
                               ignore_index=IGNORE_INDEX)
        # a tensor, summed on the device: a Python number would wait for the GPU every step
        return {"loss": loss, "units": (target != IGNORE_INDEX).sum().float()}

    def metrics(self, totals):
        out = super().metrics(totals)
        out["perplexity"] = math.exp(min(out["loss"], 700.0)) if totals["units"] else float("nan")
        return out


def _targets_are_inputs(inputs, target) -> bool:
    """Whether the targets are the input tokens themselves (where not -100), not the
    inputs shifted by one as ray-ddp's own text windows are."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if not isinstance(ids, torch.Tensor) or ids.shape != target.shape or ids.dtype.is_floating_point:
        return False
    return bool(((target == ids) | (target == IGNORE_INDEX)).all())
