"""What each process of ``ray-ddp launch`` / ``ray_ddp.spawn`` finds in its environment, and
the device it then picks, for GPU groups of one and two nodes, GPU pairs and CPU groups
(pure functions: no Ray, no GPU needed)."""

import pytest
import torch

from ray_ddp.launch.devices import select_devices
from ray_ddp.launch.env import PROCESS_DEVICES_ENV, plan_node_env


def node_view(env):
    """The variables that depend on the node: where the rank sits and what it sees/owns."""
    return (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env.get("CUDA_VISIBLE_DEVICES"),
            env[PROCESS_DEVICES_ENV])


def test_one_node_four_processes_see_all_four_gpus_and_own_gpu_local_rank():
    envs = plan_node_env([("n1", ["0"]), ("n1", ["1"]), ("n1", ["2"]), ("n1", ["3"])])
    assert [node_view(e) for e in envs] == [(str(k), "4", "0,1,2,3", str(k)) for k in range(4)]
    assert [(e["RANK"], e["WORLD_SIZE"]) for e in envs] == [(str(r), "4") for r in range(4)]


def test_local_rank_follows_the_gpus_ray_gave_not_the_actor_order():
    # Ray may hand bundle 0 a higher GPU id: local rank k must still own visible device k
    envs = plan_node_env([("n1", ["1"]), ("n1", ["0"])])
    assert [node_view(e) for e in envs] == [("1", "2", "0,1", "1"), ("0", "2", "0,1", "0")]
    assert [e["RANK"] for e in envs] == ["0", "1"]  # ranks stay the actors' order


def test_two_nodes_of_two_each_see_their_own_nodes_gpus():
    envs = plan_node_env([("a", ["0"]), ("a", ["1"]), ("b", ["2"]), ("b", ["3"])])
    assert [node_view(e) for e in envs] == [("0", "2", "0,1", "0"), ("1", "2", "0,1", "1"),
                                            ("0", "2", "2,3", "0"), ("1", "2", "2,3", "1")]


def test_gpu_ids_sort_as_numbers():
    envs = plan_node_env([("n", ["10"]), ("n", ["2"])])
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "2,10" and envs[0]["LOCAL_RANK"] == "1"


def test_pairs_local_rank_k_owns_devices_2k_and_2k_plus_1():
    envs = plan_node_env([("n", ["2", "3"]), ("n", ["0", "1"]), ("m", ["0", "1"])])
    assert [node_view(e) for e in envs] == [("1", "2", "0,1,2,3", "2,3"), ("0", "2", "0,1,2,3", "0,1"),
                                            ("0", "1", "0,1", "0,1")]


def test_a_cpu_group_keeps_its_visible_devices_and_owns_none():
    envs = plan_node_env([("a", []), ("a", []), ("b", [])])
    assert [node_view(e) for e in envs] == [("0", "2", None, ""), ("1", "2", None, ""),
                                            ("0", "1", None, "")]


def cuda(*indices):
    return [torch.device(f"cuda:{i}") for i in indices]


CPU = [torch.device("cpu")]


@pytest.mark.parametrize("processes, want", [
    ([("n", ["0"]), ("n", ["1"]), ("n", ["2"]), ("n", ["3"])], [cuda(0), cuda(1), cuda(2), cuda(3)]),
    ([("a", ["0"]), ("a", ["1"]), ("b", ["0"]), ("b", ["1"])], [cuda(0), cuda(1), cuda(0), cuda(1)]),
    ([("n", ["0", "1"]), ("n", ["2", "3"])], [cuda(0, 1), cuda(2, 3)]),
    ([("n", []), ("n", [])], [CPU, CPU]),  # a CPU group on a GPU node: the CPU, not cuda:0
])
def test_each_process_picks_the_devices_it_owns(processes, want):
    envs = plan_node_env(processes)
    assert [select_devices(e, cuda_available=True) for e in envs] == want
    # LOCAL_RANK k of g GPUs each owns cuda:k*g .. k*g+g-1
    g = len(processes[0][1])
    for e, own in zip(envs, want):
        if g:
            assert own[0] == torch.device(f"cuda:{int(e['LOCAL_RANK']) * g}")


def test_without_cuda_every_process_is_on_the_cpu():
    envs = plan_node_env([("n", ["0"]), ("n", ["1"])]) + plan_node_env([("n", [])])
    assert all(select_devices(e, cuda_available=False) == CPU for e in envs)


def test_device_and_devices_read_this_process_environment(monkeypatch):
    import ray_ddp

    monkeypatch.setenv(PROCESS_DEVICES_ENV, "")
    assert ray_ddp.devices() == CPU and ray_ddp.device() == ray_ddp.device(1) == CPU[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(PROCESS_DEVICES_ENV, "2,3")
    assert ray_ddp.devices() == cuda(2, 3)
    assert [ray_ddp.device(), ray_ddp.device(1)] == cuda(2, 3)
    monkeypatch.setenv(PROCESS_DEVICES_ENV, "")
    assert ray_ddp.device() == CPU[0]  # given no GPU, even where CUDA is available
