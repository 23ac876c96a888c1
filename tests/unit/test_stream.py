"""--stream: row groups read one at a time still give every row once per epoch, in an
order fixed by the seed, with every rank taking the same steps; any step can be found
again after a resume. Its start-up reads the parquet footers, not the columns: the rows,
classes and vocabulary found match the whole column's, with or without statistics."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.sources import StreamSource, part_bounds, steps_for_rows
from ray_ddp.data.table_stats import inspect_table
from ray_ddp.data.tables import list_row_groups, row_group_reader
from ray_ddp.data.synth_files import write_synthetic

ROWS = 1003


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream") / "set"
    write_synthetic(str(folder), rows=ROWS, features=3, targets=2, files=3, row_group_rows=50)
    return inspect_table(str(folder), "id", "t0,t1")  # the id column as the input: rows by name


def stream_steps(world, batch, accum):
    return steps_for_rows(ROWS, world * batch * accum)


def sources(table, world, batch, accum, seed=0):
    groups, read = list_row_groups(table), row_group_reader(table)
    steps = stream_steps(world, batch, accum)
    return [StreamSource(groups, read, seed, rank, world, steps, accum) for rank in range(world)]


def epoch_ids(table, world, batch, accum, epoch, seed=0):
    """Per step, per rank: the ids each rank trains on, and the shares it is told."""
    srcs = sources(table, world, batch, accum, seed)
    steps = stream_steps(world, batch, accum)
    seen, shares = [], []
    for step in range(steps):
        per_rank = []
        for src in srcs:
            ids = []
            for micro in range(accum):
                x, y, share = src.micro_batch(epoch, step, micro)
                assert x.shape[1] == 1 and y.shape[1] == 2 and len(x) == len(y)
                ids += x[:, 0].long().tolist()
                shares.append((step, share))
            per_rank.append(ids)
        seen.append(per_rank)
    return seen, shares


def test_row_groups_are_listed_from_metadata(table):
    groups = list_row_groups(table)
    assert sum(rows for _, _, rows in groups) == ROWS
    assert len(groups) == 3 * 7  # 334-row files in row groups of 50: 7 groups each


@pytest.mark.parametrize("world,batch,accum", [(2, 64, 1), (3, 50, 2), (1, 128, 1), (4, 17, 3)])
def test_every_row_once_per_epoch_and_every_rank_takes_the_same_steps(table, world, batch, accum):
    seen, shares = epoch_ids(table, world, batch, accum, epoch=0)
    everything = [i for step in seen for ids in step for i in ids]
    assert sorted(everything) == list(range(ROWS))
    assert len(seen) == stream_steps(world, batch, accum)
    # each step: the share every rank is told is the step's rows over the world size,
    # so the DDP mean of the per-rank losses is the exact mean over the step's rows
    for step, per_rank in enumerate(seen):
        rows = sum(len(ids) for ids in per_rank)
        assert {s for st, s in shares if st == step} == {rows / world}
    # a step's rows are about the global batch: each rank's part cut into as many pieces
    # as the epoch has steps, whatever the world size
    for per_rank in seen:
        assert all(abs(len(ids) - ROWS / world / len(seen)) <= 1 for ids in per_rank)


def test_the_steps_of_an_epoch_do_not_depend_on_the_world_size(table):
    # an elastic run: the same global batch (256) on 1, 2 or 4 workers gives the same
    # steps per epoch, every row once, each micro-batch at most 64 (+1) rows
    for world, accum in [(1, 4), (2, 2), (4, 1)]:
        seen, _ = epoch_ids(table, world, 64, accum, epoch=2)
        assert len(seen) == 4
        assert sorted(i for step in seen for ids in step for i in ids) == list(range(ROWS))


def test_order_is_fixed_by_seed_and_epoch(table):
    first, _ = epoch_ids(table, 2, 64, 1, epoch=0)
    assert epoch_ids(table, 2, 64, 1, epoch=0)[0] == first
    assert epoch_ids(table, 2, 64, 1, epoch=1)[0] != first
    assert epoch_ids(table, 2, 64, 1, epoch=0, seed=5)[0] != first
    # shuffled beyond file order: the first 64 ids are not one run of consecutive rows
    ids = first[0][0]
    assert sorted(ids) != list(range(min(ids), min(ids) + 64))


def test_a_resumed_source_finds_any_step_again(table):
    whole, _ = epoch_ids(table, 2, 64, 1, epoch=3)
    for step in (0, 5, len(whole) - 1):
        fresh = sources(table, 2, 64, 1)
        got = [fresh[r].micro_batch(3, step, 0)[0][:, 0].long().tolist() for r in range(2)]
        assert got == whole[step]


def test_parts_differ_by_at_most_one_row():
    for rows, world in [(1003, 2), (10, 3), (5, 8)]:
        b = part_bounds(rows, world)
        sizes = [b[r + 1] - b[r] for r in range(world)]
        assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1


def test_stream_needs_parquet():
    with pytest.raises(ConfigError, match="--stream reads parquet"):
        TrainConfig(stream=True).validate()


def test_a_hundred_thousand_row_groups_are_placed_in_one_pass_over_them():
    # where each row group starts in an epoch's stream: one linear pass per epoch (counted,
    # not timed: a quadratic placement would look at the groups ~10^10 times), and only
    # the group a micro-batch needs is read
    class CountedGroups(list):
        looked = 0

        def __getitem__(self, i):
            CountedGroups.looked += 1
            return super().__getitem__(i)

    groups = CountedGroups((f"part-{g // 1000:05d}.parquet", g % 1000, 10) for g in range(100_000))
    rows = {}

    def read(path, row_group):
        rows["read"] = rows.get("read", 0) + 1
        return torch.zeros(10, 1), torch.zeros(10, 1)

    src = StreamSource(groups, read, seed=0, rank=1, world=2, steps=62_500, grad_accum=1)
    CountedGroups.looked = 0
    x, _, _ = src.micro_batch(epoch=0, step=0, micro=0)
    assert len(x) == 8 and rows["read"] == 1
    first = CountedGroups.looked
    assert len(groups) <= first <= 2 * len(groups) + 10, first
    src.micro_batch(epoch=0, step=1, micro=0)  # the same epoch: no second pass
    assert CountedGroups.looked - first < 10


# ------------------------------------------------------ start-up reads footers, not columns
def write_groups(path, make_group, groups, statistics=True):
    """A parquet file of ``groups`` row groups, one in memory at a time."""
    first = make_group(0)
    with pq.ParquetWriter(str(path), first.schema, compression="none", use_dictionary=False,
                          write_statistics=statistics) as writer:
        writer.write_table(first)
        for g in range(1, groups):
            writer.write_table(make_group(g))


def make_token_groups(rows, length, vocab, varying=False):
    """A row group of token-id lists (list<int64>, or of lengths varying from ``length``
    up when ``varying``), a struct and a list column before it, so that the parquet leaf
    of the tokens is not the arrow field's position."""
    def make(g):
        rng = np.random.default_rng(g)
        lengths = (length + rng.integers(0, 8, rows) if varying else np.full(rows, length)).astype("int32")
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("int32")
        tokens = pa.ListArray.from_arrays(pa.array(offsets),
                                          pa.array(rng.integers(0, vocab - 1, offsets[-1]) + (g == 4)))
        return pa.table({"meta": pa.StructArray.from_arrays([pa.array(np.full(rows, 10**9)),
                                                            pa.array(np.full(rows, -7))], ["a", "b"]),
                         "ids": pa.array([[10**9]] * rows, type=pa.list_(pa.int64())),
                         "tokens": tokens})
    return make


