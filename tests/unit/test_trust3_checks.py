"""The driver checks the batch the workers will train on, and decides as the workers do
(issue 56, items 5-7): labels a collator adds make the model's own loss the objective, a
collate that fails on the rows is one line; a model whose forward takes no ``labels`` is
checked against the task's loss, as the worker trains it, and one that raises on the
example batch is one line; a label outside the model's outputs is named with its limit,
on the driver (the example batch) and on the worker (the host copy, before the loss).
No Ray: check_run stops before it, and tiny models are built from configs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ray_ddp.config.train import TrainConfig
from ray_ddp.driver.run import check_run
from ray_ddp.errors import BatchError, ConfigError
from ray_ddp.models.build import check_output_shape
from ray_ddp.tasks import build as tasks  # (uses_model_loss, class_count_of: read at each test)
from ray_ddp.tasks.build import build_task
from ray_ddp.tasks.own_loss import ModelLossTask
from ray_ddp.driver.resolve import resolve

transformers = pytest.importorskip("transformers")

from hf_data import bert, gpt2, tokenizer  # noqa: E402  (after the skip: they build transformers objects)

HERE = __name__  # this module, as --model / --loss / --collate name its functions


def ragged_ids(rows: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 30, (n,), generator=g).tolist()} for n in (5, 7, 6, 8, 5, 9, 6, 7)[:rows]]


def check(tmp_path, objects: dict, **cfg):
    """check_run as run() calls it: everything the driver decides before Ray starts."""
    return check_run(TrainConfig(storage=str(tmp_path), name="t3", workers=1, **cfg), objects)


# -- item 5: the driver looks at the collated batch ------------------------------------

def test_labels_a_collator_adds_make_the_models_own_loss_the_objective(tmp_path):
    collate = transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    _, shape, _ = check(tmp_path, {"model": gpt2, "train_data": ragged_ids(), "collate": collate})
    assert shape.hands_labels and shape.unlabeled_keys is None and shape.task == "lm"
    x, y = shape.example
    assert sorted(x) == ["attention_mask", "input_ids", "labels"] and y is x["labels"]
    assert x["input_ids"].shape == (2, 7) and (x["labels"][0, 5:] == -100).all()  # padded: two rows, not one twice


def add_labels(items):
    """A --collate that pads nothing and adds a label per row (the rows hold none)."""
    ids = torch.stack([torch.as_tensor(i["input_ids"][:4]) for i in items])
    return {"input_ids": ids, "labels": ids[:, 0] % 3}


def test_a_collate_named_by_path_decides_the_labels_too(tmp_path):
    _, shape, _ = check(tmp_path, {"train_data": ragged_ids()}, model=f"{HERE}:tagger", collate=f"{HERE}:add_labels",
                        loss=f"{HERE}:token_ce")
    assert shape.hands_labels and shape.task == "classification"


def test_a_collate_that_fails_on_the_rows_is_one_line_before_ray(tmp_path):
    rows = [{"text": "good film", "input_ids": [5, 6]}, {"text": "bad plot, bad acting", "input_ids": [7, 8, 9, 7]}]
    collate = transformers.DataCollatorWithPadding(tokenizer())
    with pytest.raises(ConfigError, match=r"^collate= raised ValueError on the first two training rows: "
                                          r".*text") as info:
        check(tmp_path, {"model": gpt2, "train_data": rows, "collate": collate})
    assert "\n" not in str(info.value) and "remove_columns" in str(info.value)


# -- item 6: the driver decides as the worker does --------------------------------------

class Tagger(nn.Module):
    """A token tagger whose forward takes no labels: the task's (or the given) loss trains it."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(32, 8), nn.Linear(8, 32)

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.emb(input_ids))


def tagger():
    return Tagger()


def token_ce(output, target):
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100)


@pytest.mark.parametrize("loss", [None, f"{HERE}:token_ce"])
def test_a_model_given_by_path_whose_forward_takes_no_labels_is_checked_as_the_worker_trains_it(tmp_path, loss):
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 32, (6,), generator=g), "labels": torch.randint(0, 32, (6,), generator=g)}
            for _ in range(8)]
    _, shape, _ = check(tmp_path, {"train_data": rows}, model=f"{HERE}:tagger", loss=loss)
    assert shape.hands_labels
    # one rule on both sides: the worker's task is the lm task's (or the given) loss
    assert not tasks.uses_model_loss(Tagger(), hands_labels=True, has_loss=loss is not None)
    assert not isinstance(build_task("lm", 6, model=Tagger(), model_loss=True), ModelLossTask)
    assert isinstance(build_task("lm", 6, model=gpt2(1), model_loss=True), ModelLossTask)


