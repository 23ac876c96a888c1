"""The TorchTrainer ray-ddp fits: Ray Train's, less the Ray Data actor a run without Ray
Datasets never calls. Runs on the driver; importing it imports Ray Train.

Ray Train 2.60 starts a ``DatasetManager`` actor for every worker group, restarts
included, whether or not the trainer was given ``datasets``: a new process that imports
Ray Data and Ray Train (1 to 2.5 CPU seconds: benchmarks/startup.py's and suite_time.py's
``--by-process`` helper figures) and then waits for ``get_dataset_shard``
calls that a run without Ray Datasets never makes. Its callback also copies Ray Data's
``DataContext`` to the workers, which only Ray Data reads. So a run without Ray
Datasets leaves that callback out, and a run with them (``--ray-data``) keeps Ray's
callbacks as they are. Every other callback (the backend, the placement-group cleaner,
metrics, ours) is kept.
"""

from __future__ import annotations

from ray.train.torch import TorchTrainer

try:
    from ray.train.v2._internal.callbacks import DatasetsCallback
except ImportError:  # pragma: no cover - a Ray that moved it: keep Ray's callbacks as they are
    DatasetsCallback = None


class RayDdpTrainer(TorchTrainer):
    """TorchTrainer that starts no Ray Data actor for a run without Ray Datasets."""

    # a private hook of Ray Train 2.60 (pinned by tests/unit/test_ray_hooks.py); on a Ray
    # without it this is never called and the run is Ray's own
    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        if self.datasets or DatasetsCallback is None:
            return callbacks
        return [c for c in callbacks if not isinstance(c, DatasetsCallback)]
