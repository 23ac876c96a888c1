"""Ray Train's DeveloperAPI hooks that observe/restarts.py relies on, pinned: the Ray they
were checked against, and each hook's name and parameters in the Ray installed. On an
upgrade that moves them this fails here, by name, before any run records nothing."""

from __future__ import annotations

import inspect

import ray

from ray_ddp.observe.ray_hooks import CHECKED_RAY, ControllerCallback, FailureDecision, WorkerGroupCallback
from ray_ddp.observe.restarts import RestartRecorder

HOOKS = {
    WorkerGroupCallback: {"after_worker_group_start": ["self", "worker_group"],
                          "after_worker_group_poll_status": ["self", "worker_group_status"]},
    ControllerCallback: {"before_controller_execute_failure_decision": ["self", "failure_decision"]},
}


def test_the_ray_installed_is_the_one_the_hooks_were_checked_against():
    assert ray.__version__ == CHECKED_RAY, (
        f"observe/ray_hooks.py was checked against Ray {CHECKED_RAY}; this is Ray {ray.__version__}: check "
        "the hooks below still exist and are still called, then update CHECKED_RAY")


def test_each_hook_the_recorder_overrides_is_rays_with_the_same_parameters():
    for base, hooks in HOOKS.items():
        assert issubclass(RestartRecorder, base)
        for name, params in hooks.items():
            assert list(inspect.signature(getattr(base, name)).parameters) == params, name
            assert list(inspect.signature(getattr(RestartRecorder, name)).parameters) == params, name
    assert {d.name for d in FailureDecision} >= {"RETRY", "RAISE"}


def test_a_run_without_ray_datasets_starts_no_ray_data_actor_and_one_with_them_keeps_rays_callbacks():
    # here, not at the top: Ray Train's trainer, which only these tests need
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks import DatasetsCallback

    from ray_ddp.driver.trainer import RayDdpTrainer

    assert list(inspect.signature(TorchTrainer._create_default_callbacks).parameters) == ["self"]
    scaling = ScalingConfig(num_workers=1)

    def kinds(trainer):
        return [type(c) for c in trainer._create_default_callbacks()]

    rays = kinds(TorchTrainer(lambda: None, scaling_config=scaling))
    assert DatasetsCallback in rays, "Ray Train no longer adds its Ray Data callback: driver/trainer.py has nothing to drop"
    ours = kinds(RayDdpTrainer(lambda: None, scaling_config=scaling))
    assert ours == [k for k in rays if k is not DatasetsCallback]
    with_data = RayDdpTrainer(lambda: None, scaling_config=scaling, datasets={"train": lambda: None})
    assert kinds(with_data) == kinds(TorchTrainer(lambda: None, scaling_config=scaling, datasets={"train": lambda: None}))
    # and fit() still takes its callbacks from the hook (else the override is never called)
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    assert "callbacks=self._create_default_callbacks()" in inspect.getsource(DataParallelTrainer.fit)
