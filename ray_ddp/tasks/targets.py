"""How a target is paired with the model's output: where the shapes differ, a lone
trailing column is added or dropped when that is unambiguous; anything else is one line
naming both shapes (a broadcast would train the wrong objective without a word). Runs on
workers and on the driver's meta-device check."""

from __future__ import annotations

import torch

from ray_ddp.errors import BatchError, TargetShapeError

IGNORE_INDEX = -100  # a label that counts for nothing (padding), as in PyTorch and Hugging Face


def describe_shapes(output: torch.Tensor, target: torch.Tensor) -> str:
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
    raise TargetShapeError(f"{describe_shapes(output, target)}; make them match (for example a target "
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
        raise TargetShapeError(f"{describe_shapes(output, target)} ({kind}); classification needs integer "
                               "labels of one per row (or float probabilities of the output's shape)")
    return target


def check_label_range(labels: torch.Tensor, classes: int) -> None:
    """Class labels against the model's ``classes`` outputs: one out of range (-100 aside)
    is one line naming it and the limit. The loss would stop at it anyway, on a GPU with a
    device-side assert that names neither and leaves the process unusable. Float labels
    (probabilities, multi-label) are not indices and are left alone. On a GPU tensor this
    waits for the device: give the host copy."""
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool or not labels.numel():
        return
    kept = labels[labels != IGNORE_INDEX]
    if not kept.numel():
        return
    low, high = int(kept.min()), int(kept.max())
    if low >= 0 and high < classes:
        return
    label = high if high >= classes else low
    fix = (f"give the model {label + 1} outputs or more (a Hugging Face classifier's num_labels, "
           "--num-classes, or --vocab-size for --model gpt), or correct the labels" if label >= classes else
           "correct the labels (-100 is the only negative label: it counts for nothing)")
    raise BatchError(f"label {label} is out of range for a model with {classes} outputs "
                     f"(labels must be in [0, {classes}) or -100): {fix}")
