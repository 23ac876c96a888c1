"""The checkpoints a run folder holds, and which of them it keeps: with ``--keep-best``, the newest ``--keep`` and the
one with the lowest validation loss (Ray keeps the newest alone). Runs in Ray Train's
controller (the metrics callback) and on the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ray_ddp.record.names import checkpoint_dir_name
from ray_ddp.record.folder import RunFolder

if TYPE_CHECKING:  # verify.py lists the folders with checkpoint_names, below
    from ray_ddp.checkpoint.verify import CheckpointScan


def best_checkpoint(names: list[str], evals: list[dict[str, Any]]) -> Optional[str]:
    """The checkpoint folder, among ``names``, whose validation loss was the lowest."""
    scored = [(r["loss"], checkpoint_dir_name(r["step"])) for r in evals
              if checkpoint_dir_name(r["step"]) in names and r["loss"] == r["loss"]]
    return min(scored)[1] if scored else None


def checkpoint_names(folder: RunFolder) -> list[str]:
    """The run folder's checkpoint folders (``step-*``), oldest first; none if the run
    has no folder yet."""
    from pyarrow.fs import FileSelector, FileType

    return sorted(i.base_name for i in folder.fs.get_file_info(FileSelector(folder.path, allow_not_found=True))
                  if i.type == FileType.Directory and i.base_name.startswith("step-"))


def prune_checkpoints(folder: RunFolder, keep: int, evals: list[dict[str, Any]]) -> None:
    """--keep-best: keep the newest ``keep`` checkpoints of the run folder and the best
    one, delete the rest."""
    names = checkpoint_names(folder)
    kept = set(names[-keep:]) | {best_checkpoint(names, evals)}
    for name in names:
        if name not in kept:
            folder.fs.delete_dir(f"{folder.path}/{name}")


def drop_unfinished(folder: RunFolder, scan: CheckpointScan) -> CheckpointScan:
    """Delete the scan's checkpoint folders whose write never reached its meta.json (no
    process of the run is writing: between fits, or before the first), and return the scan
    without them. They never held a checkpoint; left in place, one would count as the
    run's newest folder (a restart takes Ray's checkpoint only when newer than that, so
    not the same step written again; --keep-best keeps the newest folders)."""
    for name in scan.unfinished:
        folder.fs.delete_dir(f"{folder.path}/{name}")
    return scan.without_unfinished()
