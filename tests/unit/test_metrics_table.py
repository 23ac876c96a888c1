"""metrics.parquet appended to, not rewritten (observe/metrics_table.py): the metrics
callback writes each checkpoint's rows as a part, a restarted group's redone steps
replace the earlier attempt's, readers see the table and its parts as one, and the
driver's fold leaves one plain table. No Ray: the callback is fed reports as Ray
Train's controller would."""

from __future__ import annotations

import types

import pyarrow as pa
import pyarrow.parquet as pq

from ray_ddp.observe.callback import MetricsCallback
from ray_ddp.observe.metrics_table import MetricsAppender, fold_metrics, read_metrics
from ray_ddp.run_folder import METRICS_FILE, METRICS_PARTS_FOLDER, RunFolder
from ray_ddp.storage import resolve_storage


def row(step, rank, loss=1.0, **extra):
    return {"epoch": 1, "step": step, "rank": rank, "loss": loss, "samples": 8, "step_time_s": 0.1,
            "samples_per_s": 80.0, "time": 1.0 + step, "busy_s": 0.05, "world_size": 2, **extra}


def checkpoint(step):
    return types.SimpleNamespace(path=f"/somewhere/step-{step:08d}")


def keys(table):
    return [(r["step"], r["rank"], r["loss"]) for r in table.to_pylist()]


def test_each_checkpoint_writes_its_own_rows_and_never_the_table_again(tmp_path):
    (tmp_path / "r").mkdir()
    callback = MetricsCallback(str(tmp_path), "r", epochs=1, total_steps=30)
    run = tmp_path / "r"
    callback.after_report(None, [row(5, 0), row(5, 1)], checkpoint=None)
    callback.after_report(None, [row(10, 0), row(10, 1)], checkpoint=checkpoint(10))
    callback.after_report(None, [row(15, 0), row(15, 1)], checkpoint=None)
    callback.after_report(None, [row(20, 0), row(20, 1)], checkpoint=checkpoint(20))
    parts = sorted(p.name for p in (run / METRICS_PARTS_FOLDER).iterdir())
    assert parts == ["part-000000.parquet", "part-000001.parquet"]
    assert [r["step"] for r in pq.read_table(run / METRICS_PARTS_FOLDER / parts[1]).to_pylist()] == [15, 15, 20, 20]
    assert not (run / METRICS_FILE).exists()
    # a restarted group redoes steps 11-20 and reports them again: they replace the first try
    callback.after_report(None, [row(15, 0, 2.0, started_at=1.0), row(15, 1, 2.0, started_at=1.0)], checkpoint=None)
    callback.after_report(None, [row(20, 0, 2.0), row(20, 1, 2.0)], checkpoint=checkpoint(20))
    store = resolve_storage(str(tmp_path))
    folder = store.run_folder("r")
    want = [(5, 0, 1.0), (5, 1, 1.0), (10, 0, 1.0), (10, 1, 1.0), (15, 0, 2.0), (15, 1, 2.0), (20, 0, 2.0),
            (20, 1, 2.0)]
    assert keys(read_metrics(store.fs, folder)) == want
    fold_metrics(store.fs, folder)
    assert keys(pq.read_table(run / METRICS_FILE)) == want and not (run / METRICS_PARTS_FOLDER).exists()
    assert keys(read_metrics(store.fs, folder)) == want


def test_parts_after_an_older_table_drop_its_redone_steps_and_fill_its_missing_columns(tmp_path):
    store = resolve_storage(str(tmp_path))
    folder = RunFolder(str(tmp_path / "r"))
    (tmp_path / "r").mkdir()
    old = pa.Table.from_pylist([{"step": s, "rank": 0, "loss": 1.0} for s in (10, 20, 30)])  # an older writer's
    pq.write_table(old, tmp_path / "r" / METRICS_FILE)
    appender = MetricsAppender()
    appender.add(21, [row(25, 0, 3.0)])  # resumed from step 20's checkpoint: 30 is redone
    appender.write_part(store.fs, folder)
    appender.write_part(store.fs, folder)  # nothing new: no part
    merged = read_metrics(store.fs, folder)
    assert keys(merged) == [(10, 0, 1.0), (20, 0, 1.0), (25, 0, 3.0)]
    assert merged.to_pylist()[-1]["samples"] == 8 and merged.to_pylist()[0]["samples"] is None
    assert len(list((tmp_path / "r" / METRICS_PARTS_FOLDER).iterdir())) == 1


def test_a_run_with_neither_reads_as_none(tmp_path):
    store = resolve_storage(str(tmp_path))
    assert read_metrics(store.fs, RunFolder(str(tmp_path / "none"))) is None
    fold_metrics(store.fs, RunFolder(str(tmp_path / "none")))  # nothing to fold: nothing written
    assert not (tmp_path / "none").exists()
