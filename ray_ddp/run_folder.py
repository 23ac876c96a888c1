"""A run's folder: every file and folder ray_ddp keeps in it, named in one place.

Used on the driver, in Ray Train's controller (the metrics callback) and on workers
(validation's table, ``--profile``'s traces). Names only: reading and writing go through
``storage.py``, whatever the filesystem.

    <storage>/<run>/
      status.json       where the run stands, what `ray-ddp runs` shows (driver/status.py)
      progress.json     the latest report, rewritten by the metrics callback; the driver
                        polls it to show progress (driver/progress.py)
      summary.json      the last command's summary (driver/summary.py)
      metrics.parquet   a row per rank per report (observe/callback.py)
      eval.parquet      a row per validation (observe/callback.py)
      profile/          --profile's Chrome traces, rank-<r>.pt.trace.json (worker/profile.py)
      hangs/<step>/     the hang watch's stacks and flight records (driver/hangs.py)
      step-<n>/         a checkpoint, written through Ray Train (checkpoint/)
"""

from __future__ import annotations

from dataclasses import dataclass

STATUS_FILE = "status.json"
PROGRESS_FILE = "progress.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.parquet"
EVAL_FILE = "eval.parquet"
PROFILE_FOLDER = "profile"
HANGS_FOLDER = "hangs"


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run's folder; ``path`` is the folder inside its storage's
    filesystem (``StorageConfig.run_path``; ``StorageConfig.run_folder`` makes one)."""

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
    def evals(self) -> str:
        return self._in(EVAL_FILE)

    @property
    def profile(self) -> str:
        return self._in(PROFILE_FOLDER)

    def hangs(self, step: int) -> str:
        """Where the hang watch keeps what it saw of a hang after ``step``."""
        return self._in(f"{HANGS_FOLDER}/{step}")

    def checkpoint(self, name: str) -> str:
        """A checkpoint folder by its name (``step-00000010``)."""
        return self._in(name)
