"""A Dataset's random draws (its augmentations) under --loader-workers: they depend on the
run's seed and where the rows fall in the run (rank, epoch, step, micro-batch), never on
what the loader processes read before, nor on how many there are (no Ray; two loader
processes in a few tests, on tiny data sets)."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from ray_ddp.data.loader import LoaderSource
from ray_ddp.data.sources import IndexedSource, steps_for_rows
from ray_ddp.data.user import rows_fetcher

SEED, ROWS, BATCH = 3, 24, 6
STEPS = steps_for_rows(ROWS, BATCH)


class Augmented(Dataset):
    """Item i: (what an augmentation draws from torch, random and numpy, i): the batch
    records the draws."""

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        draws = [torch.rand(()).item(), random.random(), float(np.random.rand())]
        return torch.tensor(draws, dtype=torch.float64), i


def draws(source, epoch, first_step=0):
    """Every draw of the epoch's micro-batches from ``first_step`` on, by (step, micro)."""
    return {(step, micro): source.micro_batch(epoch, step, micro)[0].tolist()
            for step in range(first_step, STEPS) for micro in range(2)}


def loader(workers, rank=0):
    return LoaderSource(Augmented(), SEED, rank, 2, BATCH, 2, workers=workers)


def test_a_resumed_loader_draws_what_a_run_that_never_stopped_draws():
    went_on, resumed, mid_epoch = loader(2), loader(2), loader(2)
    try:
        draws(went_on, 0)
        epoch_1 = draws(went_on, 1)
        assert draws(resumed, 1) == epoch_1  # a run resumed at epoch 1
        tail = draws(mid_epoch, 1, first_step=2)  # a run resumed at epoch 1's step 2
        assert tail == {key: value for key, value in epoch_1.items() if key[0] >= 2}
    finally:
        for source in (went_on, resumed, mid_epoch):
            source.close()


def test_zero_and_two_loader_workers_draw_the_same():
    in_thread = IndexedSource(ROWS, rows_fetcher(Augmented()), SEED, 1, 2, BATCH, 2)  # --loader-workers 0
    loader_0, loader_2 = loader(0, rank=1), loader(2, rank=1)
    try:
        for epoch in (0, 1):
            want = draws(in_thread, epoch)
            assert draws(loader_0, epoch) == want and draws(loader_2, epoch) == want, epoch
        values = [v for batch in want.values() for row in batch for v in row]
        assert len(set(values)) == len(values)  # every draw its own: not one seed reused
    finally:
        loader_0.close()
        loader_2.close()


def test_ranks_and_epochs_draw_differently():
    ranks = [loader(0, rank) for rank in (0, 1)]
    try:
        seen = [v for rank in ranks for epoch in (0, 1) for batch in draws(rank, epoch).values()
                for row in batch for v in row]
        assert len(set(seen)) == len(seen)
    finally:
        for source in ranks:
            source.close()


@pytest.mark.parametrize("workers", [0, None])  # None: the training thread's IndexedSource
def test_draws_in_the_training_thread_leave_its_generators_alone(workers):
    source = loader(0) if workers == 0 else IndexedSource(ROWS, rows_fetcher(Augmented()), SEED, 0, 2, BATCH, 2)
    before = torch.get_rng_state(), random.getstate()
    try:
        draws(source, 0)
        assert torch.equal(torch.get_rng_state(), before[0])  # dropout's draws do not move
        assert random.getstate() == before[1]
    finally:
        source.close()
