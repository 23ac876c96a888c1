"""--mlflow for a search: one MLflow run for the whole search, each trial's run nested
under it (MLflow's parentRunId), and the search's outcome logged on it at the end; with
--wandb, each trial's W&B run in the search's group. Runs on the driver of `ray-ddp tune`.

The search's MLflow run is found by an id of the search folder's own (``search.json``,
made at its first run), as a ray-ddp run's is by its run folder's: a search rerun after a
stop continues it, and a new folder of the same name is a new MLflow run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

from ray_ddp.record.status import new_run_id
from ray_ddp.trackers.mlflow import MlflowRun, finish_tracking, open_tracking
from ray_ddp.storage import read_json, write_json
from ray_ddp.tune.space import TuneConfig

SEARCH_FILE = "search.json"


def open_search_tracking(tc: TuneConfig, name: str, store, root: str) -> tuple[TuneConfig, Optional[MlflowRun]]:
    """The search's MLflow run (None without --mlflow), and the TuneConfig whose trials
    nest their runs under it."""
    if tc.train.get("wandb") and not tc.train.get("wandb_group"):  # W&B shows a search as a group
        tc = dataclasses.replace(tc, train={**tc.train, "wandb_group": name})
    uri = tc.train.get("mlflow")
    if not uri:
        return tc, None
    try:
        search_id = (read_json(store.fs, f"{root}/{SEARCH_FILE}") or {}).get("search_id")
    except ValueError:  # not JSON: the folder's id is made again
        search_id = None
    if not (isinstance(search_id, str) and search_id.isalnum()):
        search_id = new_run_id()
        store.fs.create_dir(root, recursive=True)
        write_json(store.fs, f"{root}/{SEARCH_FILE}", {"search_id": search_id})
    params = {"trials": tc.trials, "concurrent": tc.concurrent, "scheduler": tc.scheduler, "metric": tc.metric,
              "grace_epochs": tc.grace_epochs, "seed": tc.seed, "search": {k: list(v) for k, v in tc.search.items()}}
    tracking = open_tracking(uri, name, params, tc.train.get("mlflow_experiment") or "ray_ddp",
                             identity=search_id, location=root)
    return dataclasses.replace(tc, train={**tc.train, "mlflow_parent_run": tracking.run_id}), tracking


@contextlib.contextmanager
def tracked_search(tracking: Optional[MlflowRun], echo: Callable[[str], None]) -> Iterator[list]:
    """Around the search: the rows put in the list it gives are the search's outcome,
    logged on its MLflow run, which ends FINISHED, or FAILED / KILLED if the search
    raised. A server that did not take it is a warning: the search is in its folder."""
    rows: list[dict[str, Any]] = []
    status = "FAILED"
    try:
        yield rows
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if not close_search_tracking(tracking, rows, status):
            echo("warning: MLflow did not take all of the search's record (is the server up?); its "
                 "folder holds everything")


def close_search_tracking(tracking: Optional[MlflowRun], rows: list[dict[str, Any]], status: str) -> bool:
    """The best trial's validation loss and the trials' count on the search's MLflow run,
    ended with ``status``; False if the server did not take it."""
    if tracking is None:
        return True
    finished = [r for r in rows if r.get("val_loss") is not None]
    best = min(finished, key=lambda r: r["val_loss"]) if finished else None
    outcome = {"trials": len(rows), **({"best_val_loss": best["val_loss"], "best_trial": best["trial"]}
                                       if best else {})}
    return finish_tracking(tracking, outcome, status)
