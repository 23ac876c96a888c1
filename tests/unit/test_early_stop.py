"""--early-stop without Ray: the count of validations without a lower val_loss, put back
on a resume from eval.parquet, carried in the metrics row and progress.json, the
driver's line, summary.json's fields and a rerun that finds the run complete."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from ray_ddp.checkpoint.format import TrainState, checkpoint_dir_name, save_checkpoint
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.inputs import ValSet
from ray_ddp.record.progress import format_early_stop, show_progress
from ray_ddp.driver.start import find_start
from ray_ddp.driver.summary import write_summary
from ray_ddp.models.builtin import ToyModel
from ray_ddp.record.schema import EVAL_SCHEMA, SCHEMA
from ray_ddp.observe.summarize import early_stop_row, summarize_report
from ray_ddp.record.folder import EVAL_FILE, METRICS_FILE, RunFolder
from ray_ddp.storage import resolve_storage, write_json, write_table
from ray_ddp.worker.loop import is_final_save
from ray_ddp.worker.validate import EarlyStop, Validator
from ray_ddp.plan import BatchPlan
from ray_ddp.record.folder import run_folder
from ray_ddp.driver.resolve import resolve


def test_the_count_resets_only_on_a_lower_val_loss():
    stop = EarlyStop(3)
    seen = [stop.update(loss, epoch) for epoch, loss in enumerate([1.0, 0.9, 0.95, 0.9, 0.91], start=1)]
    assert [s["early_stop_stale"] for s in seen] == [0, 0, 1, 2, 3]  # equal to the best: no better
    assert [s["early_stopped"] for s in seen] == [False] * 4 + [True]
    assert (stop.best, stop.best_epoch, stop.stopped) == (0.9, 2, True)
    assert seen[-1]["early_stop_best"] == 0.9 and seen[-1]["early_stop_best_epoch"] == 2


def test_a_nan_never_counts_as_better():
    stop = EarlyStop(2)
    first = stop.update(math.nan, 1)
    assert first["early_stop_stale"] == 1 and first["early_stop_best"] is None
    stop.update(0.5, 2)
    assert stop.stale == 0
    stop.update(math.nan, 3)
    assert stop.update(math.nan, 4)["early_stopped"]


def test_a_replayed_history_counts_as_the_live_one_did():
    losses = [0.8, 0.7, 0.75, 0.72]
    live = EarlyStop(3)
    for epoch, loss in enumerate(losses, start=1):
        live.update(loss, epoch)
    replayed = EarlyStop(3)
    rows = [{"epoch": e, "step": 10 * e, "loss": loss} for e, loss in enumerate(losses, start=1)]
    replayed.replay(reversed(rows))  # in step order, whatever order the table holds them in
    assert vars(replayed) == vars(live) and replayed.stale == 2 and not replayed.stopped


def run_cfg(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(storage=str(tmp_path), name="es", epochs=10, steps_per_epoch=10, val_fraction=0.2,
                       **{"early_stop": 2, **kw})


def es_folder(tmp_path):
    """run_cfg's run folder."""
    return run_folder(resolve_storage(str(tmp_path)), "es")


def write_evals(tmp_path, losses, start_epoch=1):
    store = resolve_storage(str(tmp_path))
    rows = [{"epoch": e, "step": 10 * e, "samples": 100, "loss": loss, "accuracy": None,
             "perplexity": None, "time_s": 0.1} for e, loss in enumerate(losses, start=start_epoch)]
    store.fs.create_dir(store.run_path("es"), recursive=True)
    write_table(store.fs, f"{store.run_path('es')}/{EVAL_FILE}", pa.Table.from_pylist(rows, schema=EVAL_SCHEMA))


