"""--mlflow with no server to answer: one line at start and False mid-run, each in
seconds; and MLflow not installed. No Ray, no server (the tracking server's tests are
tests/integration/test_mlflow_server.py)."""

from __future__ import annotations

import sys
import time

import pytest

from servers import free_port

from ray_ddp.errors import ConfigError
from ray_ddp.driver.events import Event
from ray_ddp.observe.mlflow_tracking import MlflowConfig, finish_tracking, log_events, log_window, open_tracking


def test_unreachable_server_is_one_line_in_seconds():
    uri = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        open_tracking(uri, "run-x", {"lr": 0.1}, identity="a1")
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "\n" not in message and uri in message and "cannot be reached" in message


def test_dead_server_mid_run_is_false_quickly():
    cfg = MlflowConfig(uri=f"http://127.0.0.1:{free_port()}", run_id="0" * 32, experiment_id="1")
    start = time.monotonic()
    assert log_window(cfg, 1, {"loss": 1.0}) is False
    assert log_events(cfg, [Event("hang", time.time(), 1, None, None, "hang: x")]) is False
    assert finish_tracking(cfg, {"final_loss": 1.0}, "FAILED") is False
    assert time.monotonic() - start < 15  # MLflow alone would retry for minutes


def test_without_mlflow_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now fails
    with pytest.raises(ConfigError, match=r"pip install 'ray_ddp\[mlflow\]'"):
        open_tracking("http://127.0.0.1:1", "run-x", {}, identity="a1")
