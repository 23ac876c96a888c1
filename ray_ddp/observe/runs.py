"""``ray-ddp runs``: every run in a storage, its state and where it stands. Runs on the
driver.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Optional
from ray_ddp.checkpoint.verify import find_latest_checkpoint
from ray_ddp.errors import ConfigError
from ray_ddp.record.events import count_restarts, from_records
from ray_ddp.record.status import read_status
from ray_ddp.record.progress import read_progress
from ray_ddp.record.folder import Progress, run_folder
from ray_ddp.storage import Storage, resolve_storage
from ray_ddp.errors import StorageError


# A run whose driver said "running" but that has reported nothing for this long is shown
# as "lost": its driver died without saying so (SIGKILL, a lost machine).
LOST_AFTER_S = 600


@dataclass
class RunListing:
    """One row of `ray-ddp runs`."""

    name: str
    state: str
    epochs_done: int
    epochs: Optional[int]
    last_loss: Optional[float]
    checkpoint: Optional[str]
    world_size: Optional[int]
    started: Optional[float]
    restarts: int = 0  # worker-group restarts: failures and preemptions it went on from


def list_runs(storage: str, now: Optional[float] = None) -> list[RunListing]:
    from pyarrow.fs import FileSelector, FileType

    store = resolve_storage(storage)
    try:
        infos = store.fs.get_file_info(FileSelector(store.path, allow_not_found=True))
    except OSError as err:
        raise ConfigError(f"cannot list --storage {storage}: {err}") from None
    now = time.time() if now is None else now
    listings = []
    for info in sorted(infos, key=lambda i: i.base_name):
        if info.type != FileType.Directory:
            continue
        listing = describe_run(store, info.base_name, now)
        if listing is not None:
            listings.append(listing)
    return listings


def describe_run(store: Storage, name: str, now: float) -> Optional[RunListing]:
    folder = run_folder(store, name)
    try:
        status = read_status(folder)
    except StorageError:
        return None  # unreadable
    if status is None:
        return None  # not a ray_ddp run folder, or not a status ray_ddp wrote (it writes them whole)
    try:
        progress = read_progress(folder) or Progress(0.0)
    except StorageError:
        progress = Progress(0.0)  # the listing shows what it can
    scan = find_latest_checkpoint(folder)
    state = status.state
    last_seen = max(status.updated or 0, progress.time)
    if state == "running" and now - last_seen > LOST_AFTER_S:
        state = "lost"
    return RunListing(
        name=name, state=state, epochs_done=(scan.meta or {}).get("epoch", 0),
        epochs=status.epochs, last_loss=progress.loss, checkpoint=scan.latest,
        world_size=status.world_size, started=status.created,
        restarts=count_restarts(from_records(status.events)),
    )


def format_runs(listings: list[RunListing]) -> str:
    header = ("run", "state", "epochs", "last loss", "checkpoint", "world", "restarts", "started")
    rows = [header] + [(
        r.name, r.state, f"{r.epochs_done}/{r.epochs if r.epochs is not None else '?'}",
        "-" if r.last_loss is None else f"{r.last_loss:.4f}", r.checkpoint or "-",
        str(r.world_size or "-"), str(r.restarts),
        "-" if r.started is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started)),
    ) for r in listings]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def runs_as_dicts(listings: list[RunListing]) -> list[dict[str, Any]]:
    return [asdict(r) for r in listings]
