"""Bring your own DDP code: the tutorial's own demo functions through ray_ddp.spawn, and an
unmodified torchrun-style script through `ray-ddp launch` (gloo on CPU, real processes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ray_ddp import ProcessFailed, spawn
from ray_ddp.launch.launch import launch

pytestmark = pytest.mark.ray
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples")


def load_tutorial():
    spec = importlib.util.spec_from_file_location("tutorial_spawn", os.path.join(EXAMPLES, "tutorial_spawn.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["tutorial_spawn"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("demo", ["demo_basic", "demo_checkpoint", "demo_model_parallel"])
def test_tutorial_demo_runs_through_spawn(ray_local, demo):
    tutorial = load_tutorial()
    per_rank = tutorial.run_demo(getattr(tutorial, demo), 2)
    assert len(per_rank) == 2
    # DDP kept the ranks in sync: both processes end with the same parameters
    assert all(torch.equal(a, b) for a, b in zip(per_rank[0], per_rank[1]))


def fails_on_rank_one(rank, message):
    if rank == 1:
        raise ValueError(message)
    return rank


def test_a_failing_rank_is_named(ray_local):
    with pytest.raises(ProcessFailed, match=r"rank 1 failed: ValueError: bad batch") as err:
        spawn(fails_on_rank_one, args=("bad batch",), nprocs=2)
    assert err.value.rank == 1


def env_and_listeners(rank):
    """The env:// variables this process got, and the addresses the rendezvous store
    listens on (it lives as long as the group, so look while a group is up)."""
    import psutil

    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    port = int(os.environ["MASTER_PORT"])
    listeners = sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN and c.laddr.port == port})
    return env, listeners


def test_each_process_gets_the_env_init_method_variables(ray_local):
    got = spawn(env_and_listeners, nprocs=2)
    envs = [env for env, _ in got]
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert sorted(e["LOCAL_RANK"] for e in envs) == ["0", "1"]  # both on the one local node
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    # the rendezvous store listened on the node's address only, never on every interface
    assert got[0][1] == [envs[0]["MASTER_ADDR"]] == ["127.0.0.1"]


def test_waiting_for_a_placement_is_bounded(ray_local):
    from ray_ddp import ConfigError
    from ray_ddp.cluster.placement import Placement
    from ray_ddp.launch.spawn import start_group

    too_big = Placement(workers=1, gpus_per_worker=0, cpus_per_worker=64, backend="gloo")
    with pytest.raises(ConfigError, match=r"could not place the processes within 1 s: the job needs "
                                          r"1 workers x 64 CPU = 64 CPU"):
        start_group(too_big, {}, wait_s=1)
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values()
               if pg["bundles"].get(0, {}).get("CPU") == 64), "the unplaced group is removed"


def test_launch_runs_an_unmodified_torchrun_script(ray_address, tmp_path):
    out = tmp_path / "ddp.pt"
    env = {**os.environ, "RAY_ADDRESS": ray_address}  # the shared Ray, through the variable users set
    proc = subprocess.run([sys.executable, "-m", "ray_ddp", "launch", "--workers", "2",
                           os.path.join(EXAMPLES, "torchrun_script.py"), "--steps", "20", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "[rank0]: step 20 loss" in proc.stdout and "world 2" in proc.stdout  # rank 0's output, streamed
    assert "[rank1]: rank 1 of 2 ready" in proc.stdout  # and every other rank's, labelled
    weights = torch.load(out, weights_only=True)
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_launch_reports_the_failing_rank_and_its_status(ray_local, tmp_path, capsys):
    code = launch([os.path.join(EXAMPLES, "torchrun_script.py"), "--fail-on-rank", "1",
                   "--out", str(tmp_path / "x.pt")], nprocs=2)
    assert code == 3
    assert "ray-ddp launch: rank 1 failed: exited with status 3" in capsys.readouterr().err


def test_launch_names_the_error_of_a_failed_rank_and_prefixes_every_ranks_lines(ray_local, tmp_path, capsys):
    code = launch([os.path.join(EXAMPLES, "torchrun_script.py"), "--raise-on-rank", "1",
                   "--out", str(tmp_path / "x.pt")], nprocs=2)
    out, err = capsys.readouterr()
    assert code == 1
    assert ("ray-ddp launch: rank 1 failed: RuntimeError: injected failure on rank 1; exited "
            "with status 1") in err
    # the traceback, as rank 1 wrote it to its stderr, prefixed with its rank
    assert "[rank1]: Traceback (most recent call last):" in err
    assert "  [rank1]: RuntimeError: injected failure on rank 1" in err  # in the summary's tail
    # every rank's stdout reaches the user, each line labelled
    assert "[rank0]: rank 0 of 2 ready" in out and "[rank1]: rank 1 of 2 ready" in out
