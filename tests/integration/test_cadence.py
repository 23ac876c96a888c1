"""Checkpoints and validations by steps and by time, mid-epoch too, and --max-steps: a
lost worker redoes at most --checkpoint-every-steps steps, not the epoch so far. The
cadence moves no weight: every run here ends with the weights of the same run without
it, and a run stopped by --max-steps and rerun with a larger one continues bit-identically.
ray_ddp's own loop in the gloo harness (the reports and checkpoints it makes take the
path of every other checkpoint on Ray: test_faults.py, test_recovery.py; a worker killed
on Ray and restarted from a step checkpoint mid-epoch: test_fsdp.py's killed run)."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp.data.synth_files import write_synthetic

from ._runs import final_hashes, rows_of, small
from gloo_run import train_in_gloo

pytestmark = pytest.mark.ray

# 2 epochs of 10 steps, a metrics window every 5, validated on rows of its own
RUN = dict(epochs=2, report_every=5, report_interval=0, keep=20)


@pytest.fixture(scope="module")
def val(tmp_path_factory):
    path = tmp_path_factory.mktemp("cadence") / "val"
    write_synthetic(str(path), rows=64, features=10, targets=5, seed=9)
    return str(path)


@pytest.fixture(scope="module")
def plain(storage, val):
    """The run without a cadence: checkpoints and validations at epoch ends only."""
    return train_in_gloo(small(storage, "cadence-plain", val_data=val, **RUN))


def checkpoints(storage, name):
    return sorted(int(p.name.split("-")[1]) for p in (storage / name).glob("step-*"))


def test_checkpoints_and_validations_fall_by_steps_mid_epoch_and_move_no_weight(plain, storage, val):
    summary = train_in_gloo(small(storage, "cadence-steps", val_data=val, checkpoint_every_steps=4,
                                  eval_every_steps=6, **RUN))
    assert checkpoints(storage, "cadence-steps") == [4, 8, 10, 12, 16, 20]
    evals = pq.read_table(storage / "cadence-steps" / "eval.parquet").column("step").to_pylist()
    assert evals == [6, 10, 12, 18, 20]
    assert checkpoints(storage, "cadence-plain") == [10, 20]
    assert final_hashes(rows_of(summary)) == final_hashes(rows_of(plain))
    # what each checkpoint cost, on the writing rank's next row (DDP: rank 0): the window
    # after checkpoint 10 is the first that follows a checkpoint of the plain run
    saved = {(r["rank"], r["step"]): (r["checkpoint_save_s"], r["checkpoint_upload_s"]) for r in rows_of(plain)}
    assert saved[0, 5] == (None, None) and saved[0, 15][0] > 0 and saved[0, 15][1] > 0
    assert all(costs == (None, None) for (rank, _), costs in saved.items() if rank == 1)


def test_checkpoints_by_minutes_are_taken_at_window_ends_by_every_rank(storage, val):
    # a deadline always passed: every window's end checkpoints (windows close every 5 steps)
    train_in_gloo(small(storage, "cadence-minutes", val_data=val, checkpoint_every_minutes=1e-6, **RUN))
    assert checkpoints(storage, "cadence-minutes") == [5, 10, 15, 20]
    train_in_gloo(small(storage, "cadence-an-hour", val_data=val, checkpoint_every_minutes=60, **RUN))
    assert checkpoints(storage, "cadence-an-hour") == [10, 20]


def test_max_steps_ends_the_run_and_a_larger_one_continues_it_bit_identically(plain, storage, val):
    lines: list[str] = []
    first = train_in_gloo(small(storage, "cadence-max", val_data=val, max_steps=13, quiet=False, **RUN),
                          echo=lines.append)
    assert (first.steps, first.epochs_completed) == (13, 1)
    assert checkpoints(storage, "cadence-max") == [10, 13]
    assert "(to step 13 at most)" in lines[0], lines
    # validated where the run that never stopped validates (not at step 13: the rerun would
    # count that validation toward --early-stop, the other run never), its last row hashed
    evals = pq.read_table(storage / "cadence-max" / "eval.parquet").column("step").to_pylist()
    assert evals == [10]
    assert final_hashes(rows_of(first))
    again: list[str] = []
    same = train_in_gloo(small(storage, "cadence-max", val_data=val, max_steps=13, **RUN), echo=again.append)
    assert same.steps == 13 and again == ["run cadence-max is already complete (step 13, --max-steps 13); "
                                          "nothing to do (raise --max-steps to train further)"]
    rest = train_in_gloo(small(storage, "cadence-max", val_data=val, max_steps=100, **RUN))
    assert (rest.steps, rest.epochs_completed) == (20, 2)
    assert final_hashes(rows_of(rest)) == final_hashes(rows_of(plain))


def test_a_run_ended_mid_epoch_by_max_steps_hashes_rank_0s_batchnorm_statistics_on_every_rank(storage):
    """Each rank's forward moves its own BatchNorm statistics; at the run's end mid-epoch,
    as at an epoch's end, every rank takes rank 0's before it hashes (and would validate)."""
    summary = train_in_gloo(small(storage, "cadence-batchnorm", model="user_models:batchnorm_net", max_steps=13,
                                  **RUN))
    assert summary.steps == 13 and len(set(final_hashes(rows_of(summary)).values())) == 1


def test_a_survivor_saves_the_state_of_the_last_whole_step_when_its_peer_is_lost(storage, tmp_path, monkeypatch):
    """Rank 1 SIGKILLed in step 7's forward, after it moved its BatchNorm statistics; rank
    0 meets the loss in the step's gradient all-reduce and, before its error ends it,
    writes the state after step 6 into its node's survivor slot: the weights, optimizer
    and statistics of step 6 (not the half-done step 7's), the very tensors a run stopped
    at step 6 checkpoints. No periodic snapshot was due (every 1000)."""
    import functools
    import json

    from ray_ddp.errors import TrainingError
    from user_models import batchnorm_net_dying_in_group

    monkeypatch.setenv("RAY_DDP_SNAPSHOT_DIR", str(tmp_path / "shm"))
    cfg = small(storage, "survivor", epochs=1, snapshot_every_steps=1000)
    with pytest.raises(TrainingError):
        train_in_gloo(cfg, model=functools.partial(batchnorm_net_dying_in_group, 7))
    [meta] = list((tmp_path / "shm").rglob("survivor/meta.json"))
    assert json.loads(meta.read_text())["step"] == 6
    stopped = train_in_gloo(small(storage, "survivor-stopped", epochs=1, max_steps=6),
                            model=functools.partial(batchnorm_net_dying_in_group, 0))
    checkpoint = os.path.join(storage, "survivor-stopped", "step-00000006")
    assert stopped.steps == 6
    for name in ("model.pt", "train_state.pt"):
        survivor = torch.load(meta.parent / name, weights_only=True)
        stored = torch.load(os.path.join(checkpoint, name), weights_only=True)
        if name == "train_state.pt":
            survivor, stored = survivor["optimizer"]["state"], stored["optimizer"]["state"]
            survivor, stored = [survivor[k]["momentum_buffer"] for k in sorted(survivor)], \
                [stored[k]["momentum_buffer"] for k in sorted(stored)]
        else:
            assert set(survivor) == set(stored) and "bn1d.running_mean" in survivor
            survivor, stored = [survivor[k] for k in sorted(survivor)], [stored[k] for k in sorted(stored)]
        assert all(torch.equal(a, b) for a, b in zip(survivor, stored)), name