class CallsWrongly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x, x)  # TypeError on any device


class NeedsData(nn.Module):
    """Code that needs the values (a numpy round trip, .item()): the meta device cannot run
    it, so the worker's first step checks it."""

    def __init__(self, how: str):
        super().__init__()
        self.lin, self.how = nn.Linear(3, 2), how

    def forward(self, x):
        out = self.lin(x)
        if self.how == "numpy":
            return out * float(out.detach().numpy().max())
        return out * out.sum().item()


def test_a_model_that_raises_on_the_example_batch_is_one_line_naming_it():
    example = (torch.randn(2, 3), torch.randn(2, 2))
    with torch.device("meta"):
        model = CallsWrongly()
    with pytest.raises(ConfigError, match=r"^model 'pkg:wrong' raised TypeError on the first training rows: "
                                          r".*takes 2 positional arguments but 3 were given") as info:
        check_output_shape(resolve(TrainConfig(model="pkg:wrong"), None), model, example)
    assert "\n" not in str(info.value)
    for how in ("numpy", "item"):  # what only the meta device cannot run is left to the worker
        with torch.device("meta"):
            model = NeedsData(how)
        check_output_shape(resolve(TrainConfig(model="pkg:data"), None), model, example)


# -- item 7: labels outside the model's outputs ----------------------------------------

def labelled(labels, length: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(4, 60, (length,), generator=g), "label": label} for label in labels]


@pytest.mark.parametrize("given", ["function", "object"])
def test_the_driver_names_a_label_outside_a_classifiers_outputs(tmp_path, given):
    model, name = (bert, "bert") if given == "function" else (bert(), "BertForSequenceClassification")
    rows = labelled([5, 1, 2, 0, 4, 1])  # num_labels=3
    with pytest.raises(ConfigError, match=rf"^model 'python:{name}': label 5 is out of range for a model with 3 "
                                          r"outputs \(labels must be in \[0, 3\) or -100\): ") as info:
        check(tmp_path, {"model": model, "train_data": rows})
    assert "\n" not in str(info.value) and "num_labels" in str(info.value)
    check(tmp_path, {"model": model, "train_data": labelled([2, 1, 0, 0])})  # in range: accepted


def test_the_driver_names_a_label_outside_a_built_in_models_classes(tmp_path):
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(6, 4), torch.tensor([-1, 0, 1, 2, 1, 0]))
    with pytest.raises(ConfigError, match=r"label -1 is out of range for a model with 3 outputs"):
        check(tmp_path, {"train_data": data}, model="mlp", num_classes=3)


def test_the_worker_checks_labels_on_the_host_copy_before_the_loss():
    model = bert()
    assert tasks.class_count_of(model) == 3 and tasks.class_count_of(gpt2(1)) is None
    task = build_task("classification", model=model, model_loss=True)
    ids = torch.randint(4, 60, (3, 5))
    with pytest.raises(BatchError, match=r"^label 4 is out of range for a model with 3 outputs "
                                         r"\(labels must be in \[0, 3\) or -100\): "):
        task.check_batch({"input_ids": ids, "labels": torch.tensor([0, 4, 1])}, torch.tensor([0, 4, 1]))
    task.check_batch({"input_ids": ids, "labels": torch.tensor([0, -100, 2])}, torch.tensor([0, -100, 2]))
    # the built-in classification task: its outputs from the logits (no device wait on the CPU)
    builtin = build_task("classification")
    with pytest.raises(BatchError, match=r"^label 4 is out of range for a model with 3 outputs"):
        builtin.sums(torch.randn(2, 3), torch.tensor([0, 4]))
    builtin.sums(torch.randn(2, 3), torch.tensor([0, 2]))  # learned: the host copies are checked from here
    with pytest.raises(BatchError, match=r"^label 3 is out of range"):
        builtin.check_batch(torch.randn(2, 4), torch.tensor([3, 0]))
    build_task("classification", loss=token_ce).check_batch(torch.randn(2, 4), torch.tensor([9, 0]))  # the loss decides
