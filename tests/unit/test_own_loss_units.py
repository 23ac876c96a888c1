"""A model's own loss, weighted by what it is a mean over, is exact over any cut of the
global batch: the field's heads (causal, encoder-decoder, masked, token, row-wise, a
PreTrainedModel that names no loss type) against the single-process reference, the
model's own loss over the whole batch. Tiny models from configs, no Ray."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.tasks.batches import forward
from ray_ddp.tasks.build import build_task, loss_units_of
from ray_ddp.driver.resolve import resolve

transformers = pytest.importorskip("transformers")

from hf_tiny import UNITS, VOCAB, tiny  # noqa: E402  (after the skip: it builds transformers models)
from hf_tiny import rows as batch  # noqa: E402


def own_loss(model, x) -> float:
    with torch.no_grad():
        return forward(model, x).loss.item()


def weighted_mean(model, task, micro_batches) -> float:
    """What the loop computes: each micro-batch's loss sum over the step's units."""
    total = sum(task.count_units(x, x["labels"]) for x in micro_batches)
    with torch.no_grad():
        return sum(task.sums(forward(model, x), x["labels"], x)["loss"].item() for x in micro_batches) / total


CASES = {k: v for k, v in UNITS.items() if k in ("gpt2", "t5", "bart", "masked", "token", "rows", "choice")}


@pytest.mark.parametrize("kind", CASES)
def test_the_weighted_micro_batches_give_the_models_loss_over_the_whole_batch(kind):
    model = tiny(kind)
    assert loss_units_of(model) == CASES[kind]
    x = batch(kind)
    task = build_task("lm" if kind in ("gpt2", "t5", "bart", "masked") else "classification", 8,
                      model=model, model_loss=True)
    reference = own_loss(model, x)
    for cut in ([2, 2, 2], [1, 5], [1] * 6):  # micro-batches of any size, 1-row ones included
        parts, start = [], 0
        for size in cut:
            parts.append({k: v[start:start + size] for k, v in x.items()})
            start += size
        assert weighted_mean(model, task, parts) == pytest.approx(reference, rel=1e-5), cut


def test_a_t5_on_rows_padded_by_datacollatorforseq2seq_is_exact_over_micro_batches():
    """docs/huggingface.md's seq2seq example, as the worker meets it: ragged
    (source, target) rows from a datasets.Dataset, padded by the collator object (the
    targets with -100), each micro-batch padded on its own, weighted to the T5's own loss
    over the whole batch."""
    datasets = pytest.importorskip("datasets")
    from hf_data import tokenizer

    from ray_ddp.data.user import rows_fetcher

    sources = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]  # token ids, as a tokenizer's map leaves them
    targets = [[11], [12, 13, 14], [15, 16], [17]]     # 1 to 3 label tokens a row
    rows = datasets.Dataset.from_dict({"input_ids": sources, "labels": targets})
    fetch = rows_fetcher(rows, transformers.DataCollatorForSeq2Seq(tokenizer()))
    whole, _ = fetch(torch.arange(4))
    assert (whole["labels"] == -100).sum().item() == 3 * 4 - 7  # padded to the longest target: 7 are real
    model = tiny("t5")
    task = build_task("lm", 8, model=model, model_loss=True)
    parts = [fetch(torch.tensor([0, 1]))[0], fetch(torch.tensor([2]))[0], fetch(torch.tensor([3]))[0]]
    assert weighted_mean(model, task, parts) == pytest.approx(own_loss(model, whole), rel=1e-5)


def test_a_pretrained_model_that_names_no_loss_type_is_weighted_by_its_labels_shape():
    class OwnModel(transformers.PreTrainedModel):  # a user's own, no head in its name
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x, labels=None):
            logits = self.linear(x)
            return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}

    model = OwnModel(transformers.PretrainedConfig())
    assert loss_units_of(model) is None
    task = build_task("classification", model=model, model_loss=True)
    one_row = {"x": torch.randn(1, 4), "labels": torch.tensor([2])}
    assert task.count_units(one_row, one_row["labels"]) == 1.0  # a row, never 0 "shifted tokens"


class SequenceModel(transformers.PreTrainedModel):
    """A user's own, no head in its name, no loss_type, and a label per token: is its loss
    a mean over every label token, or over those after each row's first (shifted)?"""
    config_class = transformers.PretrainedConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(VOCAB, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.embed(input_ids)
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))}


def test_a_model_whose_reduction_over_sequence_labels_cannot_be_known_is_refused_in_one_line():
    from ray_ddp.config.train import TrainConfig
    from ray_ddp.errors import BatchError, ConfigError
    from ray_ddp.models.build import check_output_shape

    model = SequenceModel(transformers.PretrainedConfig())
    ids = torch.randint(1, VOCAB, (2, 8))
    x = {"input_ids": ids, "labels": ids}
    task = build_task("lm", 8, model=model, model_loss=True)
    with pytest.raises(BatchError, match=r"model SequenceModel .* cannot be known.*loss_type.*--loss"):
        task.count_units(x, ids)
    # on the driver, before any worker starts: the model built on the meta device, run on
    # the data's first batch
    with torch.device("meta"):
        meta_model = SequenceModel(transformers.PretrainedConfig())
    with pytest.raises(ConfigError, match=r"model 'user:seq' .*loss_type.*--loss") as info:
        check_output_shape(resolve(TrainConfig(model="user:seq", task="lm", seq_len=8), None), meta_model, (x, ids))
    assert "\n" not in str(info.value)
    # the ways out: say what it shifts, or compute the loss yourself
    check_output_shape(resolve(TrainConfig(model="user:seq", task="lm", seq_len=8, loss="m:f"), None), meta_model, (x, ids))
    for m in (model, meta_model):
        m.loss_type = "ForCausalLM"
    assert build_task("lm", 8, model=model, model_loss=True).count_units(x, ids) == 2 * 7
    check_output_shape(resolve(TrainConfig(model="user:seq", task="lm", seq_len=8), None), meta_model, (x, ids))


def test_float_labels_count_every_element_and_an_unknown_loss_type_falls_back_to_the_class_name():
    model = SequenceModel(transformers.PretrainedConfig())  # names no head
    multi_label = {"input_ids": torch.randint(1, VOCAB, (2, 8)), "labels": torch.rand(2, 5)}
    task = build_task("regression", model=model, model_loss=True)
    assert task.count_units(multi_label, multi_label["labels"]) == 10.0  # a mean over elements: not refused
    gpt2 = tiny("gpt2")
    gpt2.loss_type = "ForCTC"  # a loss ray_ddp does not weigh: the class still says causal LM
    assert loss_units_of(gpt2) == "shifted"


def test_a_micro_batch_with_no_label_to_learn_from_adds_nothing_and_no_nan():
    model = tiny("gpt2")
    task = build_task("lm", 8, model=model, model_loss=True)
    prompt_only = {"input_ids": torch.randint(1, VOCAB, (1, 8)), "labels": torch.full((1, 8), -100)}
    out = forward(model, prompt_only)
    assert torch.isnan(out.loss)  # the model's mean over no token
    sums = task.sums(out, prompt_only["labels"], prompt_only)
    assert sums["units"] == 0.0 and sums["loss"].item() == 0.0
    sums["loss"].backward()  # still part of the graph: DDP's hooks fire, every gradient 0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
