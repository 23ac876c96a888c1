"""--early-stop on real Ray: a run whose validation loss never gets lower stops after N
validations without a lower one, checkpoints that epoch (whatever --checkpoint-every
says), says so on the driver and in summary.json and metrics.parquet, and counts as
complete on a rerun; a rerun with a larger --early-stop counts on from the validations
so far (the count survives the resume)."""

from __future__ import annotations

import dataclasses
import json
import os

import pyarrow.parquet as pq
import pytest

from ray_ddp import run
from ray_ddp.data.synth_files import write_synthetic

from ._runs import rows_of, small

pytestmark = pytest.mark.ray


def test_early_stop_ends_the_run_says_so_and_a_rerun_is_complete(ray_local, storage, tmp_path):
    data = tmp_path / "reg"
    # 400 rows, 80 held out: 320 / (2 workers x 16) = 10 steps an epoch
    write_synthetic(str(data), rows=400, features=10, targets=5, seed=3)
    # lr 1e-30: every update is below a float32 weight's last bit, so the weights, and so
    # val_loss, stay exactly as they were: every validation after the first is no lower
    cfg = small(storage, "early-stop", data=str(data), val_fraction=0.2, epochs=10, lr=1e-30,
                early_stop=2, checkpoint_every=4, quiet=False)
    lines: list[str] = []
    summary = run(cfg, echo=lines.append)

    assert (summary.epochs_completed, summary.steps) == (3, 30)
    assert summary.early_stopped and summary.early_stop_epoch == 3
    assert summary.checkpoint == f"{summary.path}/step-00000030"  # forced: --checkpoint-every 4
    assert sorted(p for p in os.listdir(summary.path) if p.startswith("step-")) == ["step-00000030"]
    said = [line for line in lines if line.startswith("early stop:")]
    assert len(said) == 1, lines
    assert said[0].startswith(f"early stop: val_loss {summary.val_loss:.4f} has not improved for 2 validations "
                              f"(best {summary.val_loss:.4f} at epoch 1); stopped after epoch 3 of 10"), said
    with open(f"{summary.path}/summary.json") as f:
        written = json.load(f)
    assert written["early_stopped"] is True and written["early_stop_epoch"] == 3
    evals = pq.read_table(f"{summary.path}/eval.parquet").to_pylist()
    assert [r["epoch"] for r in evals] == [1, 2, 3] and len({r["loss"] for r in evals}) == 1
    assert {r["samples"] for r in evals} == {80}  # --val-fraction 0.2: the held-out 80 of 400 rows
    rows = rows_of(summary)
    assert {r["early_stopped"] for r in rows if r["step"] == 30} == {True}  # every rank's row
    assert {r["early_stopped"] for r in rows if r["step"] in (10, 20)} == {False}
    assert {r["early_stopped"] for r in rows if r["step"] % 10} == {None}  # no validation there

    # the same command again: complete, nothing trained
    lines.clear()
    again = run(cfg, echo=lines.append)
    assert again.already_complete and again.checkpoint == summary.checkpoint and again.early_stopped
    assert any("already complete: --early-stop 2 ended it after epoch 3 of 10" in line for line in lines), lines

    # a larger --early-stop resumes and counts on from epoch 3's count (2): one more
    # validation without a lower val_loss stops it; a count started afresh would go to epoch 7
    more = run(dataclasses.replace(cfg, early_stop=3, quiet=True))
    assert not more.already_complete and more.resumed_from == summary.checkpoint
    assert (more.epochs_completed, more.early_stopped, more.early_stop_epoch) == (4, True, 4)
    assert [r["epoch"] for r in pq.read_table(f"{more.path}/eval.parquet").to_pylist()] == [1, 2, 3, 4]
