"""Run storage under transient errors: reads and writes retry, a missing file is None,
and a file that cannot be read is an error, never an empty answer (which would let the
next write replace a table of earlier rows with only the new ones)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flaky_fs import flaky_fs
from ray_ddp.record.schema import SCHEMA
from ray_ddp.observe.callback import MetricsCallback
from ray_ddp.record.folder import METRICS_FILE, run_folder
from ray_ddp.storage import read_json, read_table, resolve_storage, write_json, write_table
from ray_ddp.errors import StorageError


def test_transient_read_and_write_errors_are_retried(tmp_path):
    pq.write_table(pa.table({"a": [1, 2, 3]}), tmp_path / "t.parquet")
    fs = flaky_fs(fail_opens=2)
    assert read_table(fs, str(tmp_path / "t.parquet")).column("a").to_pylist() == [1, 2, 3]
    write_json(flaky_fs(fail_opens=2), str(tmp_path / "s.json"), {"ok": 1})
    assert read_json(flaky_fs(fail_opens=1), str(tmp_path / "s.json")) == {"ok": 1}


def test_a_read_that_keeps_failing_raises_instead_of_answering_nothing(tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "t.parquet")
    with pytest.raises(StorageError, match=r"cannot read .*t.parquet \(AWS Error NETWORK_CONNECTION.*tried 4 times"):
        read_table(flaky_fs(fail_opens=99), str(tmp_path / "t.parquet"))
    (tmp_path / "m.json").write_text(json.dumps({"files": {}}))
    with pytest.raises(StorageError):
        read_json(flaky_fs(fail_opens=99), str(tmp_path / "m.json"))


def test_missing_files_are_none_and_a_non_json_file_is_a_value_error(tmp_path):
    assert read_json(flaky_fs(0), str(tmp_path / "nope.json")) is None
    assert read_table(flaky_fs(0), str(tmp_path / "nope.parquet")) is None
    (tmp_path / "torn.json").write_text('{"epoch": ')
    with pytest.raises(ValueError):
        read_json(flaky_fs(0), str(tmp_path / "torn.json"))


def row(step, rank):
    return {"epoch": 1, "step": step, "rank": rank, "loss": 1.0, "samples": 8, "step_time_s": 0.1,
            "samples_per_s": 80.0, "time": 1.0 + step, "busy_s": 0.05}


def test_metrics_table_that_cannot_be_read_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_table(flaky_fs(0), str(run / METRICS_FILE),
                pa.Table.from_pylist([row(5, 0), row(5, 1)], schema=SCHEMA))
    good = (run / METRICS_FILE).read_bytes()
    (run / METRICS_FILE).write_bytes(good[: len(good) // 2])  # unreadable, as after a bad copy
    callback = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "run"), epochs=1, total_steps=10)
    with pytest.raises(StorageError, match="metrics.parquet"):
        callback.after_report(None, [row(10, 0), row(10, 1)], checkpoint=None)
    assert (run / METRICS_FILE).read_bytes() == good[: len(good) // 2], "left as it was"


def test_a_location_under_a_uri_storage_keeps_the_query_after_the_path(tmp_path):
    store = resolve_storage("s3://runs/exp?endpoint_override=127.0.0.1:9000&scheme=http")
    assert store.uri_of("r", "step-00000040") == "s3://runs/exp/r/step-00000040?endpoint_override=127.0.0.1:9000&scheme=http"
    assert store.run_path("r") == "runs/exp/r"  # inside the filesystem, the path alone
    assert resolve_storage("gs://b/x/").uri_of("r") == "gs://b/x/r"
    assert resolve_storage(str(tmp_path)).uri_of("r", "metrics.parquet") == f"{tmp_path}/r/metrics.parquet"
