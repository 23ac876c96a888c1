"""metrics.parquet appended to, not rewritten (record/metrics_table.py): the metrics
callback writes each checkpoint's rows as a part, a restarted group's redone steps
replace the earlier attempt's, readers see the table and its parts as one, and the
driver's fold leaves one plain table. No Ray: the callback is fed reports as Ray
Train's controller would."""

from __future__ import annotations

import types

import pyarrow as pa
import pyarrow.parquet as pq

from ray_ddp.observe.callback import MetricsCallback
from ray_ddp.record.metrics_table import MetricsAppender, fold_metrics, read_metrics
from ray_ddp.record.folder import METRICS_FILE, METRICS_PARTS_FOLDER, run_folder
from ray_ddp.storage import resolve_storage


def row(step, rank, loss=1.0, **extra):
    return {"epoch": 1, "step": step, "rank": rank, "loss": loss, "samples": 8, "step_time_s": 0.1,
            "samples_per_s": 80.0, "time": 1.0 + step, "busy_s": 0.05, "world_size": 2, **extra}


def checkpoint(step):
    return types.SimpleNamespace(path=f"/somewhere/step-{step:08d}")


def keys(table):
    return [(r["step"], r["rank"], r["loss"]) for r in table.to_pylist()]


def test_each_checkpoint_appends_its_rows_and_the_table_is_rewritten_only_as_it_doubles(tmp_path):
    (tmp_path / "r").mkdir()
    callback = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=200)
    run = tmp_path / "r"
    store = resolve_storage(str(tmp_path))
    folder = run_folder(store, "r")
    in_table, in_all, parts = [], [], []
    for step in range(10, 90, 10):  # a report of 2 ranks, then its checkpoint, 8 times
        callback.after_report(None, [row(step - 5, 0), row(step - 5, 1)], checkpoint=None)
        callback.after_report(None, [row(step, 0), row(step, 1)], checkpoint=checkpoint(step))
        in_table.append(pq.read_table(run / METRICS_FILE).num_rows)
        in_all.append(read_metrics(folder).num_rows)
        parts.append(len(list((run / METRICS_PARTS_FOLDER).iterdir())) if (run / METRICS_PARTS_FOLDER).exists() else 0)
    # metrics.parquet from the first checkpoint on, rewritten at the 1st, 2nd, 4th and 8th
    # (as the appended rows reach its own): each row rewritten a bounded number of times
    assert in_table == [4, 8, 8, 16, 16, 16, 16, 32]
    assert parts == [0, 0, 1, 0, 1, 2, 3, 0]
    assert in_all == [4, 8, 12, 16, 20, 24, 28, 32]  # what every reader sees: every row
    # a restarted group redoes steps 81-100 (its checkpoint was step 80's): its rows replace the first try's
    callback.after_report(None, [row(85, 0, 2.0, started_at=1.0), row(85, 1, 2.0, started_at=1.0)], checkpoint=None)
    callback.after_report(None, [row(90, 0, 2.0), row(90, 1, 2.0)], checkpoint=checkpoint(90))
    callback.after_report(None, [row(95, 0, 3.0), row(95, 1, 3.0)], checkpoint=None)
    callback.after_report(None, [row(100, 0, 3.0), row(100, 1, 3.0)], checkpoint=checkpoint(100))
    callback.after_report(None, [row(95, 0, 4.0, started_at=1.0), row(95, 1, 4.0, started_at=1.0)], checkpoint=None)
    callback.after_report(None, [row(100, 0, 4.0), row(100, 1, 4.0)], checkpoint=checkpoint(100))
    want = keys(read_metrics(folder))
    assert want[-8:] == [(85, 0, 2.0), (85, 1, 2.0), (90, 0, 2.0), (90, 1, 2.0),
                         (95, 0, 4.0), (95, 1, 4.0), (100, 0, 4.0), (100, 1, 4.0)] and len(want) == 40
    fold_metrics(folder)  # the driver, when the fit ends
    assert keys(pq.read_table(run / METRICS_FILE)) == want and not (run / METRICS_PARTS_FOLDER).exists()


