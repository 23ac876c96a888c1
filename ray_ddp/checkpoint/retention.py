"""Which checkpoints a run keeps: with ``--keep-best``, the newest ``--keep`` and the
one with the lowest validation loss (Ray keeps the newest alone). Runs in Ray Train's
controller (the metrics callback) and on the driver.
"""

from __future__ import annotations

from typing import Any, Optional

from ray_ddp.checkpoint.names import checkpoint_dir_name


def best_checkpoint(names: list[str], evals: list[dict[str, Any]]) -> Optional[str]:
    """The checkpoint folder, among ``names``, whose validation loss was the lowest."""
    scored = [(r["loss"], checkpoint_dir_name(r["step"])) for r in evals
              if checkpoint_dir_name(r["step"]) in names and r["loss"] == r["loss"]]
    return min(scored)[1] if scored else None


def prune_checkpoints(fs, run_path: str, keep: int, evals: list[dict[str, Any]]) -> None:
    """--keep-best: keep the newest ``keep`` checkpoints and the best one, delete the rest."""
    from pyarrow.fs import FileSelector, FileType

    names = sorted(i.base_name for i in fs.get_file_info(FileSelector(run_path))
                   if i.type == FileType.Directory and i.base_name.startswith("step-"))
    kept = set(names[-keep:]) | {best_checkpoint(names, evals)}
    for name in names:
        if name not in kept:
            fs.delete_dir(f"{run_path}/{name}")