def test_a_resume_counts_on_from_the_validations_up_to_its_checkpoint(one_rank_group, tmp_path):
    # epochs 1..4; the run resumes from epoch 3's checkpoint (step 30): epoch 4's row
    # belongs to a stretch that is redone, and is not counted
    write_evals(tmp_path, [0.5, 0.6, 0.7, 0.4])
    validator = Validator(run_cfg(tmp_path, early_stop=3), None, None, None, 0, 1, torch.device("cpu"), folder=es_folder(tmp_path))
    validator.resume_early_stop(30)
    assert (validator.early_stop.stale, validator.early_stop.best, validator.early_stop.best_epoch) == (2, 0.5, 1)
    assert not validator.stopped
    again = Validator(run_cfg(tmp_path), None, None, None, 0, 1, torch.device("cpu"), folder=es_folder(tmp_path))
    again.resume_early_stop(30)  # --early-stop 2 was reached at that checkpoint: nothing more to train
    assert again.stopped
    fresh = Validator(run_cfg(tmp_path), None, None, None, 0, 1, torch.device("cpu"), folder=es_folder(tmp_path))
    fresh.resume_early_stop(0)  # a new run reads nothing
    assert fresh.early_stop.stale == 0
    off = Validator(run_cfg(tmp_path, early_stop=None), None, None, None, 0, 1, torch.device("cpu"), folder=es_folder(tmp_path))
    off.resume_early_stop(30)
    assert off.early_stop is None and not off.stopped


def test_a_resume_from_a_snapshot_counts_the_validations_its_unsent_rows_hold(one_rank_group, tmp_path):
    """A snapshot (or a checkpoint whose report Ray never took) holds metrics rows no
    report sent: their validations are in no eval.parquet yet, and count all the same,
    once (a step in both counts once), as they did in the run that made them."""
    write_evals(tmp_path, [0.5, 0.6])  # epochs 1 and 2 reached the table
    unsent = [[{"epoch": 2, "step": 20, "val_loss": 0.6}, {"epoch": 3, "step": 25},
               {"epoch": 3, "step": 30, "val_loss": 0.7}],
              [{"epoch": 2, "step": 20, "val_loss": 0.6}, {"epoch": 3, "step": 25},
               {"epoch": 3, "step": 30, "val_loss": 0.7}]]  # every rank's, alike
    validator = Validator(run_cfg(tmp_path), None, None, None, 0, 1, torch.device("cpu"), folder=es_folder(tmp_path))
    validator.resume_early_stop(30, unsent)
    assert (validator.early_stop.stale, validator.early_stop.best_epoch) == (2, 1) and validator.stopped


