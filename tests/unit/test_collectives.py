"""The process group's record of a hang and its timeout (worker/collectives.py): torch's
private names it uses, pinned to the torch they were checked against; the timeout rule;
the workers' flight recorder settings; and the dump, the one-line account of it and the
shortened timeout in a real gloo process group (a process of its own, whose recorder is
on from its start)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import torch

from ray_ddp.cluster.runtime_env import FLIGHT_RECORDER_ENTRIES, flight_recorder_env, worker_runtime_env
from ray_ddp.config.train import TrainConfig
from ray_ddp.worker import collectives
from ray_ddp.worker.collectives import MEANT_WAIT_FACTOR, collective_timeout_s, describe_collectives

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_torch_installed_is_the_one_the_adapter_was_checked_against():
    assert torch.__version__.startswith(collectives.CHECKED_TORCH + "."), (
        f"worker/collectives.py was checked against torch {collectives.CHECKED_TORCH}; this is torch "
        f"{torch.__version__}: check the names below still exist and mean the same, then update CHECKED_TORCH")


def test_torchs_private_names_are_where_they_were():
    from torch._C import _distributed_c10d
    from torch.distributed import distributed_c10d

    assert list(inspect.signature(distributed_c10d._set_pg_timeout).parameters) == ["timeout", "group"]
    assert "includeCollectives" in _distributed_c10d._dump_fr_trace_json.__doc__
    assert "onlyActive" in _distributed_c10d._dump_fr_trace_json.__doc__


def test_the_process_group_outwaits_the_watch_before_and_after_the_first_step():
    from ray_ddp.worker.collectives import first_step_patience_s, start_up_timeout_s

    assert collective_timeout_s(0) is None and start_up_timeout_s(0) == 1800  # no watch: Ray Train's 30 min
    assert collective_timeout_s(10) == (MEANT_WAIT_FACTOR + 1) * 10 == 110
    assert collective_timeout_s(600) == 6600  # the default's: a meant wait's 6,000 s and one more
    for hang in (10, 60, 600):
        # the watch's patience and its handling (stacks, py-spy, kills) come first
        assert start_up_timeout_s(hang) >= first_step_patience_s(hang) + hang + 60
        assert collective_timeout_s(hang) >= MEANT_WAIT_FACTOR * hang + hang
        assert collective_timeout_s(hang) < start_up_timeout_s(hang)  # always lowered after the first step
    # --wait-timeout: the watch's patience for a first step and a meant wait, which the
    # process group outwaits as before
    assert first_step_patience_s(10, 20) == 20 and start_up_timeout_s(10, 20) == 20 + 10 + 120
    assert collective_timeout_s(10, 20) == 30 and collective_timeout_s(600, 7200) == 7800


def test_the_workers_flight_recorder_is_on_with_the_watch_and_the_users_size_wins(monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    env = flight_recorder_env("my run/1", 600)
    assert env["TORCH_FR_BUFFER_SIZE"] == str(FLIGHT_RECORDER_ENTRIES)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/ray_ddp_collectives_my_run_1_rank_"
    assert worker_runtime_env(TrainConfig(name="r"), 0)["env_vars"]["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert flight_recorder_env("r", 0) == {} and worker_runtime_env(TrainConfig(name="r", hang_timeout=0), 0) == {}
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's own setting, under its old name
    assert flight_recorder_env("r", 600) == {}


def test_nccl_raises_its_errors_where_a_gpu_survivor_can_save_unless_the_user_says_otherwise(monkeypatch):
    from ray_ddp.cluster.runtime_env import nccl_error_env

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    gpu = TrainConfig(name="r", hang_timeout=0)  # on workers the plan gives a GPU each
    assert worker_runtime_env(gpu, 1)["env_vars"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    # no survivor to save: CPU workers (gloo raises anyway), snapshots off, FSDP's shards
    for cfg, gpus in ((TrainConfig(name="r"), 0), (TrainConfig(name="r", snapshot_every_steps=0), 1),
                      (TrainConfig(name="r", strategy="fsdp"), 1)):
        assert nccl_error_env(cfg, gpus) == {}
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert nccl_error_env(gpu, 1) == {}


def test_a_rank_waiting_in_a_collective_is_told_by_its_record():
    trace = json.dumps({"entries": [
        {"pg_id": 0, "collective_seq_id": 56, "profiling_name": "gloo:all_reduce"},
        {"pg_id": 0, "collective_seq_id": 57, "profiling_name": "nccl:all_reduce"}],
        "pg_status": {"0": {"last_enqueued_collective": "57", "last_started_collective": "57",
                            "last_completed_collective": "56"}}})
    assert describe_collectives(trace) == ("process group 0: collective 57 enqueued, 56 completed, "
                                           "57 (nccl:all_reduce) not done")


def test_a_real_process_group_records_its_collectives_and_takes_the_shorter_timeout(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys, time
        import torch, torch.distributed as dist
        sys.path.insert(0, {ROOT!r})
        from ray_ddp.worker.collectives import describe_collectives, dump_collectives, shorten_collective_timeout
        assert dump_collectives() is None  # no process group yet: nothing recorded
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        dist.all_reduce(torch.ones(2))
        print(shorten_collective_timeout(10))
        dist.barrier()
        # gloo marks a collective completed from its own thread, a moment after barrier() returns
        for _ in range(200):
            trace = dump_collectives()
            if str(json.loads(trace)["pg_status"]["0"]["last_completed_collective"]) == "2":
                break
            time.sleep(0.05)
        print(describe_collectives(trace))
        print(json.dumps([(e["profiling_name"], e["timeout_ms"]) for e in json.loads(trace)["entries"]]))
        dist.destroy_process_group()
    """)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "100"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seconds, described, entries = proc.stdout.splitlines()
    assert seconds == "110"
    assert described == "process group 0: collective 2 enqueued, 2 completed"
    # the first collective ran under the start-up timeout, the next under the shorter one
    assert json.loads(entries) == [["gloo:all_reduce", 1800000], ["gloo:barrier", 110000]]