def make_label_groups(rows, classes):
    """A row group of one float feature and int64 labels (the largest in row group 4),
    after a struct column."""
    def make(g):
        rng = np.random.default_rng(g)
        labels = rng.integers(0, classes - 1, rows) if g != 4 else np.full(rows, classes - 1)
        return pa.table({"meta": pa.StructArray.from_arrays([pa.array(np.full(rows, 100, "int8"))], ["a"]),
                         "f0": pa.array(rng.standard_normal(rows).astype("float32")),
                         "t0": pa.array(labels.astype("int64"))})
    return make


_PEAK_SCRIPT = """
import json, resource, sys
import pyarrow as pa, torch
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.plan import inspect_data
from ray_ddp.data.inputs import build_inputs
from ray_ddp.driver.resolve import resolve

def start(data, **kw):
    # what a --stream run does before its first step: the driver's check, then a worker's source
    cfg = TrainConfig(data=data, stream=True, workers=1, **kw).validate()
    shape = inspect_data(cfg)
    plan = resolve(cfg, shape)
    build_inputs(plan, plan.batch.cut(1), 0, torch.device("cpu"), {})
    return shape

kw = json.loads(sys.argv[3])
start(sys.argv[1], **kw)  # the imports and the first use of everything, on a small file
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
arrow = pa.default_memory_pool().max_memory()
shape = start(sys.argv[2], **kw)
print(json.dumps({"rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss,
                  "arrow_peak": pa.default_memory_pool().max_memory() - arrow,
                  "rows": shape.rows, "classes": shape.num_classes}))
"""


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_a_stream_run_starts_without_holding_its_column_in_memory(tmp_path, task):
    # a column far larger than the start-up's peak memory: with the rows read whole on the
    # driver and again on the worker the peak would be at least the column
    groups = 40
    if task == "lm":  # about 130 tokens a row
        make = make_token_groups(6_000, 128, 50_000, varying=True)
        kw = dict(task="lm", model="gpt", features="tokens", vocab_size=50_000, seq_len=64)
    else:
        make, kw = make_label_groups(800_000, 1000), dict(features="f0", target="t0")
    write_groups(tmp_path / "small.parquet", lambda g: make(g).slice(0, 100), 3)
    write_groups(tmp_path / "big.parquet", make, groups)
    meta = pq.ParquetFile(tmp_path / "big.parquet").metadata
    leaf = meta.num_columns - 1  # the tokens or the labels
    column_bytes = sum(meta.row_group(g).column(leaf).total_uncompressed_size for g in range(groups))
    assert column_bytes > 150 * 2**20
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "small.parquet"),
                          str(tmp_path / "big.parquet"), json.dumps(kw)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows"] == meta.num_rows
    assert got["classes"] == (50_000 if task == "lm" else 1000)
    assert got["arrow_peak"] < column_bytes / 10, got
    assert got["rss_growth"] < column_bytes / 10, got


