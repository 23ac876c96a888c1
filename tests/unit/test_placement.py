"""Placement arithmetic for 0, 1 and 2 GPUs per worker on 1-, 2- and 8-GPU nodes (no GPUs needed)."""

import pytest

from ray_ddp.config import ConfigError
from ray_ddp.devices import plan_placement


@pytest.mark.parametrize("node_gpus, gpw, stages, workers, want_gpw, backend", [
    ([0], None, 1, 2, 0, "gloo"),        # laptop CPU: 2 CPU workers
    ([0, 0], 0, 1, 2, 0, "gloo"),
    ([1], None, 1, 1, 1, "nccl"),        # one GPU
    ([2], None, 1, 2, 1, "nccl"),
    ([8], None, 1, 8, 1, "nccl"),        # one 8-GPU box: 8 workers
    ([8], 2, 1, 4, 2, "nccl"),           # pairs: half of them
    ([8], None, 2, 4, 2, "nccl"),        # toy-mp defaults to a pair
    ([1], None, 2, 1, 1, "nccl"),        # toy-mp on a 1-GPU node: both stages on it
    ([2], 2, 1, 1, 2, "nccl"),
    ([8, 8], 1, 1, 16, 1, "nccl"),
    ([3, 3], 2, 1, 2, 2, "nccl"),        # a pair never straddles nodes: 1 per node
    ([8], 0, 1, 2, 0, "gloo"),           # CPU asked for on a GPU box
])
def test_default_workers_and_backend(node_gpus, gpw, stages, workers, want_gpw, backend):
    p = plan_placement(None, gpw, None, node_gpus, stages=stages)
    assert (p.workers, p.gpus_per_worker, p.backend) == (workers, want_gpw, backend)
    want = {"CPU": 1.0, **({"GPU": float(want_gpw)} if want_gpw else {})}
    assert p.resources_per_worker() == want


def test_explicit_workers_and_backend_override():
    p = plan_placement(3, 1, "gloo", [8])
    assert (p.workers, p.backend, p.use_gpu) == (3, "gloo", True)


def test_pair_on_one_gpu_nodes_is_refused():
    with pytest.raises(ConfigError, match="needs a node with 2 GPUs"):
        plan_placement(None, 2, None, [1, 1])


def test_nccl_without_gpus_is_refused():
    with pytest.raises(ConfigError, match="--backend nccl needs GPUs"):
        plan_placement(2, 0, "nccl", [0])
