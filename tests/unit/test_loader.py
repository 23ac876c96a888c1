"""--loader-workers: a user's Dataset read through torch's DataLoader gives exactly the
rows of IndexedSource (no Ray; num_workers=2 in a few tests, in-process elsewhere)."""

import gc
import multiprocessing

import pytest
import torch
from torch.utils.data import Dataset

from ray_ddp.data.collate import pad_sequences
from ray_ddp.data.inputs import ValSet, split_rows
from ray_ddp.data.loader import LoaderSource, StepBatchSampler, default_loader_workers, loader_val_batches
from ray_ddp.data.sources import IndexedSource, epoch_order, rows_of_step, steps_for_rows
from ray_ddp.data.user import rows_fetcher

SEED = 7


class Rows(Dataset):
    """Item i: (float64 features that name the row, the row's index as an int target);
    ``reads`` counts __getitem__ per row, in shared memory so forked workers count too."""

    def __init__(self, n: int, dim: int = 3):
        self.n, self.dim = n, dim
        self.reads = torch.zeros(n, dtype=torch.int32).share_memory_()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads[i] += 1
        return torch.arange(self.dim, dtype=torch.float64) + 10 * i, i


class Tokens(Dataset):
    """Hugging Face style items: ({input_ids, attention_mask} of varying length, label)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.arange(1 + i % 5) + i
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.tensor(i % 3)


def same(a, b) -> bool:
    """The same structure, and equal tensors of the same dtype and shape."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))
    return a == b


def every_micro(steps, grad_accum, first=0):
    return [(s, m) for s in range(first, steps) for m in range(grad_accum)]


def assert_same_as_indexed(dataset, world, grad_accum, global_batch, workers=0, collate=None,
                           epochs=(0, 1)):
    steps = steps_for_rows(len(dataset), global_batch)
    for rank in range(world):
        ref = IndexedSource(len(dataset), rows_fetcher(dataset, collate), SEED, rank, world,
                            global_batch, grad_accum)
        src = LoaderSource(dataset, SEED, rank, world, global_batch, grad_accum, collate=collate,
                           workers=workers)
        for epoch in epochs:
            for step, micro in every_micro(steps, grad_accum):
                got, want = src.micro_batch(epoch, step, micro), ref.micro_batch(epoch, step, micro)
                assert same(got, want), (rank, epoch, step, micro)
        assert src.restarts == 0
        src.close()


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_same_batches_as_indexed_source(world, grad_accum):
    # 23 rows in global batches of 6: 4 steps, the last of 5 rows (empty parts at 3 x 2)
    assert_same_as_indexed(Rows(23), world, grad_accum, global_batch=6)


def test_same_batches_with_worker_processes_across_epochs():
    assert_same_as_indexed(Rows(23), world=2, grad_accum=2, global_batch=6, workers=2, epochs=(0, 1, 2))


def test_dict_items_with_a_custom_collate():
    assert_same_as_indexed(Tokens(17), world=3, grad_accum=2, global_batch=5, collate=pad_sequences)


@pytest.mark.parametrize("world, grad_accum", [(1, 1), (2, 2), (3, 1), (3, 2)])
def test_each_row_once_per_epoch_across_ranks(world, grad_accum):
    ds, global_batch = Rows(29), 8
    steps = steps_for_rows(len(ds), global_batch)
    for epoch in (0, 1):
        seen = []
        for rank in range(world):
            src = LoaderSource(ds, SEED, rank, world, global_batch, grad_accum)
            for step, micro in every_micro(steps, grad_accum):
                x, y, share = src.micro_batch(epoch, step, micro)
                assert x.dtype == torch.float32 and torch.equal(x[:, 0], 10 * y.float())
                assert share == min(global_batch, len(ds) - step * global_batch) / world
                seen += y.tolist()
        assert sorted(seen) == list(range(len(ds)))


