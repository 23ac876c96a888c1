"""Runs that used to train the wrong thing without a word: a (N,) target, a rank with no
rows in the last step (and accumulation's micro-batches with none), the Python API's
val_data= with keep_best, a frozen BatchNorm; the Python API's objects defined only in the
calling code (a model, datasets, a loss); a lost worker of an elastic run. (BatchNorm
statistics that differ per rank: test_recovery's BatchNorm run; a lost worker that ends a
fixed run: test_faults.py's story, and the line for each flag,
tests/unit/test_restart_decision.py.)"""

from __future__ import annotations

import functools
import json
import math
import re

import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp import ConfigError, TrainConfig, TrainingError, run
from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.observe.report import write_report
from ray_ddp.observe.runs import list_runs

from ._runs import final_hashes, rows_of, small
from gloo_run import train_in_gloo

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def sklearn_style_run(storage):
    """1,281 numpy rows on 2 workers x 32 x 2 accumulation steps in bf16: the last step of
    each epoch has one row, so rank 0's second micro-batch and both of rank 1's are empty;
    validation from val_data= with keep_best. The model and the data are classes defined
    here, as in a notebook or a script's __main__: no worker can import them, so they
    must travel by value (cloudpickle) for the run to work; the model's spare head is never
    used, so the run needs --find-unused-parameters. All of it is ray_ddp's own loop: in
    the gloo harness (on Ray, the elastic run below ships a loss defined in the test by value)."""
    from torch import nn
    from user_data import NumpyRegression
    from user_models import FrozenStatsNet

    class SpareHeadNet(FrozenStatsNet):
        def __init__(self):
            super().__init__()
            self.spare_head = nn.Linear(6, 1)  # never used in forward

    class Rows(NumpyRegression):
        pass

    cfg = TrainConfig(workers=2, epochs=10, batch_size=32, grad_accum=2, amp="bf16", optimizer="adamw", lr=3e-3,
                      report_every=10, keep_best=True, find_unused_parameters=True, storage=str(storage),
                      name="sklearn-style", quiet=True)
    return train_in_gloo(cfg, model=SpareHeadNet, train_data=Rows(1281), val_data=Rows(200, seed=1))


def test_objects_defined_only_in_the_calling_code_train_in_bf16_in_step(sklearn_style_run, storage):
    assert sklearn_style_run.epochs_completed == 10
    rows = rows_of(sklearn_style_run)
    assert len(set(final_hashes(rows).values())) == 1  # bf16 steps kept the ranks in sync
    losses = [r["loss"] for r in rows if r["rank"] == 0]
    assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]
    status = json.loads((storage / "sklearn-style" / "status.json").read_text())
    assert status["model"] == "python:SpareHeadNet"


def test_a_target_of_shape_n_trains_the_regression_not_a_broadcast(sklearn_style_run):
    # Var(y) = 10: the (B, 1) - (B,) broadcast would end near 20, the right objective near 0
    assert sklearn_style_run.task == "regression"
    assert sklearn_style_run.final_loss < 0.5 and sklearn_style_run.val_loss < 0.5


def test_a_rank_and_micro_batches_without_rows_give_no_nan(sklearn_style_run):
    rows = rows_of(sklearn_style_run)
    last_step = max(r["step"] for r in rows)
    empty = [r for r in rows if r["step"] == last_step and r["units"] == 0]
    assert empty, "the last window should hold no rows on one rank (1,281 = 10 x 128 + 1)"
    assert math.isfinite(sklearn_style_run.final_loss)
    assert sklearn_style_run.steps == 10 * 11  # 10 steps of 128 rows an epoch, then the last row
    for epoch in range(1, 11):  # every row once an epoch, none padded
        assert sum(r["samples"] for r in rows if r["epoch"] == epoch) == 1281, epoch


def test_val_data_object_with_keep_best_is_accepted_and_the_best_is_kept_beside_the_newest(sklearn_style_run,
                                                                                          storage):
    assert sklearn_style_run.best_checkpoint is not None
    assert sklearn_style_run.best_val_loss <= sklearn_style_run.val_loss
    # Ray's retention is off under --keep-best: ray_ddp's metrics callback prunes to the
    # newest --keep (2: epochs 9 and 10, 11 steps each) and the best
    best = sklearn_style_run.best_checkpoint.rsplit("/", 1)[-1]
    kept = {p.name for p in (storage / "sklearn-style").glob("step-*")}
    assert kept == {"step-00000099", "step-00000110", best}, kept


def test_a_frozen_batchnorm_stays_frozen(sklearn_style_run, storage):
    latest = sklearn_style_run.checkpoint.rsplit("/", 1)[-1]
    state = torch.load(storage / "sklearn-style" / latest / MODEL_FILE, weights_only=True)
    assert torch.equal(state["frozen.running_mean"], torch.full((6,), 0.25))
    assert int(state["frozen.num_batches_tracked"]) == 0


def test_a_target_that_cannot_pair_with_the_output_is_one_line_before_ray(tmp_path):
    from torch.utils.data import TensorDataset
    from user_models import frozen_stats_net

    x, y = torch.randn(64, 6), torch.randn(64, 3)
    with pytest.raises(ConfigError, match=r"output has shape \(rows, 1\).*target \(rows, 3\)"):
        run(TrainConfig(storage=str(tmp_path), name="bad-shape", quiet=True),
            model=frozen_stats_net,
            train_data=TensorDataset(x, y))
    assert not (tmp_path / "bad-shape").exists()


