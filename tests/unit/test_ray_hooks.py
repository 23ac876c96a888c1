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
