"""``ray-ddp report``: plots of a run's loss, throughput and step times per rank, and
report.txt. Runs on the driver.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, Optional
from ray_ddp.errors import ConfigError
from ray_ddp.record.events import Event, where_restarted
from ray_ddp.record.status import read_events
from ray_ddp.record.folder import METRICS_FILE, run_folder
from ray_ddp.storage import Storage, read_table, resolve_storage
from ray_ddp.record.metrics_table import read_metrics
from ray_ddp.record.schema import rank_mean


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
    events: list[Event] = field(default_factory=list)  # status.json's, marked on the loss plot

    def text(self) -> str:
        """The run, its slowest rank and its restarts, as report.txt and `ray-ddp report` say them."""
        ratio = self.slowest_step_time_s / self.median_step_time_s if self.median_step_time_s else 1.0
        lines = [f"run {self.run}: {self.ranks} ranks, {self.steps} steps, final loss {self.final_loss:.4f}",
                 f"slowest rank: {self.slowest_rank} ({self.slowest_step_time_s:.4f} s of own work per "
                 f"report on average, {ratio:.2f}x the median rank's {self.median_step_time_s:.4f} s)"]
        for e in self.events:
            where = f" rank {e.rank}" if e.rank is not None else ""
            then = f"; {where_restarted(e)}" if where_restarted(e) else ""
            lines.append(f"{e.type} at step {e.step}:{where} {e.cause}{then}")
        return "\n".join(lines)


def write_report(storage: str, name: str, out: Optional[str] = None) -> ReportSummary:
    """Draw loss, samples/s and step-time plots of a run as PNGs, plus report.txt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    store = resolve_storage(storage)
    rows = _read_rows(store, name)
    steps = sorted({r["step"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    by_rank = {k: sorted((r for r in rows if r["rank"] == k), key=lambda r: r["step"]) for k in ranks}

    out_path, out_fs, out_uri = _report_target(store, name, out)  # out_uri: a file's name -> its URI
    files = []  # as URIs the user can open (observe/report.py's caller prints them)

    def save(fig, filename):
        """Write ``fig`` as the PNG ``filename`` beside the report, and close it."""
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        target = f"{out_path}/{filename}"
        with out_fs.open_output_stream(target) as f:
            f.write(buf.getvalue())
        files.append(out_uri(filename))

    means, events = _plot_loss(plt, save, store, name, rows, steps)
    _plot_per_rank(plt, save, name, ranks, by_rank)
    summary = _summarize(name, steps, by_rank, means, files, events)
    with out_fs.open_output_stream(f"{out_path}/report.txt") as f:
        f.write((summary.text() + "\n").encode())
    files.append(out_uri("report.txt"))
    return summary


def _read_rows(store: Storage, name: str) -> list[dict]:
    """The run's metrics rows; a run with none is the user's mistake, in one line."""
    table = read_metrics(run_folder(store, name))
    if table is None or table.num_rows == 0:
        raise ConfigError(f"run {name} has no {METRICS_FILE} under {store.uri}; "
                          "check the run name and --storage (ray-ddp runs lists them)")
    return table.to_pylist()


def _plot_loss(plt: Any, save: Callable[[Any, str], None], store: Storage, name: str,
               rows: list[dict], steps: list[int]) -> tuple[list[Optional[float]], list[Event]]:
    """loss.png: the mean over ranks with its min-max band, validation beside it, and the
    run's events marked; returns the mean loss at each step and the events."""
    at_step = [[r for r in rows if r["step"] == s] for s in steps]
    # a rank with no rows in a window has a NaN loss: it takes no part in the band either
    losses = [[r["loss"] for r in v if r["loss"] == r["loss"]] or [float("nan")] for v in at_step]
    means = [rank_mean(v, "loss") for v in at_step]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [float("nan") if m is None else m for m in means], label="mean over ranks")
    ax.fill_between(steps, [min(v) for v in losses], [max(v) for v in losses], alpha=0.3,
                    label="min-max over ranks")
    evals = read_table(store.fs, run_folder(store, name).evals)
    if evals is not None and evals.num_rows:  # validation beside training
        ax.plot(evals.column("step").to_pylist(), evals.column("loss").to_pylist(), "o-",
                label="validation")
    ax.set(xlabel="step", ylabel="loss", title=f"{name}: training and validation loss"
           if evals is not None else f"{name}: training loss")
    events = _events_of(store, name)
    labelled: set[str] = set()
    for event in (e for e in events if e.step is not None):
        ax.axvline(event.step, color="red" if event.type in ("failure", "hang") else "gray",
                   linestyle=":", label=None if event.type in labelled else event.type)
        labelled.add(event.type)
    ax.legend()
    save(fig, "loss.png")
    return means, events


def _plot_per_rank(plt: Any, save: Callable[[Any, str], None], name: str, ranks: list[int],
                   by_rank: dict[int, list[dict]]) -> None:
    """samples_per_s.png, step_time.png and busy_time.png: one line per rank."""
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


def _summarize(name: str, steps: list[int], by_rank: dict[int, list[dict]], means: list[Optional[float]],
               files: list[str], events: list[Event]) -> ReportSummary:
    """The report's figures: the final mean loss, and the slowest rank by its own work."""
    ranks = list(by_rank)
    # DDP makes every rank wait for the slowest in the all-reduce, so wall time per step is
    # the same everywhere; a rank's own work time (busy_s) is what tells the slow one.
    mean_time = {k: sum(r["busy_s"] for r in by_rank[k]) / len(by_rank[k]) for k in ranks}
    slowest = max(ranks, key=lambda k: mean_time[k])
    return ReportSummary(
        run=name, ranks=len(ranks), steps=steps[-1], final_loss=float("nan") if means[-1] is None else means[-1],
        slowest_rank=slowest, slowest_step_time_s=mean_time[slowest],
        median_step_time_s=median(mean_time.values()), files=files, events=events,
    )


def _events_of(store: Storage, name: str) -> list[Event]:
    """The run's events (status.json): lost workers, preemptions, resizes."""
    return read_events(run_folder(store, name))


def _report_target(store: Storage, name: str, out: Optional[str]):
    """``--out DIR`` (a path or URI), else ``<run>/report/`` next to the run's metrics."""
    target = resolve_storage(out) if out else None
    fs = target.fs if target else store.fs
    path = target.path if target else f"{store.run_path(name)}/report"
    fs.create_dir(path, recursive=True)
    return path, fs, (target.uri_of if target else lambda filename: store.uri_of(name, "report", filename))
