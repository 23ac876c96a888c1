"""status.json: where a run stands (what ``ray-ddp runs`` shows). Runs on the driver.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional
from ray_ddp.config.train import TrainConfig
from ray_ddp.cluster.placement import PlacementConfig
from ray_ddp.driver.events import Event, from_records, to_records
from ray_ddp.run_folder import RunFolder
from ray_ddp.storage import StorageConfig, read_json, write_json


def read_events(store: StorageConfig, run_path: str) -> list[Event]:
    """The events status.json holds from earlier commands of the run."""
    try:
        return from_records((read_json(store.fs, RunFolder(run_path).status) or {}).get("events"))
    except ValueError:
        return []


def read_run_id(store: StorageConfig, run_path: str) -> Optional[str]:
    """The run folder's own id (status.json ``run_id``), or None: a new folder, or one
    written before run ids were kept."""
    try:
        run_id = (read_json(store.fs, RunFolder(run_path).status) or {}).get("run_id")
    except ValueError:
        return None
    return run_id if isinstance(run_id, str) and run_id.isalnum() else None


def new_run_id() -> str:
    return uuid.uuid4().hex


def write_status(store: StorageConfig, run_path: str, state: str, cfg: TrainConfig,
                 placement: PlacementConfig, error: Optional[str] = None,
                 stretches: Optional[list[dict[str, int]]] = None,
                 events: Optional[list[Event]] = None, run_id: Optional[str] = None) -> None:
    """status.json: what `ray-ddp runs` shows. ``created`` and ``run_id`` (the folder's
    own id, what tracking finds the run by: ``run_id`` given for a folder that has none
    yet) survive resumes, and so do
    the world-size stretches until a finished run gives new ones, and the events until
    new ones are given (every event of the run so far: driver/events.py). Reads nothing
    else, so a failure path can always write it."""
    path = RunFolder(run_path).status
    store.fs.create_dir(run_path, recursive=True)
    try:
        old = read_json(store.fs, path) or {}
    except ValueError:  # not JSON: start the record afresh
        old = {}
    now = time.time()
    stretches = old.get("world_sizes", []) if stretches is None else stretches
    write_json(store.fs, path, {
        "state": state, "run_id": old.get("run_id") or run_id, "created": old.get("created", now), "updated": now,
        "epochs": cfg.epochs, "world_size": stretches[-1]["world_size"] if stretches else placement.workers,
        "workers": cfg.workers, "world_sizes": stretches,
        "gpus_per_worker": placement.gpus_per_worker, "model": cfg.model, "error": error,
        "events": old.get("events", []) if events is None else to_records(events),
    })
