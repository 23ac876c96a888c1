"""The gloo harness (tests/helpers/gloo_run.py) trains what Ray Train trains: the checks
that run on it (test_recovery.py's, test_data.py's) stand for the real path only because
it does. full_run's toy (the same data, seed and steps; validated every epoch), once in
plain gloo processes, against full_run on Ray: the same windows, losses, validation and
weights at every epoch's end, rank 0's checkpoints in the run folder and the run
complete. (A rank's exception ends a harness fit naming it: test_recovery.py's weights
made infinite.)"""

from __future__ import annotations

import pytest

from ray_ddp.checkpoint.verify import find_latest_checkpoint

from ray_ddp.record.folder import run_folder
from ray_ddp.observe.runs import list_runs
from ray_ddp.storage import resolve_storage

from ._runs import rows_of, small
from gloo_run import train_in_gloo

pytestmark = pytest.mark.ray


def test_the_harness_trains_the_windows_and_weights_of_a_ray_train_run(full_run, full_val, storage):
    name = "harness-toy"
    summary = train_in_gloo(small(storage, name, val_data=full_val))
    ours, ray = rows_of(summary), rows_of(full_run)

    def windows(rows):
        return sorted((r["step"], r["rank"], r["samples"]) for r in rows)

    assert windows(ours) == windows(ray)
    by_window = {(r["step"], r["rank"]): r for r in ray}
    for row in ours:
        want = by_window[row["step"], row["rank"]]
        assert row["loss"] == pytest.approx(want["loss"], rel=1e-6), row["step"]
        assert row["weights_hash"] == want["weights_hash"], row["step"]  # each epoch's end
        assert row.get("val_loss") == (want.get("val_loss") and pytest.approx(want["val_loss"], rel=1e-6))
    assert [r["step"] for r in ours if r["weights_hash"] is not None and r["rank"] == 0] == [10, 20, 30]
    assert summary.epochs_completed == 3 and summary.final_loss == pytest.approx(full_run.final_loss, rel=1e-6)
    store = resolve_storage(str(storage))
    scan = find_latest_checkpoint(run_folder(store, name), verify_crc=True)
    assert scan.latest == "step-00000030" and not scan.broken and scan.meta["world_size"] == 2
    assert {r.name: r for r in list_runs(str(storage))}[name].state == "complete"