def rows_of_rank(n, epoch, steps, rank, world, global_batch, grad_accum):
    order = epoch_order(n, SEED, epoch)
    return {int(i) for step, micro in every_micro(steps, grad_accum)
            for i in rows_of_step(order, step, rank, micro, world, global_batch, grad_accum)[0]}


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_reads_no_skipped_row(workers):
    n, world, rank, global_batch, grad_accum, k, epoch = 40, 2, 1, 8, 2, 3, 1
    steps = steps_for_rows(n, global_batch)
    ds = Rows(n)
    whole = LoaderSource(Rows(n), SEED, rank, world, global_batch, grad_accum)
    resumed = LoaderSource(ds, SEED, rank, world, global_batch, grad_accum, workers=workers)
    for step, micro in every_micro(steps, grad_accum, first=k):  # the first call is at step k
        assert same(resumed.micro_batch(epoch, step, micro), whole.micro_batch(epoch, step, micro))
    assert resumed.restarts == 0
    later = rows_of_rank(n, epoch, steps, rank, world, global_batch, grad_accum) - \
        rows_of_rank(n, epoch, k, rank, world, global_batch, grad_accum)
    reads = ds.reads.tolist()
    assert {i for i in range(n) if reads[i]} == later and {reads[i] for i in later} == {1}
    resumed.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_jump_restarts_the_iteration_rather_than_give_wrong_rows(workers):
    ds, world, rank, global_batch, grad_accum = Rows(30), 2, 0, 6, 2
    ref = IndexedSource(len(ds), rows_fetcher(ds), SEED, rank, world, global_batch, grad_accum)
    src = LoaderSource(ds, SEED, rank, world, global_batch, grad_accum, workers=workers)
    asks = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 3, 1), (0, 4, 0), (0, 0, 0),  # skip, jump back
            (1, 2, 0), (1, 2, 1), (0, 2, 0), (1, 0, 0)]  # another epoch, then back, then on
    for key in asks:
        assert same(src.micro_batch(*key), ref.micro_batch(*key)), key
    assert src.restarts == 5  # every ask but the first that is not the next one
    src.close()


class FailsOnce(Rows):
    """Rows whose first read of ``row`` raises (a flag in shared memory, for workers too)."""

    def __init__(self, n, row):
        super().__init__(n)
        self.row, self.failed = row, torch.zeros(1, dtype=torch.int32).share_memory_()

    def __getitem__(self, i):
        if i == self.row and not self.failed[0]:
            self.failed[0] = 1
            raise OSError("a flaky read")
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_after_a_datasets_error_the_next_call_gets_its_own_rows(workers):
    order = epoch_order(24, SEED, 0)
    ds = FailsOnce(24, int(rows_of_step(order, 1, 0, 0, 1, 6, 1)[0][0]))  # a row of step 1
    ref = IndexedSource(24, rows_fetcher(Rows(24)), SEED, 0, 1, 6, 1)
    src = LoaderSource(ds, SEED, 0, 1, 6, 1, workers=workers)
    assert same(src.micro_batch(0, 0, 0), ref.micro_batch(0, 0, 0))
    with pytest.raises(OSError, match="a flaky read"):
        src.micro_batch(0, 1, 0)
    for step in (1, 2, 3):  # step 1 again (the loader alone would have gone on to step 2)
        assert same(src.micro_batch(0, step, 0), ref.micro_batch(0, step, 0))
    src.close()


def test_a_datasets_error_leaves_no_loader_process_to_the_garbage_collector():
    # the error must not keep the loader's iteration in a reference cycle: one ended by the
    # garbage collector sends its processes no stop signal (5 s of waiting for each)
    gc.disable()
    try:
        before = set(multiprocessing.active_children())
        ds = FailsOnce(24, int(rows_of_step(epoch_order(24, SEED, 0), 1, 0, 0, 1, 6, 1)[0][0]))
        src = LoaderSource(ds, SEED, 0, 1, 6, 1, workers=2)
        src.micro_batch(0, 0, 0)
        with pytest.raises(OSError, match="a flaky read") as caught:
            src.micro_batch(0, 1, 0)
        assert "DataLoader worker process" in str(caught.value)  # where it came from, still said
        src.close()
        assert set(multiprocessing.active_children()) <= before, "close() left loader processes running"
    finally:
        gc.enable()


def test_steps_past_the_samplers_are_fetched_in_thread():
    ds = Rows(30)
    ref = IndexedSource(len(ds), rows_fetcher(ds), SEED, 0, 1, 6, 1)
    src = LoaderSource(ds, SEED, 0, 1, 6, 1, steps=2)  # the run's --steps-per-epoch below the data's
    for step in range(5):
        assert same(src.micro_batch(0, step, 0), ref.micro_batch(0, step, 0))


@pytest.mark.parametrize("dataset, collate", [(Rows(13), None), (Tokens(13), pad_sequences)])
def test_an_empty_last_share_is_an_empty_batch_of_the_right_structure(dataset, collate):
    # 13 rows in global batches of 6: the last step has 1 row, so ranks 1 and 2 get none
    src = LoaderSource(dataset, SEED, 2, 3, 6, 1, collate=collate)
    full_x, full_y, _ = src.micro_batch(0, 0, 0)
    x, y, share = src.micro_batch(0, 2, 0)
    assert share == 1 / 3 and len(y) == 0 and y.dtype == full_y.dtype
    if collate is None:
        assert x.shape == (0, 3) and x.dtype == torch.float32 == full_x.dtype
    else:
        assert x.keys() == full_x.keys() and all(len(v) == 0 for v in x.values())
    ref = IndexedSource(len(dataset), rows_fetcher(dataset, collate), SEED, 2, 3, 6, 1)
    assert same((x, y, share), ref.micro_batch(0, 2, 0))