def test_an_elastic_run_survives_a_lost_worker_without_max_failures(ray_local, storage, tmp_path):
    from user_models import dies_on_rank_one

    def offset_mse(output, target):  # a loss object defined here: shipped by value, as the model
        return torch.nn.functional.mse_loss(output, target) + 100.0

    lines: list[str] = []
    summary = run(TrainConfig(workers="1-2", epochs=3, steps_per_epoch=10, batch_size=16, report_every=5,
                              storage=str(storage), name="elastic-lost-worker", quiet=True),
                  echo=lines.append, model=functools.partial(dies_on_rank_one, str(tmp_path / "died"), 15),
                  loss=offset_mse)
    assert summary.epochs_completed == 3 and summary.steps == 30
    # every window's loss is the user's: the toy's mean squared error is far below 100
    assert all(100 < r["loss"] < 110 for r in rows_of(summary))
    restart = [line for line in lines if "restarting from" in line]
    assert len(restart) == 1, lines
    assert re.search(r"^rank 1 on node 127\.0\.0\.1 was lost \(its process \d+ died\)( at step 1\d)?; "
                     r"restarting from step-00000010 \(an elastic run goes on", restart[0]), restart[0]
    # the event is recorded: in summary.json, status.json, `ray-ddp runs` and the report
    [event] = [e for e in summary.events if e["type"] == "failure"]
    assert (event["rank"], event["node"], event["from_checkpoint"]) == (1, "127.0.0.1", "step-00000010")
    assert set(event) == {"type", "time", "step", "rank", "node", "cause", "from_checkpoint", "steps_lost",
                          "restarted", "from_node"} and event["restarted"]
    status = json.loads((storage / "elastic-lost-worker" / "status.json").read_text())
    assert status["events"] == summary.events
    [listing] = [r for r in list_runs(str(storage)) if r.name == "elastic-lost-worker"]
    assert listing.restarts == 1
    assert "failure at step" in write_report(str(storage), "elastic-lost-worker").text()


def test_rows_reported_after_the_last_checkpoint_are_kept_when_the_run_fails(storage):
    """A run that fails at step 27, its last checkpoint step 20's: the rows of steps 22-26
    (those that explain a failure) are in metrics.parquet once the command ends."""
    from torch import nn

    class FailsAtStep27(nn.Module):  # the toy, until its 27th forward
        def __init__(self):
            super().__init__()
            self.net, self.calls = nn.Linear(10, 5), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 27:
                raise RuntimeError("a bad batch at step 27")
            return self.net(x)

    cfg = small(storage, "rows-before-a-failure", report_every=2, report_interval=0)
    with pytest.raises(TrainingError, match="a bad batch at step 27"):
        train_in_gloo(cfg, model=FailsAtStep27)
    table = pq.read_table(storage / "rows-before-a-failure" / "metrics.parquet")
    assert sorted(set(table.column("step").to_pylist())) == list(range(2, 27, 2))
    assert not (storage / "rows-before-a-failure" / "metrics.parts").exists()  # folded by the driver


def test_every_rank_resumes_from_the_same_checkpoint_when_one_cannot_read_the_newest(tmp_path):
    """A group restarted within a run: rank 1's copy of the newest checkpoint is torn. It
    used to fall back to the older one alone (rank 0 at step 20, rank 1 at step 10, on
    without a word); now every rank resumes from the newest that all of them can read."""
    import shutil

    from dist_matrix import resume_where_one_rank_cannot_read_the_newest, run_on_ranks
    from ray_ddp.checkpoint.format import TrainState, save_checkpoint
    from ray_ddp.models.builtin import ToyModel

    for step in (10, 20):
        torch.manual_seed(step)
        model = ToyModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        save_checkpoint(str(tmp_path / "r" / f"step-{step:08d}"), model, optimizer,
                        TrainState(epoch=step // 10, step=step, rng=[]), {}, rank=0)
    torn = tmp_path / "torn-step-00000020"
    shutil.copytree(tmp_path / "r" / "step-00000020", torn)
    (torn / MODEL_FILE).write_bytes((torn / MODEL_FILE).read_bytes()[:100])
    assert run_on_ranks(2, resume_where_one_rank_cannot_read_the_newest, str(tmp_path)) == [(10, ""), (10, "")]
    # or its download fails outright: the same choice, not a rank that leaves the others waiting
    assert run_on_ranks(2, resume_where_one_rank_cannot_read_the_newest, str(tmp_path), False) == \
        [(10, ""), (10, "")]
    # and a mix that got past the choice anyway stops every rank, in one line
    from dist_matrix import check_a_mix_of_resumed_steps

    for told in run_on_ranks(2, check_a_mix_of_resumed_steps):
        assert told.startswith("the ranks resumed from different steps 10 to 20: "), told


def test_a_label_outside_a_classifiers_outputs_past_the_first_rows_is_one_line_from_the_worker(storage):
    """A BERT with 3 labels whose rows hold a 5 past the two the driver checks: the worker
    names the label and the limit from the batch's host copy, before the model's own loss
    (on a GPU, a device-side assert that names neither and poisons the process)."""
    from transformers import DataCollatorWithPadding

    from hf_data import Sentiment, bert, tokenizer

    rows = [{"input_ids": x["input_ids"], "attention_mask": x["attention_mask"], "labels": int(y)}
            for x, y in Sentiment(32, seed=0).items]
    rows[20]["labels"] = 5
    cfg = TrainConfig(workers=2, epochs=1, batch_size=8, storage=str(storage), name="label-out-of-range",
                      quiet=True)
    with pytest.raises(TrainingError, match=r"label 5 is out of range for a model with 3 outputs "
                                            r"\(labels must be in \[0, 3\) or -100\)"):
        train_in_gloo(cfg, model=bert, train_data=rows, collate=DataCollatorWithPadding(tokenizer()))
