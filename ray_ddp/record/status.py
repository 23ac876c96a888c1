"""status.json: where a run stands (what ``ray-ddp runs`` shows). Runs on the driver.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Optional
from ray_ddp.record.events import Event, from_records, to_records
from ray_ddp.record.folder import RunFolder, Status
from ray_ddp.storage import read_json, write_json

if TYPE_CHECKING:  # names only: the record imports neither the plan (which carries a RunFolder)
    from ray_ddp.cluster.placement import Placement  # nor the cluster's code
    from ray_ddp.plan import RunPlan


def read_status(folder: RunFolder) -> Optional[Status]:
    """The run's status.json, or None: no such file, or one that is not a status (not
    JSON, no state). A storage that cannot be read raises StorageError."""
    try:
        return Status.from_dict(read_json(folder.fs, folder.status))
    except ValueError:
        return None


def read_events(folder: RunFolder) -> list[Event]:
    """The events status.json holds from earlier commands of the run."""
    status = read_status(folder)
    return from_records(status.events) if status else []


def read_run_id(folder: RunFolder) -> Optional[str]:
    """The run folder's own id (status.json ``run_id``), or None: a new folder, or one
    written before run ids were kept."""
    run_id = status.run_id if (status := read_status(folder)) else None
    return run_id if isinstance(run_id, str) and run_id.isalnum() else None


def new_run_id() -> str:
    return uuid.uuid4().hex


def write_status(folder: RunFolder, state: str, run: RunPlan,
                 placement: Placement, error: Optional[str] = None,
                 stretches: Optional[list[dict[str, int]]] = None,
                 events: Optional[list[Event]] = None, run_id: Optional[str] = None) -> None:
    """status.json: what `ray-ddp runs` shows. ``created`` and ``run_id`` (the folder's
    own id, what tracking finds the run by: ``run_id`` given for a folder that has none
    yet) survive resumes, and so do
    the world-size stretches until a finished run gives new ones, and the events until
    new ones are given (every event of the run so far: record/events.py). Reads nothing
    else, so a failure path can always write it."""
    cfg = run.config
    folder.fs.create_dir(folder.path, recursive=True)
    old = read_status(folder) or Status(state)  # not a status: start the record afresh
    now = time.time()
    stretches = old.world_sizes if stretches is None else stretches
    status = Status(
        state=state, run_id=old.run_id or run_id, created=old.created or now, updated=now, epochs=cfg.epochs,
        world_size=stretches[-1]["world_size"] if stretches else placement.workers, workers=run.workers,
        world_sizes=stretches, gpus_per_worker=placement.gpus_per_worker, model=cfg.model, error=error,
        events=old.events if events is None else to_records(events))
    write_json(folder.fs, folder.status, status.to_dict())
