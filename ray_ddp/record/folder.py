"""A run's folder: every file and folder ray_ddp keeps in it, named in one place.

Used on the driver, in Ray Train's controller (the metrics callback) and on workers
(validation's table, ``--profile``'s traces). A ``RunFolder`` is one run's folder with
its filesystem: the one way a run is addressed, made once on the driver (``run_folder``)
and carried in the RunPlan to the controller and the workers (pyarrow's filesystems
pickle), never reopened from a string. Names and schemas here (``Status``,
``Progress``); reading and writing go through ``storage.py``, whatever the filesystem.

    <storage>/<run>/
      status.json       where the run stands, what `ray-ddp runs` shows (record/status.py)
      progress.json     the latest report, rewritten by the metrics callback; the driver
                        polls it to show progress (record/progress.py)
      summary.json      the last command's summary (driver/summary.py)
      metrics.parquet   a row per rank per report (observe/callback.py)
      metrics.parts/    the rows of the latest checkpoints, not yet folded into
                        metrics.parquet (record/metrics_table.py)
      eval.parquet      a row per validation (observe/callback.py)
      wandb.json        --wandb: the W&B run's id and the last step logged (trackers/wandb.py)
      wandb/            --wandb: W&B's own files (an offline run's, for `wandb sync`)
      profile/          --profile's Chrome traces, rank-<r>.pt.trace.json (worker/profile.py)
      hangs/<step>/     the hang watch's stacks and flight records (driver/hangs.py)
      step-<n>/         a checkpoint, written through Ray Train (checkpoint/)
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # names only here: the filesystem comes from storage.py
    import pyarrow.fs as pafs

    from ray_ddp.storage import Storage

STATUS_FILE = "status.json"
PROGRESS_FILE = "progress.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.parquet"
METRICS_PARTS_FOLDER = "metrics.parts"
EVAL_FILE = "eval.parquet"
PROFILE_FOLDER = "profile"
HANGS_FOLDER = "hangs"
WANDB_FILE = "wandb.json"


@dataclass(frozen=True)
class RunFolder:
    """One run's folder: its storage's filesystem, the folder's path inside it
    (``Storage.run_path``), and the path of every file and folder in it (``run_folder``
    makes one)."""

    fs: "pafs.FileSystem"
    path: str

    def _in(self, name: str) -> str:
        return f"{self.path}/{name}"

    @property
    def status(self) -> str:
        return self._in(STATUS_FILE)

    @property
    def progress(self) -> str:
        return self._in(PROGRESS_FILE)

    @property
    def summary(self) -> str:
        return self._in(SUMMARY_FILE)

    @property
    def metrics(self) -> str:
        return self._in(METRICS_FILE)

    @property
    def metrics_parts(self) -> str:
        return self._in(METRICS_PARTS_FOLDER)

    def metrics_part(self, number: int) -> str:
        """The ``number``-th part appended to metrics.parquet (zero-padded: they sort in order)."""
        return self._in(f"{METRICS_PARTS_FOLDER}/part-{number:06d}.parquet")

    @property
    def evals(self) -> str:
        return self._in(EVAL_FILE)

    @property
    def wandb(self) -> str:
        return self._in(WANDB_FILE)

    @property
    def profile(self) -> str:
        return self._in(PROFILE_FOLDER)

    def hangs(self, step: int) -> str:
        """Where the hang watch keeps what it saw of a hang after ``step``."""
        return self._in(f"{HANGS_FOLDER}/{step}")


def run_folder(store: "Storage", name: str) -> RunFolder:
    """Run ``name``'s folder in ``store``."""
    return RunFolder(store.fs, store.run_path(name))


def _known_fields(cls, data: Any, required: str, kind: type, file: str) -> dict[str, Any]:
    """The keys of a file's JSON object that ``cls`` has, None values left to the field's
    default; keys it does not know (a newer writer's) are skipped. ValueError for what is
    not such a file: not an object, or ``required`` not a ``kind``."""
    if not isinstance(data, dict) or not isinstance(data.get(required), kind):
        raise ValueError(f"not a ray_ddp {file}")
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in known and v is not None}


@dataclass(frozen=True)
class Status:
    """status.json: where a run stands, what `ray-ddp runs` shows (record/status.py writes
    it; docs/run-folder.md gives each key). The fields in the file's order."""

    state: str  # running, complete, failed or interrupted
    run_id: Optional[str] = None  # the folder's own id, kept across commands (tracking finds the run by it)
    created: Optional[float] = None
    updated: Optional[float] = None
    epochs: Optional[int] = None
    world_size: Optional[int] = None  # now, or at the end
    workers: Any = None  # as asked: N, or "MIN-MAX" for an elastic run
    world_sizes: list[dict[str, int]] = field(default_factory=list)  # {world_size, from_step, to_step}
    gpus_per_worker: Optional[float] = None
    model: Optional[str] = None
    error: Optional[str] = None
    events: list[dict[str, Any]] = field(default_factory=list)  # every event of the run (record/events.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "Status":
        """The status a file holds (ValueError for one with no ``state``)."""
        return cls(**_known_fields(cls, data, "state", str, STATUS_FILE))


# what a report leaves out of progress.json when the run has no such figure
_LEFT_OUT_WHEN_NONE = ("accuracy", "perplexity", "val_loss", "val_accuracy", "val_perplexity", "early_stop")


@dataclass(frozen=True)
class Progress:
    """progress.json: the latest report of all ranks, rewritten by the metrics callback
    after each one, and when a worker group starts or is restarted; the driver polls it
    (docs/run-folder.md gives each key). Before a run's first report only ``time``,
    ``nodes``, ``events``, ``preemptions`` and the trackers that failed are known, and only they
    are written."""

    time: float  # of this write (an event moves it; ``report_time`` is the report's)
    epoch: Optional[int] = None
    epochs: Optional[int] = None
    step: Optional[int] = None
    total_steps: Optional[int] = None
    loss: Optional[float] = None  # the window's mean over ranks, weighted by units
    accuracy: Optional[float] = None
    perplexity: Optional[float] = None
    val_loss: Optional[float] = None
    val_accuracy: Optional[float] = None
    val_perplexity: Optional[float] = None
    samples_per_s: Optional[float] = None  # all ranks', summed
    world_size: Optional[int] = None
    checkpoint: Optional[str] = None  # saved with this report
    early_stop: Optional[dict[str, Any]] = None  # --early-stop ended the run with this report
    straggler: Optional[dict[str, Any]] = None
    preemptions: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # restarts within this fit
    mlflow_failed: bool = False
    trackers_failed: list[str] = field(default_factory=list)  # their labels (trackers/base.py)
    nodes: dict[str, Optional[str]] = field(default_factory=dict)  # rank -> node id
    report_time: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        if self.step is None:  # no report yet: only what is known (a field at its default is not)
            return {k: v for k, v in asdict(self).items() if v is not None and v != _DEFAULTS.get(k)}
        return {k: v for k, v in asdict(self).items() if v is not None or k not in _LEFT_OUT_WHEN_NONE}

    @classmethod
    def from_dict(cls, data: Any) -> "Progress":
        """The progress a file holds (ValueError for one with no ``time``)."""
        return cls(**_known_fields(cls, data, "time", (int, float), PROGRESS_FILE))


# each field's default: a field still at it before the first report is not written
_DEFAULTS = {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
             for f in fields(Progress)}
