"""The trust fixes that need no Ray: how a target is paired with the output, numpy
items, rank means weighted by units, the elastic static-graph refusal, in-place zeroing
of bucket-view gradients, and which checkpoint writes the whole model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.plan import inspect_data
from ray_ddp.record.schema import rank_mean
from ray_ddp.observe.summarize import summarize_report
from ray_ddp.models.build import check_model
from ray_ddp.errors import TargetShapeError
from ray_ddp.tasks.build import build_task
from ray_ddp.driver.resolve import resolve


def test_a_target_of_shape_n_is_paired_with_an_output_of_one_column():
    task = build_task("regression")
    out, y = torch.zeros(4, 1), torch.arange(4.0)
    # the broadcast (4, 1) - (4,) would give a (4, 4) error matrix: 14.0 / 4 rows
    assert task.sums(out, y)["loss"].item() == pytest.approx(0 + 1 + 4 + 9)
    assert task.sums(torch.zeros(4), y[:, None])["loss"].item() == pytest.approx(14)  # the mirror


@pytest.mark.parametrize("out,y", [((4, 1), (4, 3)), ((4, 2), (4,)), ((4, 3), (4, 1, 3))])
def test_any_other_regression_mismatch_names_both_shapes(out, y):
    with pytest.raises(TargetShapeError, match=r"output has shape \(rows.*target \(rows"):
        build_task("regression").sums(torch.zeros(out), torch.zeros(y))


def test_one_column_class_labels_are_squeezed_and_floats_refused():
    task = build_task("classification")
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    assert task.sums(logits, torch.tensor([[0], [1]]))["correct"].item() == 2
    with pytest.raises(TargetShapeError, match="integer labels"):
        task.sums(logits, torch.tensor([0.0, 1.0]))


class _NumpyItems:
    def __init__(self, label):
        self.label = label

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.ones(3, dtype="float32"), self.label(i)


def test_numpy_items_are_read_like_tensors(tmp_path):
    cfg = TrainConfig(storage=str(tmp_path)).validate()
    classes = inspect_data(cfg, _NumpyItems(lambda i: np.int64(i % 4)))
    assert (classes.task, classes.num_classes, classes.input_dim, classes.output_dim) == \
        ("classification", 4, 3, 4)
    targets = inspect_data(cfg, _NumpyItems(lambda i: np.float64(i)))
    assert (targets.task, targets.input_dim, targets.output_dim) == ("regression", 3, 1)


def test_the_driver_refuses_an_output_the_target_cannot_pair_with(tmp_path):
    from torch.utils.data import TensorDataset

    ds = TensorDataset(torch.randn(8, 3), torch.randn(8, 2))

    def squeezing_model():  # a user's model of one output, against two target columns
        return nn.Sequential(nn.Linear(3, 1))

    cfg = TrainConfig(storage=str(tmp_path), model="python:squeezing_model").validate()
    shape = inspect_data(cfg, ds)
    with pytest.raises(ConfigError, match=r"output has shape \(rows, 1\).*target \(rows, 2\)"):
        check_model(resolve(cfg, None), squeezing_model, shape.example)


def test_rank_means_weight_each_rank_by_its_units():
    rows = [{"loss": 2.0, "units": 3.0, "samples": 3}, {"loss": float("nan"), "units": 0.0, "samples": 0},
            {"loss": 6.0, "units": 1.0, "samples": 1}]
    assert rank_mean(rows, "loss") == pytest.approx(3.0)
    old_table = [{"loss": 2.0, "samples": 3}, {"loss": 6.0, "samples": 1}]  # before the units column
    assert rank_mean(old_table, "loss") == pytest.approx(3.0)
    report = summarize_report([{**r, "epoch": 1, "step": 5, "samples_per_s": 1.0} for r in rows], 1, 5, None)
    assert math.isfinite(report["loss"])


def test_static_graph_is_refused_for_an_elastic_range():
    with pytest.raises(ConfigError, match="--static-graph cannot run elastic"):
        TrainConfig(static_graph=True, workers="1-2").validate()
    TrainConfig(static_graph=True, workers="2-2").validate()  # a fixed world: accepted


def test_keep_best_is_left_to_the_driver_that_knows_about_val_data():
    assert TrainConfig(keep_best=True).validate().keep_best  # run() checks val_data= too


def test_bucket_view_gradients_stay_in_their_buckets_when_set_to_none(one_rank_group):
    from ray_ddp.parallel.ddp import DDPStrategy

    model = nn.Linear(4, 2)
    strategy = DDPStrategy(TrainConfig())  # gradient_as_bucket_view, unless --plain-ddp
    ddp = strategy.setup_module(model, [torch.device("cpu")])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    addresses = []
    for _ in range(4):
        strategy.zero_grad(optimizer)
        assert model.weight.grad is None  # no write of every gradient to zero it
        ddp(torch.randn(3, 4)).sum().backward()
        addresses.append(model.weight.grad.data_ptr())
    # DDP rebuilds its buckets after the first backward; from then on the gradient is the
    # bucket's memory every step: set_to_none loses nothing of the bucket view
    assert len(set(addresses[1:])) == 1


def test_only_the_last_epochs_end_writes_the_whole_model():
    from ray_ddp.worker.loop import is_final_save

    cfg = TrainConfig(epochs=3)
    assert is_final_save(cfg, epoch=2, epoch_end=True)
    assert not is_final_save(cfg, epoch=2, epoch_end=False)  # a preemption checkpoint in epoch 3
    assert not is_final_save(cfg, epoch=1, epoch_end=True)
