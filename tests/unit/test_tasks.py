"""Tasks turn a micro-batch into sums, so the loss is the exact mean over the global
batch however it is split, and validation figures add up exactly over ranks (no Ray)."""

import math

import pytest
import torch

from ray_ddp.tasks.batches import batch_rows, forward, to_device
from ray_ddp.tasks.build import build_task


def split_loss(task, out, y, parts):
    """What DDP's average of the ranks' losses comes to when the batch is cut in ``parts``."""
    share = len(out) / parts  # rows per rank
    losses = [task.sums(o, t)["loss"] / (share * task.units_per_row)
              for o, t in zip(out.tensor_split(parts), y.tensor_split(parts))]
    return sum(losses) / parts


@pytest.mark.parametrize("name", ["regression", "classification", "lm"])
def test_the_loss_is_the_global_mean_however_the_batch_is_split(name):
    g = torch.Generator().manual_seed(0)
    if name == "regression":
        out, y = torch.randn(12, 3, generator=g), torch.randn(12, 3, generator=g)
        want = torch.nn.functional.mse_loss(out, y)
    elif name == "classification":
        out, y = torch.randn(12, 5, generator=g), torch.randint(5, (12,), generator=g)
        want = torch.nn.functional.cross_entropy(out, y)
    else:
        out, y = torch.randn(12, 7, 11, generator=g), torch.randint(11, (12, 7), generator=g)
        want = torch.nn.functional.cross_entropy(out.reshape(-1, 11), y.reshape(-1))
    task = build_task(name, seq_len=7)
    for parts in (1, 2, 3, 4):
        assert split_loss(task, out, y, parts).item() == pytest.approx(want.item(), rel=1e-6)


def test_metrics_come_from_sums():
    task = build_task("classification")
    out = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    sums = task.sums(out, torch.tensor([0, 1, 1]))
    m = task.metrics({k: float(v) for k, v in sums.items()})
    assert m["accuracy"] == pytest.approx(2 / 3)
    lm = build_task("lm", seq_len=4).metrics({"loss": 8.0, "units": 4.0})
    assert lm["perplexity"] == pytest.approx(math.exp(2.0))


def test_a_users_loss_is_scaled_to_a_sum_and_an_empty_batch_adds_nothing():
    def mean_abs(output, target):
        return (output - target).abs().mean()

    task = build_task("regression", loss=mean_abs)
    out = torch.ones(4, 1, requires_grad=True)
    sums = task.sums(out, torch.zeros(4, 1))
    assert sums["loss"].item() == 4.0 and sums["units"] == 4.0
    empty = task.sums(out[:0], torch.zeros(0, 1))  # a mean over no rows would be NaN
    assert empty["loss"].item() == 0.0
    empty["loss"].backward()  # still connected to the graph: DDP's hooks fire
    assert torch.equal(out.grad, torch.zeros(4, 1))


def test_nested_batches_move_as_a_whole_and_forward_spreads_tuples():
    batch = {"x": torch.zeros(3, 2), "pair": (torch.ones(3), [torch.zeros(3)])}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["pair"][1][0].shape == (3,) and batch_rows(moved) == 3
    assert forward(lambda a, b: a + b, (torch.ones(2), torch.ones(2))).tolist() == [2.0, 2.0]
    assert forward(lambda d: d["x"].sum(), {"x": torch.ones(2)}).item() == 2.0


@pytest.mark.parametrize("name", ["regression", "classification"])
def test_an_empty_micro_batch_sums_to_zero(name):
    task = build_task(name)
    out = torch.zeros(0, 5, requires_grad=True)
    y = torch.zeros(0, 5) if name == "regression" else torch.zeros(0, dtype=torch.long)
    sums = task.sums(out, y)
    assert sums["loss"].item() == 0.0 and sums["units"] == 0.0


def test_lm_targets_that_are_the_inputs_are_shifted_to_the_next_token():
    import torch.nn.functional as F

    task = build_task("lm", seq_len=5)
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, -100, -100]])
    logits = torch.randn(2, 5, 10)
    # the Hugging Face convention: labels = input_ids (padding -100), the next token learned
    inputs = {"input_ids": ids.clamp(min=0)}
    sums = task.sums(logits, ids, inputs)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 10), ids[:, 1:].reshape(-1), reduction="sum")
    assert torch.allclose(sums["loss"], want) and sums["units"].item() == 4 + 2
    assert task.count_units(inputs, ids) == 6.0
    # ray-ddp's own windows: the targets are already the inputs shifted, nothing moves
    x, y = ids[:1, :-1], ids[:1, 1:]
    sums = task.sums(logits[:1, :4], y, x)
    assert torch.allclose(sums["loss"], F.cross_entropy(logits[0, :4], y[0], reduction="sum"))
