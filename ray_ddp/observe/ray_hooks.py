"""Ray Train's worker-group and controller callback types, imported in this one place.
Runs inside Ray Train's controller (observe/restarts.py subclasses them).

They are Ray Train's DeveloperAPI, under ``ray.train.v2._internal``: public enough to be
passed in ``RunConfig.callbacks`` (Ray Train adds every callback that is not a
``UserCallback`` to its own), private enough to move in a release. ray_ddp was checked
against the Ray below; on another, a moved name fails here with one line saying so, and
tests/unit/test_ray_hooks.py pins the names and signatures used.
"""

from __future__ import annotations

CHECKED_RAY = "2.60.0"

try:
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
except ImportError as err:  # pragma: no cover - only on a Ray that moved them
    import ray

    raise ImportError(f"ray_ddp records worker-group restarts through Ray Train's callbacks, checked "
                      f"against Ray {CHECKED_RAY}; Ray {ray.__version__} moved them ({err})") from None

__all__ = ["CHECKED_RAY", "ControllerCallback", "FailureDecision", "WorkerGroupCallback"]
