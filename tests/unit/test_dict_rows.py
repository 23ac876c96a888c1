"""Rows as Hugging Face users hold them, without Ray: a `datasets.Dataset` of dict rows
(with and without `with_format("torch")`), a list of dicts, `label` read as `labels`,
a tokenizer's DataCollatorWithPadding as the collate object, the driver's plan of such
data, and the one-line refusals (a DatasetDict, rows with nothing to learn from)."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.config.train import TrainConfig
from ray_ddp.data.plan import check_row_targets, inspect_data
from ray_ddp.data.user import check_dataset, rows_fetcher
from ray_ddp.errors import ConfigError

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

ROWS = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [5, 6, 7]},
        {"input_ids": [8, 9, 10], "attention_mask": [1, 1, 0], "labels": [8, 9, -100]}]


def tokenizer():
    """A word-level fast tokenizer built in memory (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate("good bad film plot acting".split())}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


@pytest.mark.parametrize("form", ["list", "dataset", "torch-format"])
def test_dict_rows_batch_as_one_dict_whose_labels_are_the_target(form):
    data = {"list": ROWS, "dataset": datasets.Dataset.from_list(ROWS),
            "torch-format": datasets.Dataset.from_list(ROWS).with_format("torch")}[form]
    assert check_dataset(data, "train_data=") is data
    x, y = rows_fetcher(data)(torch.tensor([1, 0]))
    assert type(x) is dict and set(x) == {"input_ids", "attention_mask", "labels"}
    assert x["input_ids"].tolist() == [[8, 9, 10], [5, 6, 7]] and y is x["labels"]
    empty_x, empty_y = rows_fetcher(data)(torch.tensor([], dtype=torch.long))  # a rank's empty share
    assert empty_x["input_ids"].shape == (0, 3) and empty_y.shape == (0, 3)


def test_a_label_column_is_read_as_labels_and_the_plan_sees_a_classifier():
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6]], "label": [0, 2, 1]})
    shape = inspect_data(TrainConfig(model="pkg.mod:model"), rows)
    assert shape.task == "classification" and shape.rows == 3 and shape.hands_labels
    x, y = rows_fetcher(rows)(torch.tensor([0, 1]))
    assert "label" not in x and y.tolist() == [0, 2]


def test_a_tokenizers_collator_object_pads_the_rows_it_is_given():
    tok = tokenizer()
    text = ["good film", "bad acting bad plot", "good"]
    rows = datasets.Dataset.from_dict({**tok(text), "label": [1, 0, 1]})  # ragged: lists of ids
    collate = transformers.DataCollatorWithPadding(tok)
    x, y = rows_fetcher(rows, collate)(torch.tensor([0, 1, 2]))
    assert type(x) is dict  # not the collator's BatchEncoding: moved to the device like any dict
    assert x["input_ids"].shape == (3, 4) and x["attention_mask"].sum(1).tolist() == [2, 4, 1]
    assert y.tolist() == [1, 0, 1] and y is x["labels"]


def test_a_datasetdict_names_its_splits():
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                   "test": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(ConfigError, match=r"^train_data= is a DatasetDict of splits \['test', 'train'\]: "
                                          r"give one split, e.g. train_data=dataset\['train'\]$"):
        check_dataset(splits, "train_data=")


def test_rows_without_labels_need_a_loss():
    rows = [{"x": [1.0, 2.0]}, {"x": [3.0, 4.0]}]
    shape = inspect_data(TrainConfig(model="pkg.mod:model"), rows)
    with pytest.raises(ConfigError, match=r"^the training rows have no 'labels' \(keys: x\): add a labels "):
        check_row_targets(shape, has_loss=False)
    check_row_targets(shape, has_loss=True)  # the loss gets the output and the rows
    x, y = rows_fetcher(rows)(torch.tensor([0, 1]))
    assert y is x and x["x"].shape == (2, 2)


def test_anything_else_is_one_line():
    with pytest.raises(ConfigError, match=r"^train_data=: items must be \(input, target\) pairs or dict rows, not str$"):
        check_dataset(["a", "b"], "train_data=")
