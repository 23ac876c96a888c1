"""A model's own loss, weighted by what it is a mean over, is exact over any cut of the
global batch: the field's heads (causal, encoder-decoder, masked, token, row-wise, a
PreTrainedModel that names no loss type) against the single-process reference, the
model's own loss over the whole batch. Tiny models from configs, no Ray."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.tasks.batches import forward
from ray_ddp.tasks.build import build_task, loss_units_of

transformers = pytest.importorskip("transformers")
VOCAB = 32


def tiny(kind: str):
    """A tiny model of ``kind`` in eval mode (dropout would make every forward differ)."""
    return _build(kind).eval()


def _build(kind: str):
    torch.manual_seed(0)
    t = transformers
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    if kind == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8,
                                                       num_layers=1, num_heads=2, decoder_start_token_id=0))
    if kind == "bart":
        return t.BartForConditionalGeneration(t.BartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    bert = t.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=3)
    return {"masked": t.BertForMaskedLM, "token": t.BertForTokenClassification,
            "choice": t.BertForMultipleChoice, "rows": t.BertForSequenceClassification}[kind](bert)


def batch(kind: str, rows: int = 6, length: int = 8) -> dict:
    """Rows whose labels have different lengths (-100 past each row's end), a row of one
    label token, and (where labels are tokens) a row with none at all."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    if kind in ("rows", "choice"):
        labels = torch.randint(0, 3 if kind == "rows" else 2, (rows,), generator=g)
        if kind == "choice":  # (rows, choices, length)
            return {"input_ids": torch.stack([ids, ids.flip(1)], 1), "labels": labels}
        return {"input_ids": ids, "labels": labels}
    labels = torch.randint(0, 3 if kind == "token" else VOCAB, (rows, length), generator=g)
    ends = [8, 1, 5, 2, 0, 7][:rows]  # label tokens per row: one row has 1, one has none
    for r, end in enumerate(ends):
        labels[r, end:] = -100
    return {"input_ids": ids, "labels": labels}


def own_loss(model, x) -> float:
    with torch.no_grad():
        return forward(model, x).loss.item()


def weighted_mean(model, task, micro_batches) -> float:
    """What the loop computes: each micro-batch's loss sum over the step's units."""
    total = sum(task.count_units(x, x["labels"]) for x in micro_batches)
    with torch.no_grad():
        return sum(task.sums(forward(model, x), x["labels"], x)["loss"].item() for x in micro_batches) / total


CASES = {"gpt2": "shifted", "t5": "tokens", "bart": "tokens", "masked": "tokens", "token": "tokens",
         "rows": "rows", "choice": "rows"}


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