def test_parts_after_an_older_table_drop_its_redone_steps_and_fill_its_missing_columns(tmp_path):
    folder = run_folder(resolve_storage(str(tmp_path)), "r")
    (tmp_path / "r").mkdir()
    old = pa.Table.from_pylist([{"step": s, "rank": 0, "loss": 1.0} for s in (10, 20, 30)])  # an older writer's
    pq.write_table(old, tmp_path / "r" / METRICS_FILE)
    appender = MetricsAppender(table_rows=3)  # a part of 1 row stays a part beside 3
    appender.add(21, [row(25, 0, 3.0)])  # resumed from step 20's checkpoint: 30 is redone
    appender.write(folder, seal=True)
    appender.write(folder, seal=True)  # nothing new: no part
    merged = read_metrics(folder)
    assert keys(merged) == [(10, 0, 1.0), (20, 0, 1.0), (25, 0, 3.0)]
    assert merged.to_pylist()[-1]["samples"] == 8 and merged.to_pylist()[0]["samples"] is None
    assert len(list((tmp_path / "r" / METRICS_PARTS_FOLDER).iterdir())) == 1
    appender.add(30, [row(30, 0, 3.0), row(35, 0, 3.0)])  # 3 rows appended now: folded into the table
    appender.write(folder, seal=True)
    assert keys(pq.read_table(tmp_path / "r" / METRICS_FILE)) == [(10, 0, 1.0), (20, 0, 1.0), (25, 0, 3.0),
                                                                 (30, 0, 3.0), (35, 0, 3.0)]
    assert not (tmp_path / "r" / METRICS_PARTS_FOLDER).exists()


def test_a_run_with_neither_reads_as_none(tmp_path):
    none = run_folder(resolve_storage(str(tmp_path)), "none")
    assert read_metrics(none) is None
    fold_metrics(none)  # nothing to fold: nothing written
    assert not (tmp_path / "none").exists()


def test_rows_reported_after_the_last_checkpoint_survive_a_failure_and_a_killed_driver(tmp_path):
    """A report every 2 steps, a checkpoint at step 10, then the run dies after step 30:
    the rows of steps 12-30 are those that explain the failure. Each report's rows are in
    storage before the next report comes, so they survive a failed fit, and a controller
    killed with its driver (no hook runs): the next command reads them, and its fold keeps them."""
    (tmp_path / "r").mkdir()
    store = resolve_storage(str(tmp_path))
    folder = run_folder(store, "r")
    callback = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=3, total_steps=30)
    for step in range(2, 31, 2):
        callback.after_report(None, [row(step, 0), row(step, 1)], checkpoint(step) if step == 10 else None)
        # no hook after this report: what a killed driver (and its controller) leaves
        assert sorted(set(read_metrics(folder).column("step").to_pylist())) == list(range(2, step + 1, 2))
    callback.after_exception(None, {})
    fold_metrics(folder)  # what the driver does after the failed fit
    assert sorted(set(pq.read_table(tmp_path / "r" / METRICS_FILE).column("step").to_pylist())) == \
        list(range(2, 31, 2))
    # the next command's group redoes steps 11-30 from step 10's checkpoint: its rows replace the lost attempt's
    again = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=3, total_steps=30)
    again.after_report(None, [row(12, 0, 5.0, started_at=1.0), row(12, 1, 5.0, started_at=1.0)], None)
    assert keys(read_metrics(folder))[-2:] == [(12, 0, 5.0), (12, 1, 5.0)]
    assert len(read_metrics(folder)) == 12


def test_an_open_part_is_rewritten_in_place_and_sealed_at_a_size_bound(tmp_path, monkeypatch):
    """Rows since the last seal live in one part, rewritten at each report: the parts'
    count grows with sealed parts only, and a seal comes at a checkpoint or a size bound."""
    import ray_ddp.record.metrics_table as metrics_table

    monkeypatch.setattr(metrics_table, "SEAL_ROWS", 6)
    (tmp_path / "r").mkdir()
    store = resolve_storage(str(tmp_path))
    folder = run_folder(store, "r")
    appender = MetricsAppender(table_rows=100)  # a big table: no fold here
    for step in range(1, 8):
        appender.add(step, [row(step, 0), row(step, 1)])
        appender.write(folder, seal=False)
    parts = sorted(p.name for p in (tmp_path / "r" / METRICS_PARTS_FOLDER).iterdir())
    # steps 1-3 (6 rows) sealed as part 0, steps 4-6 as part 1, step 7 open in part 2
    assert parts == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"], parts
    assert [s for s, _, _ in keys(read_metrics(folder))] == [s for s in range(1, 8) for _ in (0, 1)]


def test_a_group_resumed_from_a_checkpoint_replaces_every_row_after_it_whatever_its_windows(tmp_path):
    """The first command reported every 5 steps, checkpointed at 10, and died after 20; the
    rerun reports every 10: its first window ends at 20, but it redid steps 11-20, so the
    dead attempt's row of step 15 goes too (its first row says where it resumed)."""
    (tmp_path / "r").mkdir()
    store = resolve_storage(str(tmp_path))
    first = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=30)
    for step in (5, 10, 15, 20):
        first.after_report(None, [row(step, 0)], checkpoint(step) if step == 10 else None)
    again = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=30)
    again.after_report(None, [row(20, 0, 2.0, started_at=1.0, resumed_at=10)], None)
    assert keys(read_metrics(run_folder(store, "r"))) == [(5, 0, 1.0), (10, 0, 1.0), (20, 0, 2.0)]
