"""--wandb's tracker without Ray: the driver opens the W&B run (offline: WANDB_MODE is
offline for the whole suite), a controller logs windows, a restart's controller and a
later command's redo steps that are not logged again, the driver finishes it with the
summary and the events; what W&B wrote is read back from its offline files. And the
trackers' contract: one that fails is dropped and named, the others go on."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from wandb_files import read_offline_run

from ray_ddp.config.train import TrainConfig
from ray_ddp.record.events import Event
from ray_ddp.driver.tracking import check_tracking
from ray_ddp.errors import ConfigError
from ray_ddp.storage import resolve_storage
from ray_ddp.trackers.base import Tracker, Trackers
from ray_ddp.trackers.wandb import open_wandb
from ray_ddp.record.folder import run_folder


def copy(trackers: Trackers) -> Trackers:
    return pickle.loads(pickle.dumps(trackers))


def report(callback, step: int, loss: float, ranks: int = 2) -> None:
    rows = [{"epoch": 1, "step": step, "rank": r, "loss": loss, "samples": 8, "units": 8.0,
             "step_time_s": 0.1 * (r + 1), "samples_per_s": 80.0, "time": float(step), "busy_s": 0.05,
             "world_size": ranks, "lr": 0.01} for r in range(ranks)]
    callback.after_report(None, rows, None)


def test_each_step_is_logged_once_through_a_restart_and_a_resume(tmp_path):
    from ray_ddp.observe.callback import MetricsCallback

    cfg = TrainConfig(name="r", storage=str(tmp_path), wandb="ray-ddp-tests", wandb_group="g", lr=0.01)
    store = resolve_storage(str(tmp_path))
    first_command = Trackers([open_wandb(cfg, cfg.to_dict(), "abc123", store)])
    # each controller gets its own copy, as Ray Train's pickle gives it
    controller = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=30, trackers=copy(first_command))
    for step in (5, 10, 15):
        report(controller, step, 1.0)
    controller.after_exception(None, {})  # the group failed; Ray Train's controller ends its session
    # the next fit's controller redoes steps 11-15 from step 10's checkpoint
    restarted = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=30, trackers=copy(first_command.resume()))
    for step in (15, 20):
        report(restarted, step, 2.0)
    restarted.after_exception(None, {})
    # a later command (the first was stopped) resumes from step 15's checkpoint
    second_command = Trackers([open_wandb(cfg, cfg.to_dict(), "abc123", store)])
    controller = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=25, trackers=copy(second_command))
    for step in (20, 25):
        report(controller, step, 3.0)
    failure = Event("failure", 1.0, 15, 1, "n1", "rank 1 was lost", "step-00000010", 5, True)
    second_command.finish({"final_loss": 3.0, "steps": 25}, [failure], "FINISHED", None)
    assert second_command.failed == []

    logged = read_offline_run(str(tmp_path / "r"), "abc123", timeout_s=30)  # every session finished
    windows = [row for row in logged.history if "loss" in row]
    assert [(row["_step"], row["loss"]) for row in windows] == [(5, 1.0), (10, 1.0), (15, 1.0), (20, 2.0), (25, 3.0)]
    assert windows[0]["rank_1/step_time_s"] == pytest.approx(0.2) and windows[0]["world_size"] == 2
    assert logged.config["lr"] == 0.01 and logged.config["name"] == "r" and "g" in logged.groups
    assert logged.summary["final_loss"] == 3.0 and logged.summary["status"] == "FINISHED"
    assert logged.summary["events/failure"] == 1 and logged.summary["events"][0]["cause"] == "rank 1 was lost"
    assert logged.exit_codes[-1] == 0
    cursor = json.loads((tmp_path / "r" / "wandb.json").read_text())
    assert cursor == {"run_id": "abc123", "project": "ray-ddp-tests", "entity": None, "group": "g",
                      "logged_until": 25}


class Broken(Tracker):
    label = "Broken at nowhere"

    def log_window(self, window) -> None:
        raise ConnectionError("down")


class Counting(Tracker):
    label = "counting"

    def __init__(self):
        self.steps = []

    def log_window(self, window) -> None:
        self.steps.append(window.step)


def test_a_tracker_that_fails_is_dropped_named_in_progress_and_the_others_go_on(tmp_path):
    from ray_ddp.observe.callback import MetricsCallback

    counting = Counting()
    callback = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=30, trackers=Trackers([Broken(), counting]))
    (tmp_path / "r").mkdir()
    for step in (5, 10):
        report(callback, step, 1.0)
    assert counting.steps == [5, 10]
    progress = json.loads((tmp_path / "r" / "progress.json").read_text())
    assert progress["trackers_failed"] == ["Broken at nowhere"] and progress["mlflow_failed"] is False


def test_without_wandb_installed_the_check_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails
    with pytest.raises(ConfigError, match=r"pip install 'ray_ddp\[wandb\]'"):
        check_tracking(TrainConfig(wandb="p"))