def read_whole_column(path, column, task):
    """What reading the whole column says: rows, the largest value + 1, the shortest list."""
    col = pads.dataset(str(path), format="parquet").to_table(columns=[column]).column(0)
    if task == "lm":
        return len(col), pc.max(pc.list_flatten(col)).as_py() + 1, pc.min(pc.list_value_length(col)).as_py()
    return len(col), pc.max(col).as_py() + 1, None


@pytest.mark.parametrize("statistics", ["all", "none", "mixed"])
@pytest.mark.parametrize("task", ["lm", "lm-fixed", "classification"])
def test_counts_from_the_footers_match_the_whole_column(tmp_path, task, statistics):
    if task == "classification":
        make, column = make_label_groups(300, 17), "t0"
    else:
        varying = make_token_groups(200, 9, 301, varying=True)

        def fixed(g):
            t = make_token_groups(200, 9, 301)(g)
            return t.set_column(2, "tokens", pa.FixedSizeListArray.from_arrays(
                t.column("tokens").combine_chunks().flatten(), 9))
        make, column = (varying if task == "lm" else fixed), "tokens"
    folder = tmp_path / "set"
    folder.mkdir()
    for k in range(2):  # "mixed": statistics in the first file only (the largest value is in the second)
        write_groups(folder / f"part-{k}.parquet", lambda g, k=k: make(g + 3 * k), 3,
                     statistics=statistics == "all" or (statistics == "mixed" and k == 0))
    rows, count, shortest = read_whole_column(folder, column,
                                               "classification" if task == "classification" else "lm")
    for stream in (False, True):
        if task == "classification":
            table = inspect_table(str(folder), "f0", "t0", stream=stream)
            assert table.task == "classification"
        else:
            table = inspect_table(str(folder), "tokens", None, "lm", stream=stream)
            # --stream takes a length the schema does not fix from the first row
            first = len(make(0).column("tokens")[0]) if stream else shortest
            assert table.input_dim == first
        assert (table.rows, table.num_classes) == (rows, count)


def test_given_counts_stand_in_for_missing_statistics_and_reading_checks_them(tmp_path, monkeypatch):
    import ray_ddp.data.table_stats as datasets

    write_groups(tmp_path / "labels.parquet", make_label_groups(100, 5), 6, statistics=False)
    write_groups(tmp_path / "tokens.parquet", make_token_groups(100, 9, 40), 6, statistics=False)
    unread = []
    monkeypatch.setattr(datasets, "_read_column", lambda *a: unread.append(a))
    labels = inspect_table(str(tmp_path / "labels.parquet"), "f0", "t0", stream=True, num_classes=5)
    tokens = inspect_table(str(tmp_path / "tokens.parquet"), "tokens", None, "lm", stream=True,
                           vocab_size=64)
    assert (labels.num_classes, tokens.num_classes, labels.rows, tokens.rows) == (5, 64, 600, 600)
    assert unread == []  # no row group was read
    monkeypatch.undo()
    # a count too small for the data is refused by the row group that breaks it, in one line
    too_few = inspect_table(str(tmp_path / "labels.parquet"), "f0", "t0", stream=True, num_classes=4)
    read = row_group_reader(too_few)
    with pytest.raises(ConfigError, match="row group 4: class labels must be 0 .. 3, found 4"):
        for path, group, _ in list_row_groups(too_few):
            read(path, group)
    small_vocab = inspect_table(str(tmp_path / "tokens.parquet"), "tokens", None, "lm", stream=True,
                                vocab_size=39)
    with pytest.raises(ConfigError, match="token ids must be 0 .. 38, found 39; raise --vocab-size"):
        for path, group, _ in list_row_groups(small_vocab):
            row_group_reader(small_vocab, seq_len=8)(path, group)


def test_a_stream_refuses_a_sequence_shorter_than_the_first_when_its_row_group_is_read(tmp_path):
    def make(g):  # the first row group's rows have 20 tokens, the second's a row of 6
        lengths = [20] * 10 if g == 0 else [20] * 5 + [6] + [20] * 4
        return pa.table({"tokens": pa.array([list(range(n)) for n in lengths], type=pa.list_(pa.int64()))})
    write_groups(tmp_path / "t.parquet", make, 2)
    streamed = inspect_table(str(tmp_path / "t.parquet"), "tokens", None, "lm", stream=True)
    assert streamed.input_dim == 20
    assert inspect_table(str(tmp_path / "t.parquet"), "tokens", None, "lm").input_dim == 6
    read = row_group_reader(streamed, seq_len=16)
    assert read(str(tmp_path / "t.parquet"), 0)[0].shape == (10, 16)
    with pytest.raises(ConfigError, match="row group 1: a sequence has 6 tokens; --seq-len 16 needs 17"):
        read(str(tmp_path / "t.parquet"), 1)
