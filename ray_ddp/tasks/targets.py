"""How a target is paired with the model's output: where the shapes differ, a lone
trailing column is added or dropped when that is unambiguous; anything else is one line
naming both shapes (a broadcast would train the wrong objective without a word). Runs on
workers and on the driver's meta-device check."""

from __future__ import annotations

import torch

from ray_ddp.errors import TargetShapeError


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
