"""``--mlflow URI``: the run's config, metrics, events and final model in an MLflow
tracking server. Runs on the driver (open, events, finish) and in Ray Train's controller
actor (the metrics windows); workers never talk to the server. ``MlflowTracker`` is the
tracker (trackers/base.py); the functions are also `ray-ddp tune`'s, for a search's run.

MlflowClient by run id, never mlflow.start_run: the run's state is global to one process,
and two processes write to this run. mlflow is an optional extra, imported only here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional
from ray_ddp.record.events import Event
from ray_ddp.errors import ConfigError
from ray_ddp.trackers.base import Tracker, Window

RUN_TAG = "ray_ddp.run"  # the run's name, for people reading the MLflow UI
# What finds the MLflow run of a ray-ddp run again on resume: the run folder's own id
# (status.json ``run_id``), never the name, which other folders (another --storage, a
# folder deleted and made again, another search's trial-0) share.
RUN_ID_TAG = "ray_ddp.run_id"
LOCATION_TAG = "ray_ddp.location"  # the run folder's URI
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI shows the run under that one
# MLflow's own limits (mlflow/utils/validation.py), kept here so a value over them is cut
# rather than refused.
MAX_PARAM_VALUE, MAX_TAG_VALUE, PARAMS_PER_BATCH = 6000, 8000, 100
# MLflow retries a failed request 7 times with backoff (minutes) and waits 120 s for an
# answer by default; a run must not stall on a dead server. These are read per request, so
# setting them in this process is enough; a value the user set is kept.
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
INSTALL_HINT = "--mlflow needs the mlflow package: pip install 'ray_ddp[mlflow]'"


@dataclass(frozen=True)
class MlflowRun:
    """An MLflow run (found or made) and how far its metrics go; travels to Ray Train's
    controller actor."""

    uri: str
    run_id: str
    experiment_id: str
    logged_until: int = 0  # the last step already logged (an earlier command's): not logged again


@functools.lru_cache(maxsize=4)
def _client(uri: str):
    """One client per URI per process (a sqlite store checks its schema when opened)."""
    for key, value in HTTP_ENV.items():
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:600]  # long enough for MLflow's advice at the end of its messages


def check_server(uri: str) -> None:
    """A dead http(s) server fails in seconds here, not after MLflow's retries."""
    if not uri.startswith(("http://", "https://")):
        return  # file: and database URIs are checked by opening them
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5).close()
    except urllib.error.HTTPError:
        pass  # something answered; whether it is MLflow the first real request tells
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"--mlflow {uri} cannot be reached ({_one_line(reason)}): check that "
                          "the MLflow server runs there and that this machine can reach it") from None


