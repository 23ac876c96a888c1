"""Real runs on a real local Ray: 2 gloo workers, real checkpoints, real parquet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp import ConfigError, run
from ray_ddp.checkpoint.format import META_FILE, MODEL_FILE, STATE_FILE

from ._runs import final_hashes, full_config, rows_of, small

pytestmark = pytest.mark.ray


HEADER = {"epoch", "step", "epoch_step", "world_size", "saved_by_rank", "config", "plan", "started_from", "format"}
REQUIRED_COLUMNS = {"epoch", "step", "rank", "loss", "samples", "step_time_s", "samples_per_s", "time"}


def test_every_rank_ends_with_identical_weights(full_run):
    hashes = final_hashes(rows_of(full_run))
    assert sorted(hashes) == [0, 1] and len(set(hashes.values())) == 1


def test_metrics_table_has_a_row_per_rank_per_report(full_run):
    table = pq.read_table(full_run.metrics)
    assert REQUIRED_COLUMNS <= set(table.column_names)
    keys = sorted((r["step"], r["rank"]) for r in table.to_pylist())
    assert keys == [(s, r) for s in (5, 10, 15, 20, 25, 30) for r in (0, 1)]
    rows = table.to_pylist()
    assert all(r["samples"] == 5 * 16 and r["step_time_s"] > 0 for r in rows)
    assert all(abs(r["samples_per_s"] - r["samples"] / r["step_time_s"]) < 1e-6 * r["samples_per_s"]
               for r in rows)
    first, last = rows[0]["loss"], full_run.final_loss
    assert last < 0.5 * first, "the loss should fall on the teacher-labelled data"
    assert all(r["max_rss_mb"] > 50 and r["gpu_max_mb"] is None for r in rows)
    starts = [r for r in rows if r["started_at"] is not None]
    assert sorted(r["rank"] for r in starts) == [0, 1] and all(r["step"] == 5 for r in starts)
    assert all(r["started_at"] < r["first_step_at"] < r["time"] for r in starts)


def test_summary_says_where_the_start_up_seconds_went(full_run):
    parts = full_run.startup_s
    assert list(parts) == ["python", "checks", "ray", "placement", "trainer", "first_step", "total"]
    assert all(v >= 0 for v in parts.values()) and parts["trainer"] > 0
    assert abs(sum(v for k, v in parts.items() if k != "total") - parts["total"]) < 0.01


def test_checkpoints_written_by_rank_0_only_and_kept_newest(full_run, storage):
    run_dir = storage / "full"
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-00000020", "step-00000030"]
    latest = run_dir / "step-00000030"
    assert sorted(os.listdir(latest)) == sorted([MODEL_FILE, STATE_FILE, META_FILE])
    state = torch.load(latest / STATE_FILE, weights_only=True)
    assert state["saved_by_rank"] == 0
    assert (state["epoch"], state["step"], len(state["rng"])) == (3, 30, 2)
    assert state["optimizer"]["state"], "optimizer state (momentum) must be saved"
    assert full_run.checkpoint == f"file://{latest}"  # stored through a file:// URI (conftest.py)
    # one header, in meta.json and train_state.pt alike (an FSDP checkpoint's: test_fsdp.py)
    meta = json.loads((latest / META_FILE).read_text())
    assert set(meta) == HEADER | {"time", "files"} and HEADER <= set(state)
    assert (meta["format"], meta["world_size"], meta["step"]) == ("whole", 2, 30)
    # what the user asked for and what the run resolved, apart: the task and the global
    # batch were left to the data and the workers
    assert (meta["config"]["task"], meta["config"]["global_batch"]) == (None, None)
    assert (meta["plan"]["task"], meta["plan"]["global_batch"], meta["plan"]["steps_per_epoch"]) == \
        ("regression", 32, 10)
    assert all(meta[k] == state[k] for k in HEADER)


def test_checkpoint_loads_into_a_fresh_toy_model_without_ray_ddp(full_run, storage):
    expected = final_hashes(rows_of(full_run))[0]
    checkpoint = str(storage / "full" / "step-00000030")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["ray_ddp"] = None
        import torch, torch.nn as nn
        class ToyModel(nn.Module):
            def __init__(self):
                super().__init__()
                self.net1 = nn.Linear(10, 10); self.relu = nn.ReLU(); self.net2 = nn.Linear(10, 5)
        m = ToyModel()
        m.load_state_dict(torch.load({checkpoint + '/' + MODEL_FILE!r}, weights_only=True))
        print(sum(p.numel() for p in m.parameters()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(10 * 10 + 10 + 10 * 5 + 5)
    # and those are the weights every rank ended with
    from ray_ddp.checkpoint.verify import weights_hash
    from ray_ddp.models.builtin import ToyModel

    model = ToyModel()
    model.load_state_dict(torch.load(f"{checkpoint}/{MODEL_FILE}", weights_only=True))
    assert weights_hash(model) == expected


def test_summary_json_matches_the_returned_summary(full_run, storage):
    saved = json.loads((storage / "full" / "summary.json").read_text())
    assert saved == full_run.to_dict()
    assert (saved["world_size"], saved["gpus_per_worker"], saved["epochs_completed"]) == (2, 0, 3)
    assert saved["resumed_from"] is None and saved["samples_per_s"] > 0


def test_a_complete_run_says_so_and_returns_at_once(full_run, storage, full_val, capsys):
    again = run(full_config(storage, full_val))
    assert again.already_complete and again.checkpoint == full_run.checkpoint
    assert "already complete (3/3 epochs)" in capsys.readouterr().out


def test_resume_with_another_model_shape_is_refused(full_run, storage):
    with pytest.raises(ConfigError, match="was trained with model='user_models:slow_on_rank_one'"):
        run(small(storage, "full", model="mlp", epochs=4))
    # a DDP checkpoint holds the whole model, an FSDP one shards: never mixed up
    with pytest.raises(ConfigError, match="was trained with strategy='ddp' but this command has "
                                          "strategy='fsdp'; use the same value to resume"):
        run(small(storage, "full", model="user_models:slow_on_rank_one", strategy="fsdp", epochs=4))


def test_gpus_asked_for_on_a_cpu_cluster_fail_fast(ray_local, storage):
    with pytest.raises(ConfigError, match=r"needs 2 workers x 1 GPU = 2 GPU; the cluster has 0 GPU"):
        run(small(storage, "no-gpu", gpus_per_worker=1))
    assert not (storage / "no-gpu").exists()


def test_waiting_for_nodes_gives_up_after_the_bound(ray_local):
    from ray_ddp.cluster.placement import plan_placement
    from ray_ddp.cluster.preflight import describe_need, wait_for_autoscaler

    too_many = plan_placement(64, 0, None, [0])  # the shared local Ray has 14 CPUs
    said = []
    with pytest.raises(ConfigError, match=r"gave up after 2 s waiting for the autoscaler: the job "
                                          r"needs 64 workers x 1 CPU = 64 CPU; the cluster has 14 CPU"):
        wait_for_autoscaler(too_many, describe_need(too_many), 2, said.append, poll_s=0.5)
    assert said == ["waiting up to 2 s for the autoscaler to add nodes: the job needs 64 workers x 1 CPU = 64 CPU"]


def test_attached_cluster_too_small_fails_fast(ray_local, storage):
    with pytest.raises(ConfigError, match=r"needs 15 workers x 1 CPU = 15 CPU; the cluster has 14 CPU "
                                          r"and no autoscaler; lower --workers or add nodes"):
        run(small(storage, "too-many", workers=15))
    assert not (storage / "too-many").exists()


def test_a_ray_already_running_here_is_not_ours_to_fill_on_a_16_core_machine(full_run, storage):
    # conftest makes os.cpu_count() report 16 in this process, and the shared Ray has 12
    # CPUs: 2 x 8 would never fit. A Ray that was already there gets 1 CPU per worker.
    assert os.cpu_count() == 16
    meta = json.loads((storage / "full" / "step-00000030" / META_FILE).read_text())
    assert meta["plan"]["cpus_per_worker"] == 1 and meta["config"]["cpus_per_worker"] is None  # asked none


def test_an_address_other_than_the_ray_this_process_is_attached_to_is_refused(ray_local, storage):
    import socket

    with socket.socket() as listener:  # something answers there, but it is not our Ray
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(ConfigError, match=rf"Ray is already initialized in this process \(cluster at "
                                              rf".*\), so --address / RAY_ADDRESS {address} cannot be used"):
            run(small(storage, "other-cluster", address=address))
    assert not (storage / "other-cluster").exists()


def test_summary_has_three_throughputs_each_what_its_name_says(full_run):
    rows = rows_of(full_run)
    total = sum(r["samples"] for r in rows)
    # over the command's whole wall time (start-up included): the smallest of the three,
    # every sample over at least run()'s own wall time (from the process's start for its
    # first run(), from the call for a later one; wall_time_s is read a moment after)
    assert full_run.wall_samples_per_s < full_run.train_samples_per_s < full_run.samples_per_s
    assert total / full_run.wall_samples_per_s >= 0.98 * full_run.wall_time_s
    # first step to last, every report and checkpoint included: below the steps' own rate
    first_step = min(r["time"] - r["step_time_s"] for r in rows)
    assert total / full_run.train_samples_per_s >= max(r["time"] for r in rows) - first_step
    # the steady rate of steps: never above the fastest window's
    fastest = max(sum(r["samples_per_s"] for r in rows if r["step"] == s) for s in {r["step"] for r in rows})
    assert 0 < full_run.samples_per_s <= fastest * 1.000001


def test_every_window_carries_the_figures_the_field_reads(full_run):
    rows = rows_of(full_run)
    # the toy's gradients, before clipping (--clip-grad 1.0 in small()): the same on both
    # ranks (all-reduced), positive, and in the summary as the last window's
    for step in {r["step"] for r in rows}:
        norms = {r["grad_norm"] for r in rows if r["step"] == step}
        assert len(norms) == 1 and all(0 < n < 1e3 for n in norms), norms
    assert full_run.grad_norm == [r["grad_norm"] for r in rows if r["step"] == full_run.steps][0]
    assert all(0 <= r["data_wait_s"] <= r["step_time_s"] and 0 <= r["data_wait_share"] <= 1 for r in rows)
    assert 0 <= full_run.data_wait_share <= 1
    # not a token task, and on CPU: no tokens, no mfu
    assert all(r["tokens"] is None and r["tokens_per_s"] is None and r["mfu"] is None for r in rows)
    assert (full_run.tokens_per_s, full_run.mfu) == (None, None)
