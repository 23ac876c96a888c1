"""--stream: row groups read one at a time still give every row once per epoch, in an
order fixed by the seed, with every rank taking the same steps; any step can be found
again after a resume."""

import pytest
import torch

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.data import StreamSource, part_bounds, steps_for_rows
from ray_ddp.datasets import inspect_table, list_row_groups, row_group_reader, write_synthetic

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


def test_a_hundred_thousand_row_groups_are_placed_in_well_under_a_second():
    # where each row group starts in an epoch's stream: linear in the number of groups
    import time

    groups = [(f"part-{g // 1000:05d}.parquet", g % 1000, 10) for g in range(100_000)]
    rows = {}

    def read(path, row_group):
        rows["read"] = rows.get("read", 0) + 1
        return torch.zeros(10, 1), torch.zeros(10, 1)

    src = StreamSource(groups, read, seed=0, rank=1, world=2, steps=62_500, grad_accum=1)
    started = time.perf_counter()
    x, _, _ = src.micro_batch(epoch=0, step=0, micro=0)
    assert time.perf_counter() - started < 1.0 and len(x) == 8 and rows["read"] == 1