def flatten_params(params: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys; values as text, cut to MLflow's limit; None left out."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            flat.update(flatten_params(value, f"{prefix}{key}."))
        elif value is not None:
            flat[f"{prefix}{key}"] = str(value)[:MAX_PARAM_VALUE]
    return flat


def open_tracking(uri: str, run_name: str, params: dict, experiment: str = "ray_ddp", *,
                  identity: str, location: str = "", parent: Optional[str] = None) -> MlflowRun:
    """Find (by ``identity``, the run folder's own id) or create the experiment and this
    run's MLflow run (the same one on resume), nested under MLflow run ``parent`` if
    given, and log the config as params. One-line ConfigError when mlflow or the server
    is missing."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    check_server(uri)
    from mlflow.entities import Param

    try:
        client = _client(uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            experiment_id = client.create_experiment(experiment)
        elif exp.lifecycle_stage == "deleted":
            raise ConfigError(f"--mlflow {uri}: experiment '{experiment}' is deleted; restore it "
                              f"(mlflow experiments restore --experiment-id {exp.experiment_id})")
        else:
            experiment_id = exp.experiment_id
        # the identity is a hex string ray_ddp made (record/status.py): safe inside quotes
        found = client.search_runs([experiment_id], f"tags.`{RUN_ID_TAG}` = '{identity}'",
                                   max_results=1, order_by=["attributes.start_time DESC"])
        logged_until = 0
        if found:
            run = found[0]
            client.update_run(run.info.run_id, status="RUNNING")  # a resume continues it
            logged_until = _logged_until(client, run.info.run_id)
        else:
            tags = {RUN_TAG: run_name, RUN_ID_TAG: identity, LOCATION_TAG: location,
                    **({PARENT_TAG: parent} if parent else {})}
            run = client.create_run(experiment_id, run_name=run_name, tags=tags)
        log_params(client, run.info.run_id, run.data.params, flatten_params(params), Param)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--mlflow {uri}: the tracking server refused the run "
                          f"({type(e).__name__}: {_one_line(e)}); check the URI and the server's log") from None
    return MlflowRun(uri=uri, run_id=run.info.run_id, experiment_id=experiment_id, logged_until=logged_until)


def _logged_until(client, run_id: str) -> int:
    """The last step of the run's loss history on the server (0: none)."""
    return max((m.step for m in client.get_metric_history(run_id, "loss")), default=0)


def resume_tracking(tracking: MlflowRun) -> MlflowRun:
    """``tracking`` with the steps logged so far read back from the server, for a fit's
    controller: the previous fit's controller advanced ``logged_until`` in a process that
    is gone (a driver-level restart: an elastic resize, a forgiven preemption), and its
    redone steps must not be logged twice. Unchanged if the server does not answer (the
    controller's first failed log then turns tracking off, as mid-run)."""
    try:
        return dataclasses.replace(tracking, logged_until=max(tracking.logged_until,
                                                              _logged_until(_client(tracking.uri), tracking.run_id)))
    except Exception:  # the server's or the client's: never the fit's end
        return tracking


def log_params(client, run_id: str, logged: dict[str, str], params: dict[str, str], Param) -> None:
    """Only the params not yet on the run: MLflow refuses to overwrite one, so a value that
    changed on resume becomes a tag instead."""
    new = [Param(k, v) for k, v in params.items() if k not in logged]
    for i in range(0, len(new), PARAMS_PER_BATCH):
        client.log_batch(run_id, params=new[i:i + PARAMS_PER_BATCH])
    for key, value in params.items():
        if key in logged and logged[key] != value:
            client.set_tag(run_id, f"ray_ddp.param_changed.{key}",
                           f"was {logged[key]}, now {value}"[:MAX_TAG_VALUE])


def _finite(value: Any) -> Optional[float]:
    """A number MLflow can chart; None, flags, text, NaN and infinities are left out."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def log_window(cfg: MlflowRun, step: int, metrics: dict[str, float]) -> bool:
    """One rank-aggregated window as metrics at ``step``, in one request. False (never an
    exception) when it failed: the caller warns once and stops."""
    try:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, int(step)) for k, raw in metrics.items()
                 if (v := _finite(raw)) is not None]
        if batch:
            _client(cfg.uri).log_batch(cfg.run_id, metrics=batch)
        return True
    except Exception:
        return False


def log_events(cfg: MlflowRun, events: list[Event]) -> bool:
    """Failures, hangs, preemptions and resizes: a count per type at each one's step (they
    show on MLflow's charts) and the list as JSON in tag ray_ddp.events. False on failure."""
    try:
        from mlflow.entities import Metric

        counts: dict[str, int] = {}
        batch = []
        for e in events:
            counts[e.type] = counts.get(e.type, 0) + 1
            stamp = int(float(e.time or time.time()) * 1000)
            batch.append(Metric(f"events.{e.type}", counts[e.type], stamp, int(e.step or 0)))
        client = _client(cfg.uri)
        for i in range(0, len(batch), 1000):  # MLflow's limit of metrics per request
            client.log_batch(cfg.run_id, metrics=batch[i:i + 1000])
        # the first events that fit, so the tag stays valid JSON under MLflow's limit
        kept = [e.to_dict() for e in events]
        text = json.dumps(kept, separators=(",", ":"), default=str)
        while len(text) > MAX_TAG_VALUE and kept:
            kept.pop()
            text = json.dumps(kept, separators=(",", ":"), default=str)
        client.set_tag(cfg.run_id, "ray_ddp.events", text)
        return True
    except Exception:
        return False


def finish_tracking(cfg: MlflowRun, summary: dict, status: str,
                    model_file: Optional[str] = None) -> bool:
    """The summary's numbers as summary.* metrics, the model as artifact model/<file>, and the
    run ended with ``status`` (FINISHED, FAILED, KILLED). Each part is tried even when an
    earlier one failed, so the run is never left RUNNING; False when any failed."""
    ok = True
    try:
        from mlflow.entities import Metric

        client = _client(cfg.uri)
        now = int(time.time() * 1000)
        batch = [Metric(f"summary.{k}", v, now, 0) for k, raw in summary.items()
                 if (v := _finite(raw)) is not None]
        if batch:
            client.log_batch(cfg.run_id, metrics=batch)
    except Exception:
        ok = False
    if model_file is not None:
        try:
            _client(cfg.uri).log_artifact(cfg.run_id, model_file, artifact_path="model")
        except Exception:
            ok = False
    try:
        _client(cfg.uri).set_terminated(cfg.run_id, status=status)
    except Exception:
        ok = False
    return ok


# what each window logs: the figures over ranks a chart of the run wants
WINDOW_FIGURES = ("loss", "samples_per_s", "accuracy", "perplexity", "val_loss", "val_accuracy", "val_perplexity")


class MlflowTracker(Tracker):
    """--mlflow as a tracker: windows from the controller, events and summary at the end."""

    def __init__(self, run: MlflowRun):
        self.run = run
        self.label = f"MLflow at {run.uri}"

    def resume(self) -> "MlflowTracker":
        return MlflowTracker(resume_tracking(self.run))

    def log_window(self, window: Window) -> None:
        if window.step <= self.run.logged_until:  # redone after a restart, or logged by an earlier command
            return
        figures = {k: window.figures.get(k) for k in WINDOW_FIGURES}
        if not log_window(self.run, window.step, {**figures, "lr": window.rows[0].get("lr")}):
            raise ConnectionError(self.label)
        self.run = dataclasses.replace(self.run, logged_until=window.step)

    def finish(self, summary: dict[str, Any], events: list[Event], status: str,
               model_file: Optional[str], fit_over: bool = True) -> None:
        ok = log_events(self.run, events) if events else True
        if not (finish_tracking(self.run, summary, status, model_file) and ok):
            raise ConnectionError(self.label)


def open_mlflow(cfg, options: dict[str, Any], identity: str, location: str) -> MlflowTracker:
    """The run's MLflow run (the same one a resume of this run folder continues, found by
    the folder's ``identity``), its params ``options``: every option as resolved for this
    cluster (RunPlan.resolved_options)."""
    return MlflowTracker(open_tracking(cfg.mlflow, cfg.name, options, cfg.mlflow_experiment,
                                       identity=identity, location=location, parent=cfg.mlflow_parent_run))
