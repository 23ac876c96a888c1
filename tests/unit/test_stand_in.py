"""Every training source gives a stand-in row (data/sources.py ``Source.stand_in``): what
a rank runs, times 0, in place of a micro-batch with no rows when it has trained on none
yet (worker/step.py). It has the structure of a micro-batch of one real row. No Ray."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from ray_ddp.data.loader import LoaderSource
from ray_ddp.data.sources import IndexedSource, StreamSource, tensor_fetcher
from ray_ddp.data.synth import SyntheticSource, teacher_weights


def _is_one_row_like(row, batch):
    (x, y), (bx, by) = row, batch[:2]
    return x.shape[1:] == bx.shape[1:] and y.shape[1:] == by.shape[1:] and len(x) == len(y) == 1 \
        and x.dtype == bx.dtype and y.dtype == by.dtype


def test_each_source_gives_one_real_row_even_where_its_own_part_is_empty():
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    # 3 rows, 4 ranks, a global batch of 4: rank 3's part of step 0 is empty
    indexed = IndexedSource(3, tensor_fetcher(x, y), 0, 3, 4, 4, 1)
    assert len(indexed.micro_batch(0, 0, 0)[1]) == 0
    assert torch.equal(indexed.stand_in()[0], x[:1]) and _is_one_row_like(indexed.stand_in(), (x, y))

    loader = LoaderSource(TensorDataset(x, y), 0, 3, 4, 4, 1)
    assert len(loader.micro_batch(0, 0, 0)[1]) == 0
    assert torch.equal(loader.stand_in()[0], x[:1]) and _is_one_row_like(loader.stand_in(), (x, y))
    loader.close()

    stream = StreamSource([("a", 0, 3)], lambda path, group: (x, y), 0, 0, 4, 1, 1)  # rank 0: none of 3
    assert len(stream.micro_batch(0, 0, 0)[1]) == 0
    assert _is_one_row_like(stream.stand_in(), (x, y))

    synthetic = SyntheticSource(teacher_weights(0, 4, 2), 0, 0, 2, 8, 1)
    assert _is_one_row_like(synthetic.stand_in(), synthetic.micro_batch(0, 0, 0))
