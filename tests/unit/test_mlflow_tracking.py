"""--mlflow with no server to answer: one line at start and False mid-run, each in
seconds; and MLflow not installed. No Ray, no server (the tracking server's tests are
tests/integration/test_mlflow_server.py)."""

from __future__ import annotations

import sys
import time

import pytest

from servers import free_port

from ray_ddp.errors import ConfigError
from ray_ddp.record.events import Event
from ray_ddp.trackers.mlflow import MlflowRun, finish_tracking, log_events, log_window, open_tracking
from ray_ddp.record.folder import run_folder
from ray_ddp.storage import resolve_storage


def test_unreachable_server_is_one_line_in_seconds():
    uri = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        open_tracking(uri, "run-x", {"lr": 0.1}, identity="a1")
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "\n" not in message and uri in message and "cannot be reached" in message


def test_dead_server_mid_run_is_false_quickly():
    cfg = MlflowRun(uri=f"http://127.0.0.1:{free_port()}", run_id="0" * 32, experiment_id="1")
    start = time.monotonic()
    assert log_window(cfg, 1, {"loss": 1.0}) is False
    assert log_events(cfg, [Event("hang", time.time(), 1, None, None, "hang: x")]) is False
    assert finish_tracking(cfg, {"final_loss": 1.0}, "FAILED") is False
    assert time.monotonic() - start < 15  # MLflow alone would retry for minutes


def test_without_mlflow_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now fails
    with pytest.raises(ConfigError, match=r"pip install 'ray_ddp\[mlflow\]'"):
        open_tracking("http://127.0.0.1:1", "run-x", {}, identity="a1")


def test_a_fit_after_a_driver_restart_does_not_log_the_redone_steps_again(tmp_path):
    """The first fit's controller logged steps 5-15 and is gone; the next fit (an elastic
    resize, a forgiven preemption) redoes steps from step 10's checkpoint: its controller
    starts from what the server holds, not from the command's start (nothing logged)."""
    from ray_ddp.observe.callback import MetricsCallback
    from ray_ddp.trackers.base import Trackers
    from ray_ddp.trackers.mlflow import MlflowTracker, _client

    at_start = open_tracking(f"sqlite:///{tmp_path}/mlflow.db", "run-x", {"lr": 0.1}, identity="a1")
    assert at_start.logged_until == 0
    (tmp_path / "r").mkdir()

    def report(callback, step, loss):
        row = {"epoch": 1, "step": step, "rank": 0, "loss": loss, "samples": 8, "units": 8.0, "step_time_s": 0.1,
               "samples_per_s": 80.0, "time": float(step), "busy_s": 0.05, "world_size": 1}
        callback.after_report(None, [row], None)

    trackers = Trackers([MlflowTracker(at_start)])
    first = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=30, trackers=trackers)
    for step in (5, 10, 15):
        report(first, step, 1.0)
    # the driver resumes the trackers it opened (its copy never saw the controller's steps)
    second = MetricsCallback(run_folder(resolve_storage(str(tmp_path)), "r"), epochs=1, total_steps=30, trackers=trackers.resume())
    for step in (15, 20):  # redone from step 10's checkpoint, then new
        report(second, step, 2.0)
    history = _client(at_start.uri).get_metric_history(at_start.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(5, 1.0), (10, 1.0), (15, 1.0), (20, 2.0)]
