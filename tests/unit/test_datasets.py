"""Parquet data: synth, checks with one-line errors, and epoch sharding (no Ray)."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp.cli.main import main
from ray_ddp.data.sources import epoch_order, rows_of_step, steps_for_rows
from ray_ddp.data.table_stats import inspect_table
from ray_ddp.data.tables import load_table
from ray_ddp.data.synth_files import write_synthetic


def test_synth_writes_a_learnable_set_in_several_files(tmp_path, capsys):
    assert main(["data", "synth", "--rows", "1000", "--features", "8", "--targets", "3",
                 "--out", str(tmp_path / "set"), "--files", "4"]) == 0
    assert "wrote 1000 rows (8 features, 3 targets) to 4 parquet file(s)" in capsys.readouterr().out
    assert len(list((tmp_path / "set").glob("part-*.parquet"))) == 4
    table = inspect_table(str(tmp_path / "set"), None, None)
    assert (table.rows, table.input_dim, table.output_dim) == (1000, 8, 3)
    assert table.features == tuple(f"f{i}" for i in range(8))
    x, y = load_table(table)
    assert x.shape == (1000, 8) and y.shape == (1000, 3) and y.var() > 0.05


def test_fixed_size_list_columns_and_named_columns(tmp_path):
    x = pa.FixedSizeListArray.from_arrays(pa.array([float(i) for i in range(12)], pa.float32()), 3)
    pq.write_table(pa.table({"x": x, "label": pa.array([1.0, 2.0, 3.0, 4.0])}), tmp_path / "t.parquet")
    table = inspect_table(str(tmp_path / "t.parquet"), "x", "label")
    assert (table.input_dim, table.output_dim) == (3, 1)
    inputs, targets = load_table(table)
    assert inputs[1].tolist() == [3.0, 4.0, 5.0] and targets[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.fixture
def bad_sets(tmp_path):
    write_synthetic(str(tmp_path / "good"), 10, 2, 1)
    pq.write_table(pa.table({"f0": pa.array([], pa.float32()), "t0": pa.array([], pa.float32())}),
                   tmp_path / "empty.parquet")
    pq.write_table(pa.table({"f0": ["a", "b"], "t0": [1.0, 2.0]}), tmp_path / "strings.parquet")
    (tmp_path / "notes.parquet").write_text("this is not parquet")
    return tmp_path


@pytest.mark.parametrize("argv, fragment", [
    (["--data", "{d}/missing"], "does not exist"),
    (["--data", "{d}/notes.parquet"], "is not readable as parquet"),
    (["--data", "{d}/empty.parquet"], "has no rows"),
    (["--data", "{d}/strings.parquet"], "column 'f0' is string; features and targets must be numbers"),
    (["--data", "{d}/good", "--features", "f0,nope"], "has no column 'nope'; its columns are id, f0, f1, t0"),
    (["--data", "{d}/good", "--dataset", "x:y"], "give --data or --dataset, not both"),
])
def test_bad_data_is_one_line(bad_sets, capsys, argv, fragment):
    argv = [a.replace("{d}", str(bad_sets)) for a in argv]
    assert main(["train", *argv, "--storage", str(bad_sets / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1, err
    assert not (bad_sets / "runs").exists() or not any((bad_sets / "runs").iterdir())


def test_every_row_once_per_epoch_across_two_ranks():
    n, world, batch = 1003, 2, 64  # the last step is short and split unevenly
    steps = steps_for_rows(n, world * batch)
    for epoch in (0, 1):
        order = epoch_order(n, seed=7, epoch=epoch)
        seen = [rows_of_step(order, s, r, 0, world, world * batch, 1)[0] for s in range(steps)
                for r in range(world)]
        ids = torch.cat(seen)
        assert len(ids) == n and sorted(ids.tolist()) == list(range(n))
    assert not torch.equal(epoch_order(n, 7, 0), epoch_order(n, 7, 1))  # reshuffled each epoch
    assert torch.equal(epoch_order(n, 7, 1), epoch_order(n, 7, 1))  # and the same run to run


def test_global_batch_is_the_same_rows_for_2x128_and_1x256():
    order = epoch_order(1024, seed=0, epoch=0)
    for step in range(4):
        one, share1 = rows_of_step(order, step, 0, 0, 1, 256, 1)
        two = [rows_of_step(order, step, r, 0, 2, 256, 1) for r in range(2)]
        assert torch.equal(torch.cat([t[0] for t in two]), one)
        assert share1 == 256 and two[0][1] == 128  # each rank's share: the loss normalizer
