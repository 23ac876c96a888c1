"""status.json: where a run stands (what ``ray-ddp runs`` shows). Runs on the driver.
"""

from __future__ import annotations

import time
from typing import Any, Optional
from ray_ddp.config.train import TrainConfig
from ray_ddp.cluster.placement import PlacementConfig
from ray_ddp.storage import STATUS_FILE, StorageConfig, read_json, write_json


def read_events(store: StorageConfig, run_path: str) -> list[dict[str, Any]]:
    """The events status.json holds from earlier commands of the run."""
    try:
        return (read_json(store.fs, f"{run_path}/{STATUS_FILE}") or {}).get("events") or []
    except ValueError:
        return []


def write_status(store: StorageConfig, run_path: str, state: str, cfg: TrainConfig,
                 placement: PlacementConfig, error: Optional[str] = None,
                 stretches: Optional[list[dict[str, int]]] = None,
                 events: Optional[list[dict[str, Any]]] = None) -> None:
    """status.json: what `ray-ddp runs` shows. ``created`` survives resumes, and so do
    the world-size stretches until a finished run gives new ones, and the events until
    new ones are given (every event of the run so far: driver/events.py). Reads nothing
    else, so a failure path can always write it."""
    path = f"{run_path}/{STATUS_FILE}"
    store.fs.create_dir(run_path, recursive=True)
    try:
        old = read_json(store.fs, path) or {}
    except ValueError:  # not JSON: start the record afresh
        old = {}
    now = time.time()
    stretches = old.get("world_sizes", []) if stretches is None else stretches
    write_json(store.fs, path, {
        "state": state, "created": old.get("created", now), "updated": now,
        "epochs": cfg.epochs, "world_size": stretches[-1]["world_size"] if stretches else placement.workers,
        "workers": cfg.workers, "world_sizes": stretches,
        "gpus_per_worker": placement.gpus_per_worker, "model": cfg.model, "error": error,
        "events": old.get("events", []) if events is None else events,
    })
