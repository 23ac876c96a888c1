"""How often Ray Train's controller polls, and the cheap checks that run at every
checkpoint and epoch end. No Ray."""

import os

import pytest
import torch

from ray_ddp.worker.checks import weights_are_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_non_finite_weights_are_found_in_any_float_type(dtype):
    model = torch.nn.Linear(64, 64).to(dtype)
    assert weights_are_finite(model)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with torch.no_grad():
            model.weight[3, 5] = bad
        assert not weights_are_finite(model), (dtype, bad)
        with torch.no_grad():
            model.weight[3, 5] = 0.0
    assert weights_are_finite(model)


def test_finite_weights_whose_sum_overflows_are_finite():
    model = torch.nn.Linear(4, 4).to(torch.float64)
    with torch.no_grad():
        model.weight.fill_(1e308)  # the sum is inf; every weight is finite
    assert weights_are_finite(model)
    model = torch.nn.Linear(4, 4).to(torch.float16)
    with torch.no_grad():
        model.weight.fill_(60000.0)  # fp16's largest is 65504: summed in float32, no overflow
    assert weights_are_finite(model)


def test_the_controller_polls_every_second_during_a_run_unless_the_user_chose(monkeypatch):
    from ray_ddp.cluster.runtime_env import train_controller_env

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    with train_controller_env():
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1"
    assert "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in os.environ  # as it was
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "5")
    with train_controller_env():
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "5"
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "5"
