"""--mlflow against a real MLflow tracking server (sqlite store, artifacts served by the
server), read back with MlflowClient: params, metrics by step, the same run on resume, a
changed param as a tag, events, the model artifact and the end status. No Ray, but a
server: the slow lane (tests/unit has the dead-server cases)."""

from __future__ import annotations

import json

import pytest

from mlflow.tracking import MlflowClient  # the test extra installs it (ray_ddp[mlflow])

from ray_ddp.record.events import Event
from ray_ddp.trackers.mlflow import finish_tracking, log_events, log_window, open_tracking

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def server(mlflow_uri):
    """The suite's tracking server (conftest.py), shared with test_hangs.py."""
    return mlflow_uri


PARAMS = {"lr": 0.001, "batch_size": 32, "optimizer": {"name": "adamw", "betas": (0.9, 0.95)},
          "resume_from": None, "note": "x" * 7000}


def test_params_metrics_and_resume(server):
    client = MlflowClient(tracking_uri=server)
    cfg = open_tracking(server, "run-a", PARAMS, experiment="unit", identity="aaa1", location="/runs/run-a")
    run = client.get_run(cfg.run_id)
    assert run.info.run_name == "run-a" and run.data.tags["ray_ddp.run"] == "run-a"
    assert (run.data.tags["ray_ddp.run_id"], run.data.tags["ray_ddp.location"], cfg.logged_until) == \
        ("aaa1", "/runs/run-a", 0)
    params = run.data.params
    assert params["lr"] == "0.001" and params["batch_size"] == "32"
    assert params["optimizer.name"] == "adamw" and params["optimizer.betas"] == "(0.9, 0.95)"
    assert "resume_from" not in params and len(params["note"]) == 6000  # cut to MLflow's limit

    assert log_window(cfg, 10, {"loss": 2.5, "samples_per_s": 100.0, "lr": 1e-3,
                                "val_loss": None, "bad": float("nan")})
    assert log_window(cfg, 20, {"loss": 2.0, "samples_per_s": 110.0, "lr": 9e-4})
    history = [(m.step, m.value) for m in client.get_metric_history(cfg.run_id, "loss")]
    assert sorted(history) == [(10, 2.5), (20, 2.0)]
    assert "val_loss" not in run.data.metrics and "bad" not in client.get_run(cfg.run_id).data.metrics

    # a resumed ray-ddp run continues the same MLflow run; the changed param is a tag
    client.set_terminated(cfg.run_id, status="FAILED")
    again = open_tracking(server, "run-a", dict(PARAMS, lr=0.01, epochs=3), experiment="unit", identity="aaa1")
    assert again.run_id == cfg.run_id and again.logged_until == 20  # steps up to 20 are not logged again
    run = client.get_run(cfg.run_id)
    assert run.info.status == "RUNNING"
    assert run.data.params["lr"] == "0.001" and run.data.params["epochs"] == "3"
    assert run.data.tags["ray_ddp.param_changed.lr"] == "was 0.001, now 0.01"
    assert log_window(again, 30, {"loss": 1.5})
    assert [m.step for m in client.get_metric_history(cfg.run_id, "loss")] == [10, 20, 30]

    other = open_tracking(server, "run-b", PARAMS, experiment="unit", identity="bbb2")
    assert other.run_id != cfg.run_id and other.experiment_id == cfg.experiment_id
    # the same name in another folder (another --storage, a folder made again, another
    # search's trial-0) is another ray-ddp run, and another MLflow run
    namesake = open_tracking(server, "run-a", PARAMS, experiment="unit", identity="ccc3", location="/other/run-a")
    assert namesake.run_id not in (cfg.run_id, other.run_id) and namesake.logged_until == 0


def test_events_and_finish(server, tmp_path):
    client = MlflowClient(tracking_uri=server)
    cfg = open_tracking(server, "run-events", {"lr": 0.1}, experiment="unit", identity="ddd4")
    events = [
        Event("failure", 1_700_000_000.0, 5, 1, "n1", "worker died", "step-00000004", 1, True),
        Event("preemption", 1_700_000_100.0, 9, None, "n2", "spot", "step-00000008", 1, True),
        Event("failure", 1_700_000_200.0, 12, 0, "n1", "oom", "step-00000012", 0, True),
    ]
    assert log_events(cfg, events)
    failures = client.get_metric_history(cfg.run_id, "events.failure")
    assert sorted((m.step, m.value) for m in failures) == [(5, 1.0), (12, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(cfg.run_id, "events.preemption")] == [(9, 1.0)]
    assert json.loads(client.get_run(cfg.run_id).data.tags["ray_ddp.events"]) == [e.to_dict() for e in events]

    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    summary = {"final_loss": 0.5, "samples_per_s": 1234.5, "epochs_completed": 2,
               "val_loss": None, "early_stopped": True, "name": "run-events"}
    assert finish_tracking(cfg, summary, "FINISHED", model_file=str(model))
    run = client.get_run(cfg.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["summary.final_loss"] == 0.5 and run.data.metrics["summary.epochs_completed"] == 2
    assert not {"summary.val_loss", "summary.early_stopped", "summary.name"} & set(run.data.metrics)
    assert [a.path for a in client.list_artifacts(cfg.run_id, "model")] == ["model/model.pt"]
