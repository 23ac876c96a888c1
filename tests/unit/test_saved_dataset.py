"""--data DIR of a datasets save_to_disk folder, without Ray: its rows read by pyarrow as
the datasets.Dataset gave them, pickled to workers without the table, and the folder
kinds that are one line (a DatasetDict's, with --stream)."""

from __future__ import annotations

import pickle

import pytest

from ray_ddp import ConfigError, TrainConfig
from ray_ddp.data.saved import SavedDataset, open_saved_datasets, saved_dataset_kind
from ray_ddp.data.user import collate_items


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import datasets

    from hf_data import sentiment_rows

    root = tmp_path_factory.mktemp("saved")
    rows = sentiment_rows(40, seed=0)
    rows.save_to_disk(str(root / "train"))
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(root / "splits"))
    return root, rows


def test_a_saved_split_reads_the_rows_the_dataset_held(saved):
    root, rows = saved
    ds = SavedDataset(str(root / "train"))
    assert len(ds) == len(rows) and all(ds[i] == rows[i] for i in (0, 17, 39))
    with pytest.raises(IndexError):
        ds[40]
    shipped = pickle.loads(pickle.dumps(ds))  # to a worker: the path, not the table
    assert shipped._table is None and shipped[5] == rows[5]
    x, y = collate_items([ds[0]], None)
    assert set(x) == {"input_ids", "attention_mask", "labels"} and y is x["labels"]  # `label` made `labels`


def test_a_micro_batch_is_read_in_one_call_where_the_dataset_can(saved):
    import torch

    from ray_ddp.data.user import rows_fetcher

    root, rows = saved
    ds = SavedDataset(str(root / "train"))
    assert ds.__getitems__([17, 3, 17]) == [rows[17], rows[3], rows[17]]  # in the order asked
    with pytest.raises(IndexError):
        ds.__getitems__([3, 40])

    class Counted(SavedDataset):  # counts how it is asked
        calls: list = []

        def __getitem__(self, i):
            self.calls.append("one")
            return super().__getitem__(i)

        def __getitems__(self, indices):
            self.calls.append("many")
            return super().__getitems__(indices)

    counted = Counted(str(root / "train"))
    fetch = rows_fetcher(counted, lambda items: {"n": torch.tensor([len(items)])})
    x, _ = fetch(torch.tensor([4, 9, 2]))
    assert counted.calls == ["many"] and int(x["n"]) == 3
    plain = [rows[i] for i in range(len(rows))]  # a list has no __getitems__: one by one
    seen = []
    rows_fetcher(plain, lambda items: seen.append(items) or {"n": torch.tensor([len(items)])})(torch.tensor([4, 9]))
    assert seen == [[rows[4], rows[9]]]


def test_data_dir_becomes_train_data_rows_and_the_rest_is_one_line(saved, tmp_path):
    root, _ = saved
    cfg, train, val = open_saved_datasets(TrainConfig(data=str(root / "train"), val_data=str(root / "train")),
                                          None, None)
    assert isinstance(train, SavedDataset) and isinstance(val, SavedDataset)
    assert (cfg.data, cfg.val_data) == (str(root / "train"), str(root / "train"))  # what the config records
    assert saved_dataset_kind(str(root / "splits")) == "dict" and saved_dataset_kind(str(tmp_path)) is None
    with pytest.raises(ConfigError, match=r"^--data .*splits is a DatasetDict's folder of splits train, test: "
                                          r"give one split's folder, e.g. --data .*splits/train$"):
        open_saved_datasets(TrainConfig(data=str(root / "splits")), None, None)
    with pytest.raises(ConfigError, match=r"save_to_disk folder, read as memory-mapped rows; --stream reads "
                                          r"parquet: drop --stream"):
        open_saved_datasets(TrainConfig(data=str(root / "train"), stream=True), None, None)
