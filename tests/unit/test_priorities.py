"""CPU priorities (the training processes above Ray's daemons and helpers), how often Ray
Train's controller polls, and the cheap checks that run at every checkpoint and epoch
end. Real processes, no Ray."""

import os
import subprocess
import sys

import pytest
import torch

from ray_ddp.cluster import DAEMON_NICENESS, lower_daemons_priority
from ray_ddp.loop import weights_are_finite
from ray_ddp.worker_env import with_training_priority

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


def test_training_processes_run_at_nice_0_unless_the_user_set_rays_niceness(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    env = with_training_priority({"env_vars": {"PYTHONPATH": "/x"}})
    assert env == {"env_vars": {"PYTHONPATH": "/x", "RAY_worker_niceness": "0"}}
    monkeypatch.setenv("RAY_worker_niceness", "15")
    assert with_training_priority({"env_vars": {"PYTHONPATH": "/x"}}) == {"env_vars": {"PYTHONPATH": "/x"}}


def test_the_daemons_of_our_own_ray_yield_to_training_but_not_the_raylet(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    raylet = tmp_path / "raylet"  # a stand-in with the raylet's name: its forks inherit its priority
    raylet.symlink_to("/bin/sleep")
    if os.getpriority(os.PRIO_PROCESS, 0) >= DAEMON_NICENESS:
        pytest.skip("this test process already runs at a low priority")
    daemon = subprocess.Popen(["sleep", "30"])
    keeps = subprocess.Popen([str(raylet), "30"])
    try:
        lowered = lower_daemons_priority()
        assert daemon.pid in lowered and keeps.pid not in lowered
        assert os.getpriority(os.PRIO_PROCESS, daemon.pid) == DAEMON_NICENESS
        assert os.getpriority(os.PRIO_PROCESS, keeps.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        for p in (daemon, keeps):
            p.kill()
            p.wait()


def test_priorities_are_left_alone_when_the_user_set_them(monkeypatch):
    monkeypatch.setenv("RAY_worker_niceness", "5")
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert lower_daemons_priority() == []
        assert os.getpriority(os.PRIO_PROCESS, daemon.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        daemon.kill()
        daemon.wait()


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
    from ray_ddp.worker_env import train_controller_env

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    with train_controller_env():
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "1"
    assert "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" not in os.environ  # as it was
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "5")
    with train_controller_env():
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "5"
    assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "5"
