"""Placement arithmetic for 0, 1 and 2 GPUs per worker on 1-, 2- and 8-GPU nodes (no GPUs needed)."""

import pytest

from ray_ddp.errors import ConfigError
from ray_ddp.cluster.placement import plan_placement


@pytest.mark.parametrize("node_gpus, gpw, stages, workers, want_gpw, backend", [
    ([0], None, 1, 2, 0, "gloo"),        # laptop CPU: 2 CPU workers
    ([0, 0], 0, 1, 2, 0, "gloo"),
    ([1], None, 1, 1, 1, "nccl"),        # one GPU
    ([2], None, 1, 2, 1, "nccl"),
    ([8], None, 1, 8, 1, "nccl"),        # one 8-GPU box: 8 workers
    ([8], 2, 2, 4, 2, "nccl"),           # pairs for a two-stage model: half of them
    ([8], None, 2, 4, 2, "nccl"),        # toy-mp defaults to a pair
    ([1], None, 2, 1, 1, "nccl"),        # toy-mp on a 1-GPU node: both stages on it
    ([2], 2, 2, 1, 2, "nccl"),
    ([8, 8], 1, 1, 16, 1, "nccl"),
    ([3, 3], 2, 2, 2, 2, "nccl"),        # a pair never straddles nodes: 1 per node
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
        plan_placement(None, 2, None, [1, 1], stages=2)


def test_pair_for_a_one_stage_model_is_refused():
    # its targets would go to the pair's second GPU while the outputs stay on the first
    with pytest.raises(ConfigError, match=r"--gpus-per-worker 2 gives each worker a GPU per model "
                                          r"stage, and this model has 1 stage; use --gpus-per-worker 1"):
        plan_placement(None, 2, None, [8], stages=1)


def test_nccl_without_gpus_is_refused():
    with pytest.raises(ConfigError, match="--backend nccl needs GPUs"):
        plan_placement(2, 0, "nccl", [0])


# --- preflight slot arithmetic (what the cluster holds now, what its autoscaler can add) ---
from ray_ddp.cluster.preflight import UNLIMITED, autoscaler_slots, count_slots, describe_have, describe_need


def test_slots_need_every_gpu_of_a_worker_on_one_node():
    pair = plan_placement(None, 2, None, [8], stages=2)
    assert count_slots([{"CPU": 16, "GPU": 8}], pair) == 4
    assert count_slots([{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}], pair) == 0
    assert count_slots([{"CPU": 2, "GPU": 8}], pair) == 2  # CPUs bound it too
    cpu = plan_placement(2, 0, None, [0])
    assert count_slots([{"CPU": 1}, {"CPU": 1}], cpu) == 2


def test_autoscaler_reach_counts_head_and_node_types_at_max():
    one_gpu = plan_placement(8, 1, None, [0])
    head = {"CPU": 0}  # a head that schedules no training
    assert autoscaler_slots(head, [({"CPU": 64, "GPU": 8}, 2)], one_gpu) == 16
    assert autoscaler_slots(head, [({"CPU": 8}, 10)], one_gpu) == 0  # CPU-only node type
    assert autoscaler_slots(head, [({"CPU": 64, "GPU": 8}, -1)], one_gpu) == UNLIMITED


def test_shortfall_lines_name_the_numbers():
    p = plan_placement(8, 1, None, [0])
    assert describe_need(p) == "needs 8 workers x 1 GPU = 8 GPU"
    assert describe_have([{"CPU": 4}], p) == "the cluster has 0 GPU"
    pair = plan_placement(2, 2, None, [2], stages=2)
    one_each = [{"CPU": 4, "GPU": 1}] * 4
    assert describe_have(one_each, pair) == "the cluster has 4 GPU but not 2 on one node for each worker"


@pytest.mark.parametrize("workers,gpus,local,given,want", [
    (1, [0], 8, None, 8),     # one CPU worker on a Ray of our own gets every core
    (2, [0], 8, None, 4),
    (3, [0], 2, None, 1),     # never below one
    (2, [0], None, None, 1),  # someone else's cluster: 1, unless asked
    (2, [0], None, 6, 6),
    (2, [2], 8, None, 1),     # GPU workers: the GPU does the work
])
def test_cpus_per_worker_defaults(workers, gpus, local, given, want):
    p = plan_placement(workers, None, None, gpus, cpus_per_worker=given, local_cpus=local)
    assert p.cpus_per_worker == want
    assert p.resources_per_worker()["CPU"] == want


def test_an_elastic_range_plans_for_max_and_needs_min():
    # on a 16-core machine ray-ddp's own Ray is shared by MAX workers
    p = plan_placement(4, None, None, [0], local_cpus=16, min_workers=2)
    assert (p.workers, p.cpus_per_worker, p.needed, p.num_workers()) == (4, 4, 2, (2, 4))
    assert p.elastic and p.describe() == "2-4 workers x 4 CPU, backend gloo"
    fixed = plan_placement(4, None, None, [0], local_cpus=16, min_workers=4)
    assert not fixed.elastic and (fixed.needed, fixed.num_workers()) == (4, 4)
    gpu = plan_placement(8, None, None, [8, 8], min_workers=2)
    assert (gpu.gpus_per_worker, gpu.num_workers(), describe_need(gpu)) == (1, (2, 8), "needs 2 workers x 1 GPU = 2 GPU")
