"""`ray-ddp runs` and `ray-ddp report`: find runs afterwards and look at them.

Runs on the driver (any machine that reaches the storage), reading only what runs left
in storage: ``status.json`` (written by the driver), ``progress.json`` and
``metrics.parquet`` (written by the metrics callback) and the checkpoints' meta.json.
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Optional

from .checkpoint import find_latest_checkpoint
from .config import ConfigError
from .storage import (EVAL_FILE, METRICS_FILE, PROGRESS_FILE, STATUS_FILE, StorageConfig, StorageError,
                      read_json, read_table, resolve_storage)

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


def describe_run(store: StorageConfig, name: str, now: float) -> Optional[RunListing]:
    run_path = store.run_path(name)
    try:
        status = read_json(store.fs, f"{run_path}/{STATUS_FILE}")
    except (ValueError, StorageError):
        return None  # not a status ray_ddp wrote (it writes them whole), or unreadable
    if status is None:
        return None  # not a ray_ddp run folder
    try:
        progress = read_json(store.fs, f"{run_path}/{PROGRESS_FILE}") or {}
    except (ValueError, StorageError):
        progress = {}  # the listing shows what it can
    scan = find_latest_checkpoint(store.fs, run_path)
    state = status["state"]
    last_seen = max(status.get("updated", 0), progress.get("time", 0))
    if state == "running" and now - last_seen > LOST_AFTER_S:
        state = "lost"
    return RunListing(
        name=name, state=state, epochs_done=(scan.meta or {}).get("epoch", 0),
        epochs=status.get("epochs"), last_loss=progress.get("loss"), checkpoint=scan.latest,
        world_size=status.get("world_size"), started=status.get("created"),
    )


def format_runs(listings: list[RunListing]) -> str:
    header = ("run", "state", "epochs", "last loss", "checkpoint", "world", "started")
    rows = [header] + [(
        r.name, r.state, f"{r.epochs_done}/{r.epochs if r.epochs is not None else '?'}",
        "-" if r.last_loss is None else f"{r.last_loss:.4f}", r.checkpoint or "-",
        str(r.world_size or "-"),
        "-" if r.started is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started)),
    ) for r in listings]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def runs_as_dicts(listings: list[RunListing]) -> list[dict[str, Any]]:
    return [asdict(r) for r in listings]


# ----------------------------------------------------------------------------- report
@dataclass
class ReportSummary:
    """What `ray-ddp report` found: the slowest rank and where the plots went."""

    run: str
    ranks: int
    steps: int
    final_loss: float
    slowest_rank: int
    slowest_step_time_s: float
    median_step_time_s: float
    files: list[str]

    def text(self) -> str:
        ratio = self.slowest_step_time_s / self.median_step_time_s if self.median_step_time_s else 1.0
        return (f"run {self.run}: {self.ranks} ranks, {self.steps} steps, final loss "
                f"{self.final_loss:.4f}\nslowest rank: {self.slowest_rank} "
                f"({self.slowest_step_time_s:.4f} s of own work per report on average, "
                f"{ratio:.2f}x the median rank's {self.median_step_time_s:.4f} s)")


def write_report(storage: str, name: str, out: Optional[str] = None) -> ReportSummary:
    """Draw loss, samples/s and step-time plots of a run as PNGs, plus report.txt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    store = resolve_storage(storage)
    run_path = store.run_path(name)
    table = read_table(store.fs, f"{run_path}/{METRICS_FILE}")
    if table is None or table.num_rows == 0:
        raise ConfigError(f"run {name} has no {METRICS_FILE} under {store.uri}; "
                          "check the run name and --storage (ray-ddp runs lists them)")
    rows = table.to_pylist()
    steps = sorted({r["step"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    by_rank = {k: sorted((r for r in rows if r["rank"] == k), key=lambda r: r["step"]) for k in ranks}

    out_path, out_fs = _report_target(store, name, out)
    files = []

    def save(fig, filename):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        target = f"{out_path}/{filename}"
        with out_fs.open_output_stream(target) as f:
            f.write(buf.getvalue())
        files.append(target)

    from .metrics import rank_mean

    at_step = [[r for r in rows if r["step"] == s] for s in steps]
    # a rank with no rows in a window has a NaN loss: it takes no part in the band either
    losses = [[r["loss"] for r in v if r["loss"] == r["loss"]] or [float("nan")] for v in at_step]
    means = [rank_mean(v, "loss") for v in at_step]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [float("nan") if m is None else m for m in means], label="mean over ranks")
    ax.fill_between(steps, [min(v) for v in losses], [max(v) for v in losses], alpha=0.3,
                    label="min-max over ranks")
    evals = read_table(store.fs, f"{run_path}/{EVAL_FILE}")
    if evals is not None and evals.num_rows:  # validation beside training
        ax.plot(evals.column("step").to_pylist(), evals.column("loss").to_pylist(), "o-",
                label="validation")
    ax.set(xlabel="step", ylabel="loss", title=f"{name}: training and validation loss"
           if evals is not None else f"{name}: training loss")
    ax.legend()
    save(fig, "loss.png")
    for column, ylabel, filename in (
            ("samples_per_s", "samples/s", "samples_per_s.png"),
            ("step_time_s", "seconds per report (wall)", "step_time.png"),
            ("busy_s", "seconds of own work per report (data + forward)", "busy_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in ranks:
            ax.plot([r["step"] for r in by_rank[k]], [r[column] for r in by_rank[k]], label=f"rank {k}")
        ax.set(xlabel="step", ylabel=ylabel, title=f"{name}: {ylabel} per rank")
        ax.legend()
        save(fig, filename)

    # DDP makes every rank wait for the slowest in the all-reduce, so wall time per step is
    # the same everywhere; a rank's own work time (busy_s) is what tells the slow one.
    mean_time = {k: sum(r["busy_s"] for r in by_rank[k]) / len(by_rank[k]) for k in ranks}
    slowest = max(ranks, key=lambda k: mean_time[k])
    summary = ReportSummary(
        run=name, ranks=len(ranks), steps=steps[-1], final_loss=float("nan") if means[-1] is None else means[-1],
        slowest_rank=slowest, slowest_step_time_s=mean_time[slowest],
        median_step_time_s=median(mean_time.values()), files=files,
    )
    with out_fs.open_output_stream(f"{out_path}/report.txt") as f:
        f.write((summary.text() + "\n").encode())
    files.append(f"{out_path}/report.txt")
    return summary


def _report_target(store: StorageConfig, name: str, out: Optional[str]):
    """``--out DIR`` (a path or URI), else ``<run>/report/`` next to the run's metrics."""
    target = resolve_storage(out) if out else None
    fs = target.fs if target else store.fs
    path = target.path if target else f"{store.run_path(name)}/report"
    fs.create_dir(path, recursive=True)
    return path, fs