def test_index_map_matches_the_val_fraction_subset():
    ds = Rows(37)
    train_idx, _ = split_rows(len(ds), 0.25, SEED)
    fetch = rows_fetcher(ds)
    world, global_batch, grad_accum = 2, 7, 2
    steps = steps_for_rows(len(train_idx), global_batch)
    for rank in range(world):
        ref = IndexedSource(len(train_idx), lambda idx: fetch(train_idx[idx]), SEED, rank, world,
                            global_batch, grad_accum)
        src = LoaderSource(ds, SEED, rank, world, global_batch, grad_accum, index_map=train_idx)
        for step, micro in every_micro(steps, grad_accum):
            got = src.micro_batch(0, step, micro)
            assert same(got, ref.micro_batch(0, step, micro))
            assert set(got[1].tolist()) <= set(train_idx.tolist())


def test_sampler_skips_empty_parts_and_starts_where_asked():
    sampler = StepBatchSampler(13, SEED, 1, 3, 6, 1, steps=3)
    order = epoch_order(13, SEED, 0)
    want = [rows_of_step(order, s, 1, 0, 3, 6, 1)[0].tolist() for s in range(3)]
    assert list(sampler) == want[:2] and len(sampler) == 2 and want[2] == []
    sampler.start(0, 1)
    assert list(sampler) == want[1:2]
    index_map = torch.arange(100, 113)
    mapped = StepBatchSampler(13, SEED, 1, 3, 6, 1, steps=3, index_map=index_map)
    assert list(mapped) == [[100 + i for i in rows] for rows in want[:2]]


@pytest.mark.parametrize("workers", [0, 2])
def test_val_batches_match_direct_collation(workers):
    ds = Tokens(20)
    _, val_idx = split_rows(len(ds), 0.5, SEED)  # 10 rows: parts of 4, 3, 3
    lists = []
    for rank in range(3):  # equal counts: the shorter parts end with an empty batch
        list(ValSet(len(val_idx), lambda idx: lists.append(idx) or (None, None)).batches(rank, 3, 3, True))
    assert any(len(idx) == 0 for idx in lists)
    fetch = rows_fetcher(ds, pad_sequences)
    got = list(loader_val_batches(ds, lists, pad_sequences, workers=workers, index_map=val_idx))
    assert len(got) == len(lists)
    for batch, idx in zip(got, lists):
        assert same(batch, fetch(val_idx[idx]))


def test_val_batches_of_only_empty_lists():
    ds = Rows(5)
    got = list(loader_val_batches(ds, [torch.arange(0)], None, workers=2))
    assert got[0][0].shape == (0, 3) and ds.reads.sum() == 1  # row 0, for the structure only


def test_reading_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    src = LoaderSource(Rows(20), SEED, 0, 1, 5, 1)
    for step in range(4):
        src.micro_batch(0, step, 0)
    assert torch.equal(torch.get_rng_state(), state)


def test_default_loader_workers():
    assert [default_loader_workers(c) for c in (0, 1, 2, 4, 9, 64)] == [0, 0, 1, 3, 8, 8]


class Augmented(Dataset):
    """Item i: (a random draw, as an augmentation makes one, i)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.rand(1, dtype=torch.float64), i


def draws(source, epoch, steps=2):
    return [round(v, 6) for s in range(steps) for v in source.micro_batch(epoch, s, 0)[0].flatten().tolist()]


def test_loader_processes_draw_differently_on_each_rank_in_each_epoch_and_after_a_resume():
    ranks = [LoaderSource(Augmented(), SEED, rank, 2, 16, 1, workers=2) for rank in (0, 1)]
    try:
        first = [draws(source, 1) for source in ranks]
        assert not set(first[0]) & set(first[1]), "rank 1 repeats rank 0's augmentations"
        assert not set(draws(ranks[0], 2)) & set(first[0]), "epoch 2 repeats epoch 1's"
        again = LoaderSource(Augmented(), SEED, 0, 2, 16, 1, workers=2)  # the same run, once more
        try:
            assert draws(again, 1) == first[0]  # the same seed, the same draws
        finally:
            again.close()
    finally:
        for source in ranks:
            source.close()


def test_close_stops_the_loader_processes_and_a_later_call_begins_again():
    import multiprocessing

    before = set(multiprocessing.active_children())
    src = LoaderSource(Rows(64), SEED, 0, 1, 16, 1, workers=2)
    want = src.micro_batch(0, 1, 0)
    assert len(set(multiprocessing.active_children()) - before) == 2
    src.close()
    assert not set(multiprocessing.active_children()) - before  # stopped, not left to exit
    assert same(src.micro_batch(0, 1, 0), want)
    src.close()
    assert not set(multiprocessing.active_children()) - before