def test_validation_rows_carry_the_count(one_rank_group, tmp_path):
    from ray_ddp.tasks.build import build_task

    model = ToyModel()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the output is 0 whatever the input: the same val_loss every time
    parts = SimpleNamespace(model=model, devices=[torch.device("cpu")], autocast=nullcontext,
                            strategy=SimpleNamespace(forward_is_collective=False), last_row=None)
    val = ValSet(8, lambda idx: (torch.ones(len(idx), 10), torch.ones(len(idx), 5)))
    validator = Validator(run_cfg(tmp_path), val, build_task("regression", 8), parts, 0, 1, torch.device("cpu"),
                          folder=es_folder(tmp_path))
    rows = [validator.validate(epoch) for epoch in (1, 2, 3)]
    assert [r["val_loss"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["early_stopped"] for r in rows] == [False, False, True] and validator.stopped
    assert rows[-1]["early_stop_best_epoch"] == 1 and rows[-1]["early_stop_stale"] == 2


def test_the_stopping_epoch_writes_the_whole_model_too():
    cfg = TrainConfig(epochs=10)
    assert is_final_save(cfg, epoch=2, epoch_end=True, early_stopped=True)
    assert not is_final_save(cfg, epoch=2, epoch_end=True)
    assert not is_final_save(TrainConfig(epochs=10, skip_final_model=True), epoch=2, epoch_end=True,
                             early_stopped=True)


def stopping_row(rank=0):
    return {"epoch": 3, "step": 30, "rank": rank, "loss": 0.3, "samples_per_s": 100.0, "units": 1.0,
            "samples": 10, "val_loss": 0.4123, "early_stopped": True, "early_stop_stale": 2,
            "early_stop_best": 0.4011, "early_stop_best_epoch": 1}


def test_the_report_that_stops_says_so_in_one_line(tmp_path):
    progress = summarize_report([stopping_row(0), stopping_row(1)], epochs=10, total_steps=100,
                                checkpoint="step-00000030")
    line = ("early stop: val_loss 0.4123 has not improved for 2 validations (best 0.4011 at epoch 1); "
            "stopped after epoch 3 of 10")
    assert format_early_stop(progress["early_stop"]) == line
    assert "early_stop" not in summarize_report([{**stopping_row(), "early_stopped": False}], 10, 100, None)
    # the driver prints it after the report's progress line
    store = resolve_storage(str(tmp_path))
    lines = []
    with show_progress(RunFolder(store.fs, str(tmp_path)), lines.append, enabled=True, every_s=0.05):
        write_json(store.fs, f"{tmp_path}/progress.json", {**progress, "time": time.time(), "straggler": None})
    assert lines[-1] == line and lines[-2].startswith("epoch 3/10  step 30/100")


def write_stopped_run(tmp_path, cfg, early_stopped=True, epoch_step=0):
    """A run folder whose latest checkpoint is epoch 3's (step 30), and its metrics table."""
    store = resolve_storage(str(tmp_path))
    run_path = store.run_path(cfg.name)
    model = ToyModel()
    save_checkpoint(f"{run_path}/{checkpoint_dir_name(30)}", model, torch.optim.SGD(model.parameters(), lr=0.1),
                    TrainState(3, 30, epoch_step, []), {"config": cfg.to_dict(), "plan": resolve(cfg, None).planned()},
                    rank=0)
    base = {"samples": 10, "step_time_s": 0.1, "samples_per_s": 100.0, "time": time.time(), "loss": 0.3,
            "units": 10.0, "world_size": 1}
    rows = [{**base, "epoch": e, "step": 10 * e, "rank": 0, "early_stopped": e == 3 and early_stopped}
            for e in (1, 2, 3)]
    write_table(store.fs, f"{run_path}/{METRICS_FILE}", pa.Table.from_pylist(rows, schema=SCHEMA))
    return store


def test_a_rerun_of_an_early_stopped_run_is_complete(tmp_path):
    cfg = run_cfg(tmp_path)
    store = write_stopped_run(tmp_path, cfg)
    lines = []
    start = find_start(resolve(cfg, None), store, None, lines.append)
    assert start.complete and start.resumed_from.endswith("/es/step-00000030")
    assert lines == ["run es is already complete: --early-stop 2 ended it after epoch 3 of 10; nothing to do "
                     "(give a larger --early-stop to train further)"]
    assert find_start(resolve(run_cfg(tmp_path, early_stop=None), None), store, None, print).complete  # stopping is its end
    assert not find_start(resolve(run_cfg(tmp_path, early_stop=4), None), store, None, print).complete  # counts on

    summary = write_summary(resolve(cfg, None), store, None, None, time.time())
    assert (summary.early_stopped, summary.early_stop_epoch, summary.epochs_completed) == (True, 3, 3)


@pytest.mark.parametrize("epoch_step", [0, 4])
def test_a_checkpoint_early_stop_did_not_end_is_resumed(tmp_path, epoch_step):
    cfg = run_cfg(tmp_path)
    store = write_stopped_run(tmp_path, cfg, early_stopped=False, epoch_step=epoch_step)
    assert not find_start(resolve(cfg, None), store, None, print).complete
    summary = write_summary(resolve(cfg, None), store, None, None, time.time())
    assert (summary.early_stopped, summary.early_stop_epoch) == (False, None)


def test_an_early_stop_at_a_validation_mid_epoch_ends_the_run_there(tmp_path):
    """--eval-every-steps validates mid-epoch: its early stop's checkpoint is the run's end too."""
    cfg = run_cfg(tmp_path)
    store = write_stopped_run(tmp_path, cfg, early_stopped=True, epoch_step=4)
    assert find_start(resolve(cfg, None), store, None, print).complete


def test_tables_from_before_the_column_have_no_early_stop():
    old = pa.Table.from_pylist([{"epoch": 1, "step": 10, "rank": 0}])
    assert early_stop_row(old, 10) is None and early_stop_row(None, 10) is None


def test_the_loop_checkpoints_the_stopping_epoch_and_ends_there(monkeypatch):
    """WorkerRun.train with the step and the window's end stubbed (no Ray): validation
    every epoch, --checkpoint-every 4, a val_loss that never gets lower."""
    from ray_ddp.worker import loop
    from ray_ddp.worker.heartbeat import Heartbeat
    from ray_ddp.worker.profile import ProfileState
    from ray_ddp.worker.snapshotting import Snapshotter

    cfg = TrainConfig(epochs=10, steps_per_epoch=2, report_every=10, checkpoint_every=4, early_stop=2,
                      val_fraction=0.2)
    worker = loop.WorkerRun.__new__(loop.WorkerRun)
    worker.cfg, worker.state, worker.cut = cfg, TrainState(), BatchPlan(32, 32).cut(1)
    worker.last_step, worker.steps_per_epoch = 20, 2
    worker.parts = SimpleNamespace(strategy=SimpleNamespace(sync_buffers=lambda *a: None), model=None,
                                   devices=[torch.device("cpu")])
    worker.reporter = SimpleNamespace(collective_device=torch.device("cpu"))
    worker.window = SimpleNamespace(started=0.0)
    worker.first_report, worker.task, worker.source, worker.rank = None, None, None, 0
    worker.snapshots = Snapshotter(None, worker.parts, worker.state, {}, 0, 1, worker.reporter)  # off
    worker.snapshot_agreed = False
    worker.heartbeat = Heartbeat(None, 0, "node", "127.0.0.1", 1.0)  # no watch: no thread
    worker.profile = ProfileState(None, 0, None, torch.device("cpu"))
    validator = Validator(cfg, None, None, None, 0, 1, torch.device("cpu"))
    validator.should_validate = lambda epoch_done, step, last=False: epoch_done > 0
    validator.validate = lambda epoch_done: {"val_time_s": 0.0, **validator.early_stop.update(1.0, epoch_done)}
    worker.validator = validator
    closed = []
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: None)
    monkeypatch.setattr(worker, "_close_window", lambda epoch, save, epoch_end, evaluated=None:
                        closed.append((epoch + 1, save, evaluated["early_stopped"])) if epoch_end else None)
    worker.train()
    assert closed == [(1, False, False), (2, False, False), (3, True, True)]  # epoch 3 saved, then no more
    assert (worker.state.epoch, worker.state.step) == (3, 6)
    worker.train()  # resumed where it stopped (a restart within the run): nothing more to train
    assert len(closed) == 3 and worker.state.step == 6


def test_a_mid_epoch_checkpoint_is_not_resumed_with_other_steps_per_epoch():
    """A checkpoint at step 6 of a 10-step epoch names rows by that cut; with 5 steps an
    epoch (another global batch) step 6 is past the epoch's end: one line, not a run that
    silently trains nothing."""
    from ray_ddp.driver.start import check_resumable
    from ray_ddp.errors import ConfigError

    meta = {"epoch": 1, "step": 16, "epoch_step": 6, "config": {}, "plan": {"steps_per_epoch": 10}}
    with pytest.raises(ConfigError, match=r"taken at step 6 of epoch 2's 10 steps, and this command makes 5 steps"):
        check_resumable(resolve(TrainConfig(name="r", steps_per_epoch=5), None), meta, "step-00000016", data_decides_steps=True)
    check_resumable(resolve(TrainConfig(name="r", steps_per_epoch=10), None), meta, "step-00000016", data_decides_steps=True)
    check_resumable(resolve(TrainConfig(name="r", steps_per_epoch=5), None), {**meta, "epoch_step": 0}, "step-00000010",
                    data_decides_steps=True)
