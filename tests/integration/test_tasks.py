"""Real tasks: a classifier with validation and an LR schedule, a language model on real
text, and models whose forward skips parameters. The tasks are ray_ddp's own arithmetic,
so they train in plain gloo process groups, no Ray (tests/helpers/gloo_run.py; the same
path on Ray: test_hf.py's GPT-2 and test_trust.py's run). What the step makes of a forward
that skips parameters without the flag: ray_ddp's own step on 2 gloo ranks; with the flag,
test_trust.py's run of the Python API's objects defined only in the calling code."""

from __future__ import annotations

import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp.data.synth_files import write_synthetic
from ray_ddp.models.builtin import build_mlp

from ._runs import rows_of, small
from gloo_run import train_in_gloo

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def classes(tmp_path_factory):
    """4 classes of a teacher network's argmax over 8 features; 3000 rows."""
    path = tmp_path_factory.mktemp("cls") / "set"
    write_synthetic(str(path), rows=3000, features=8, targets=1, task="classification", classes=4, seed=2)
    return str(path)


def model_weights(summary):
    return torch.load(f"{summary.checkpoint}/model.pt", weights_only=True)


def test_classifier_learns_follows_its_schedule_validates_every_row_once_on_3_workers_and_keeps_the_best(
        storage, classes, tmp_path):
    # (that 3 workers x 64 rows x 2 accumulation steps learn what 1 x 384 learns, the
    # cross-entropy being the exact mean over the global batch however it is cut, is
    # test_loss_matrix.py's, against one plain process)
    # Validated on 100 of the rows (not a multiple of 3) whose labels are shuffled: as
    # training fits the training rows, validation gets worse, so the best checkpoint is
    # an early one
    table = pq.read_table(classes).slice(0, 100)
    g = torch.Generator().manual_seed(5)
    shuffled = torch.tensor(table.column("t0").to_pylist())[torch.randperm(100, generator=g)]
    val = tmp_path / "val.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("t0"), "t0", pa.array(shuffled.numpy())), val)

    summary = train_in_gloo(small(storage, "cls-3x64x2", workers=3, batch_size=64, grad_accum=2, data=classes,
                                  val_data=str(val), model="mlp", width=32, depth=1, epochs=2, optimizer="adamw",
                                  lr=0.05, warmup_steps=4, schedule="cosine", report_every=1, keep=1,
                                  keep_best=True))
    # 3000 rows a step of 3 x 64 x 2 = 384: 7 whole steps and one of the 312 left, an epoch
    assert summary.task == "classification" and summary.steps == 2 * 8
    rows = rows_of(summary)
    assert all(0 <= r["accuracy"] <= 1 for r in rows)  # every training window's figure
    last = [r for r in rows if r["step"] == 15]  # the last whole step: it learns (chance is 0.25)
    assert sum(r["accuracy"] * r["samples"] for r in last) / sum(r["samples"] for r in last) > 0.75, last
    assert rows[0]["samples"] == 64 * 2  # per rank per step: batch x accumulation
    # the LR after a step, worked out by hand: linear warm-up to 0.05 over 4 steps (the
    # first step runs at 1/4 of it), then cosine from 0.05 at step 4 to 0 at step 16
    want = {1: 0.025, 2: 0.0375, 3: 0.05, 4: 0.05, 10: 0.025, 16: 0.0}
    got = {r["step"]: r["lr"] for r in rows if r["rank"] == 0 and r["step"] in want}
    assert got == pytest.approx(want, abs=1e-9)

    evals = pq.read_table(f"{summary.path}/eval.parquet").to_pylist()
    assert [(r["epoch"], r["samples"]) for r in evals] == [(1, 100), (2, 100)]  # each row once, over 3 ranks
    assert evals[-1]["loss"] == summary.val_loss and evals[-1]["accuracy"] == summary.val_accuracy
    # the figures are the exact mean over the 100 rows: the final model, on the driver
    model = build_mlp(8, 4, 32, 1)
    model.load_state_dict(model_weights(summary))
    x = torch.stack([torch.tensor(table.column(f"f{i}").to_pylist()) for i in range(8)], dim=1).float()
    with torch.no_grad():
        logits = model(x)
    assert abs(evals[-1]["loss"] - torch.nn.functional.cross_entropy(logits, shuffled).item()) < 1e-5
    assert abs(evals[-1]["accuracy"] - (logits.argmax(1) == shuffled).float().mean().item()) < 1e-6
    # --keep 1 --keep-best: the newest, and the one with the lowest validation loss
    best = min(evals, key=lambda r: r["loss"])["step"]
    kept = sorted(p for p in os.listdir(summary.path) if p.startswith("step-"))
    assert kept == sorted({f"step-{best:08d}", f"step-{evals[-1]['step']:08d}"})
    assert summary.best_checkpoint == f"{summary.path}/step-{best:08d}"
    assert summary.best_val_loss == min(r["loss"] for r in evals)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Real English text that ships with Python (pydoc's help topics): 120 kB to train on,
    12 kB to validate on."""
    import pydoc_data.topics

    corpus = "".join(pydoc_data.topics.topics.values()).encode()
    folder = tmp_path_factory.mktemp("text")
    (folder / "train").mkdir()
    (folder / "train" / "topics.txt").write_bytes(corpus[:120_000])
    (folder / "val.txt").write_bytes(corpus[120_000:132_000])
    return folder


def test_gpt_on_real_text_beats_a_byte_frequency_model(storage, text):
    summary = train_in_gloo(small(storage, "gpt-text", data=str(text / "train"), val_data=str(text / "val.txt"),
                                  model="gpt", width=64, depth=2, heads=4, seq_len=32, batch_size=32, epochs=3,
                                  optimizer="adamw", lr=0.01, warmup_steps=20, clip_grad=1.0, report_every=20))
    assert summary.task == "lm"
    # a unigram model of the training bytes (add-one smoothed), scored on the validation bytes
    train = torch.tensor(list((text / "train" / "topics.txt").read_bytes()))
    val = torch.tensor(list((text / "val.txt").read_bytes()))
    freq = torch.bincount(train, minlength=256).double() + 1
    unigram = math.exp(-(freq / freq.sum()).log()[val].mean().item())
    assert summary.val_perplexity < 0.7 * unigram, (summary.val_perplexity, unigram)
    assert all(r["perplexity"] == pytest.approx(math.exp(r["loss"])) for r in rows_of(summary))
    # a token task's windows count their input tokens: seq_len 32 for each row they trained
    for r in rows_of(summary):
        assert r["tokens"] == 32 * r["samples"] and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])
    assert summary.tokens_per_s > 0 and summary.mfu is None  # no GPU here: no peak to divide by


def test_a_forward_that_skips_parameters_is_one_line_pointing_to_the_flag():
    # ray_ddp's own step on 2 gloo ranks, no Ray: the worker loop raises this line (a
    # worker's error reaching the driver as one line is the NaN run's, test_recovery.py);
    # with the flag such a model trains (and on Ray: test_trust.py's SpareHeadNet)
    from dist_matrix import run_on_ranks, two_steps_of_a_forward_that_skips_a_layer

    told = run_on_ranks(2, two_steps_of_a_forward_that_skips_a_layer)
    assert told == [("the model's forward did not use every parameter, and DDP needs each one's gradient for "
                     "its all-reduce; pass --find-unused-parameters", "trained")] * 2, told
