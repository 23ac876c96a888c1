"""``--wandb PROJECT``: the run in Weights & Biases. Runs on the driver (the config when
the run starts; the summary, the events and how it ended at its end) and in Ray Train's
controller actor (every metrics window); workers never talk to W&B.

One W&B run per ray_ddp run: its id is the run folder's own id (status.json ``run_id``),
so a resume, even from another machine, continues it. The last step logged is kept
beside the metrics in the run folder (wandb.json): a restart redoes steps, and W&B
(offline, above all) would log them again. With ``WANDB_MODE=offline`` the run's files
are written under <run>/wandb/ (local storage), for `wandb sync` later. wandb is an
optional extra, imported only here.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

from ray_ddp.record.events import Event
from ray_ddp.record.folder import RunFolder, run_folder
from ray_ddp.errors import ConfigError
from ray_ddp.storage import read_json, write_json
from ray_ddp.trackers.base import Tracker, Window
from ray_ddp.trackers.mlflow import WINDOW_FIGURES, _finite

INSTALL_HINT = "--wandb needs the wandb package: pip install 'ray_ddp[wandb]'"
# per-rank series: a W&B chart of each rank's step time shows a straggler at a glance
RANK_FIGURES = ("step_time_s", "samples_per_s", "tokens_per_s", "data_wait_share")
# the run's shared figures as W&B names them (one chart section each)
SHARED_FIGURES = ("tokens_per_s", "mfu", "grad_norm", "lr")


@dataclass(frozen=True)
class WandbRun:
    """Where the run's W&B run is and how far its metrics go; travels to the controller."""

    project: str
    run_id: str
    name: str
    entity: Optional[str]
    group: Optional[str]
    dir: str  # W&B's local files (an offline run's, for `wandb sync`)
    folder: RunFolder  # the run's folder (its filesystem with it), where wandb.json keeps logged_until
    logged_until: int = 0
    # the driver's WANDB_MODE and WANDB_API_KEY: the controller may run on another node,
    # whose environment is the cluster's, not the shell's that started the run
    mode: Optional[str] = None
    api_key: Optional[str] = field(default=None, repr=False)


def check_wandb(cfg) -> None:
    """One line now, before Ray starts, if wandb is missing."""
    if cfg.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(INSTALL_HINT) from None


def _init(run: WandbRun, **more):
    """The W&B run, started or continued in this process; nothing of this process's own
    (its console, its system's figures, its code) goes with it: those are the run folder's."""
    import wandb

    if run.api_key and not os.environ.get("WANDB_API_KEY"):
        os.environ["WANDB_API_KEY"] = run.api_key
    # the run's record file flushed every second, not every 15 s: a controller killed
    # with its group (Tune stopping a trial, a node lost) loses at most that of W&B's copy
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True,
                              disable_git=True, save_code=False, x_transaction_log_flush_interval=1.0)
    return wandb.init(project=run.project, entity=run.entity, group=run.group, id=run.run_id, name=run.name,
                      dir=run.dir, resume="allow", reinit="create_new", mode=run.mode, settings=settings, **more)


def open_wandb(cfg, options: dict[str, Any], identity: str, storage) -> "WandbTracker":
    """The run's W&B run, its config ``options``: every option as resolved for this
    cluster (RunPlan.resolved_options); the same run a resume of this run folder
    continues. One-line ConfigError when W&B refuses it."""
    check_wandb(cfg)
    folder = run_folder(storage, cfg.name)
    if storage.is_local:
        local = storage.path_on_disk(cfg.name)
    else:  # W&B writes to a local disk: its files are a cache, the run folder has the record
        local = os.path.join(tempfile.gettempdir(), "ray_ddp_wandb", identity)
    os.makedirs(local, exist_ok=True)
    cursor = read_json(storage.fs, folder.wandb) or {}
    logged = int(cursor.get("logged_until") or 0) if cursor.get("run_id") == identity else 0
    run = WandbRun(project=cfg.wandb, run_id=identity, name=cfg.name, entity=cfg.wandb_entity,
                   group=cfg.wandb_group, dir=local, folder=folder, logged_until=logged,
                   mode=os.environ.get("WANDB_MODE"), api_key=os.environ.get("WANDB_API_KEY"))
    try:
        session = _init(run, config=options, allow_val_change=True)
        session.finish()
    except Exception as e:
        raise ConfigError(f"--wandb {cfg.wandb}: W&B refused the run ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}); check `wandb login` or set WANDB_MODE=offline") from None
    tracker = WandbTracker(run)
    tracker.save_cursor()
    return tracker


class WandbTracker(Tracker):
    """Windows logged from the controller, in one W&B session per fit; the summary and
    events from the driver at the end."""

    def __init__(self, run: WandbRun):
        self.run = run
        self.label = f"W&B project {run.project}"
        self._session = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_session": None}

    def resume(self) -> "WandbTracker":
        """How far the earlier fits' controllers logged (wandb.json): a new one goes on from there."""
        cursor = read_json(self.run.folder.fs, self.run.folder.wandb) or {}
        logged = max(self.run.logged_until, int(cursor.get("logged_until") or 0))
        return WandbTracker(dataclasses.replace(self.run, logged_until=logged))

    def log_window(self, window: Window) -> None:
        if window.step <= self.run.logged_until:  # redone after a restart, or logged by an earlier command
            return
        if self._session is None:
            self._session = _init(self.run)
        figures = {k: window.figures.get(k) for k in WINDOW_FIGURES}
        first = window.rows[0]
        figures.update({k: first.get(k) for k in SHARED_FIGURES})
        figures["world_size"] = len(window.rows)
        figures["epoch"] = first.get("epoch")
        for row in window.rows:
            figures.update({f"rank_{row['rank']}/{k}": row.get(k) for k in RANK_FIGURES})
        # committed now: W&B holds a step's row until a later step comes, or its session ends
        self._session.log({k: v for k, raw in figures.items() if (v := _finite(raw)) is not None},
                          step=window.step, commit=True)
        self.run = dataclasses.replace(self.run, logged_until=window.step)
        self.save_cursor()

    def save_cursor(self) -> None:
        write_json(self.run.folder.fs, self.run.folder.wandb,
                   {"run_id": self.run.run_id, "project": self.run.project, "entity": self.run.entity,
                    "group": self.run.group, "logged_until": self.run.logged_until})

    def close(self) -> None:
        if self._session is not None:
            self._session.finish()
            self._session = None

    def finish(self, summary: dict[str, Any], events: list[Event], status: str,
               model_file: Optional[str], fit_over: bool = True) -> None:
        """The summary's figures as the W&B run's summary, the events as a list in it (and a
        count per type), and the run's end: exit code 0 when it finished. Not while a
        controller may still log (a stopped run): two sessions of one W&B run at once
        would write over each other (offline, into one folder); its own session's end
        ends the W&B run then."""
        if not fit_over:
            return
        session = _init(self.run)
        try:
            session.summary.update({k: v for k, raw in summary.items() if (v := _finite(raw)) is not None})
            counts: dict[str, int] = {}
            for e in events:
                counts[e.type] = counts.get(e.type, 0) + 1
            session.summary.update({"events": [e.to_dict() for e in events], "status": status,
                                    **{f"events/{kind}": n for kind, n in counts.items()}})
        finally:
            session.finish(exit_code=0 if status == "FINISHED" else 1)
