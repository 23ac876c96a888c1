"""``ray-ddp tune``: Ray Tune over whole ray-ddp runs. Runs on the driver (the search,
its lines, trials.parquet and best.json) and in Tune's trial actors (``train_trial``:
one ray-ddp run, its validations reported to Tune as they land).

Each trial is a complete ``ray_ddp.run`` in ``<storage>/<name>/trial-<k>`` (checkpoints,
metrics, summary: every trainer feature), so ASHA's early stops cost nothing special: a
stopped trial is an interrupted run that its folder can resume. Tune's own state is
kept in ``<storage>/<name>/tune/`` and never loaded (it is pickle): a rerun of the same
name makes the search again from its seed and goes on with the unfinished trials, each
resuming its own checkpoint. Each trial's draw is kept in ``draws.json``
(tune/draws.py): a rerun whose file draws a started trial otherwise is refused before
anything starts.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from ray_ddp.config.train import TrainConfig
from ray_ddp.errors import ConfigError
from ray_ddp.record.folder import RunFolder, run_folder
from ray_ddp.storage import read_json, read_table, resolve_storage, write_json, write_table
from ray_ddp.cluster.runtime_env import user_module_paths
from ray_ddp.tune.space import TuneConfig, max_epochs, pick_candidates, sample_space, trial_config
from ray_ddp.tune.draws import check_draws, save_draws
from ray_ddp.tune.lines import error_line, trial_index, trial_lines
from ray_ddp.tune.tracking import open_search_tracking, tracked_search
from ray_ddp.checkpoint.verify import find_latest_checkpoint
from ray_ddp.cluster.attach import attach_ray
from ray_ddp.driver.run import open_storage, run
from ray_ddp.record.status import read_status

TUNE_DIR, TRIALS_FILE, BEST_FILE = "tune", "trials.parquet", "best.json"
POLL_S = 1.0
TRIAL_CPU = 0.01  # what a trial's own actor reserves (it only waits on its run's workers)


def trial_name(index: int) -> str:
    return f"trial-{index}"


def train_trial(params: dict[str, Any], tc: TuneConfig, storage: str, search: str,
                paths: tuple[str, ...] = ()) -> None:
    """One trial: a ray-ddp run named after Tune's trial index, trained in a thread while
    this one reports each new validation to Tune (ASHA decides at those). ``paths``: the
    folders of the user's modules (its model, dataset, loss, collate), which this actor
    imports as the search's driver did (Ray does not ship the driver's sys.path)."""
    import sys

    import ray.tune

    sys.path[:0] = [p for p in paths if p not in sys.path]

    index = int(ray.tune.get_context().get_trial_id().rsplit("_", 1)[-1])
    cfg = trial_config(tc, params, storage=f"{storage.rstrip('/')}/{search}", name=trial_name(index))

    store = resolve_storage(cfg.storage)
    evals = run_folder(store, cfg.name).evals
    # A restored trial reports again what its run validated in its first life: ASHA skips
    # a rung it has already recorded, and a run that had finished gets its final result.
    told: list[dict[str, Any]] = []
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["summary"] = run(cfg, echo=lambda line: None)
        except BaseException as err:  # handed to Tune below, from its own thread
            outcome["error"] = err

    thread = threading.Thread(target=train, name="ray_ddp-trial", daemon=True)
    thread.start()
    while True:
        done = not thread.is_alive()
        for row in _validations(store, evals)[len(told):]:
            # the last epoch's report ends the trial in Tune's eyes (and its actor with it):
            # only once the run has written its summary and final checkpoint
            if int(row["epoch"]) >= cfg.epochs and not done:
                break
            told.append(row)
            ray.tune.report({"trial": index, "epoch": int(row["epoch"]), "val_loss": row["loss"],
                             **{f"val_{k}": row[k] for k in ("accuracy", "perplexity") if row.get(k) is not None}})
        if done:
            break
        thread.join(POLL_S)
    if "error" in outcome:
        raise outcome["error"]


def _validations(store, path: str) -> list[dict[str, Any]]:
    table = read_table(store.fs, path)
    return table.to_pylist() if table is not None else []


def run_search(tc: TuneConfig, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The whole search: the trials, then trials.parquet and best.json in
    ``<storage>/<name>/``; the trials' rows (best first)."""
    name = search_name(tc)
    # the first candidate of each searched key: the point the space's check validated
    first = {k: pick_candidates(*v)[0] for k, v in tc.search.items()}
    base = trial_config(tc, first, storage=tc.train.get("storage") or TrainConfig.storage, name=name)
    client = ray_client_address(base.address)
    if client:
        # Ray Client runs the Tuner on the cluster: the trials' lines and Tune's record of
        # them would stay there, and reading that record back from storage runs pickles
        raise ConfigError(f"ray-ddp tune runs its search from this process and cannot through Ray Client "
                          f"({client}); submit it as a job instead: ray job submit -- ray-ddp tune ...")
    store = open_storage(base)
    if not store.is_local:
        raise ConfigError(f"ray-ddp tune keeps its search on a local or shared path; --storage "
                          f"{store.uri} is not one")
    root = store.run_path(name)
    # before anything else: a file edited since the trials were drawn is refused, even a
    # finished search's (its table would be shown as this file's)
    draws = check_draws(tc, store, root)
    finished = finished_search(tc, store, root)
    if finished is not None:
        echo(f"ray-ddp tune: search {name} is complete ({root}/{TRIALS_FILE})")
        return finished
    workers = int(str(base.workers or 2).split("-")[-1])
    # Tune's own boxes and tables would bury the trials' lines (--verbose brings them back)
    if not base.verbose:
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # Tune stages up to 200 trials' actors at once, and whichever starts first runs first:
    # with no more staged than run at once, trials start in the order the search seed drew
    # them (a trial's actor only waits on its run, whose workers ask for the resources)
    os.environ.setdefault("TUNE_MAX_PENDING_TRIALS_PG", str(tc.concurrent))
    # a local Ray gets the trials' workers' CPUs and one more for the trials' own actors
    with attach_ray(base.address, base.verbose,
                    local_cpus=tc.concurrent * workers * (base.cpus_per_worker or 1) + 1):
        check_trials_fit(tc, workers, base.cpus_per_worker or 1, base.gpus_per_worker)
        save_draws(store, root, draws)  # once it can start: stored when first drawn, what a rerun is checked against
        tc, tracking = open_search_tracking(tc, name, store, root)  # --mlflow: trials nest under it
        lines = trial_lines(echo, tc)
        with tracked_search(tracking, echo) as rows:
            _tuner(tc, name, store, root, echo, lines, draws).fit()
            rows.extend(collect_trials(tc, name, tune_trials(lines), store, root))
            write_results(store, root, rows)
    return rows


def check_trials_fit(tc: TuneConfig, workers: int, cpus: int, gpus: Optional[int]) -> None:
    """``--concurrent`` trials at once, each ``workers`` x (cpus, gpus), on this cluster."""
    import ray

    total = ray.cluster_resources()
    need_cpu = tc.concurrent * workers * cpus
    if need_cpu + tc.concurrent * TRIAL_CPU > total.get("CPU", 0):
        raise ConfigError(f"{tc.concurrent} trials at once x {workers} workers x {cpus} CPU = {need_cpu} CPU; "
                          f"the cluster has {total.get('CPU', 0):g}; lower --concurrent or the workers")
    if gpus and tc.concurrent * workers * gpus > total.get("GPU", 0):
        raise ConfigError(f"{tc.concurrent} trials at once x {workers} workers x {gpus} GPU need "
                          f"{tc.concurrent * workers * gpus} GPU; the cluster has {total.get('GPU', 0):g}; "
                          "lower --concurrent or the workers")


def ray_client_address(address: Optional[str]) -> Optional[str]:
    """The Ray Client address the search would run through (``address``, else
    RAY_ADDRESS, else a Ray Client this process is already connected to), or None."""
    given = address or os.environ.get("RAY_ADDRESS") or ""
    if given.startswith("ray://"):
        return given
    ray = sys.modules.get("ray")  # connected already only if imported already
    if ray is not None and ray.util.client.ray.is_connected():
        return "a Ray Client connection this process holds"
    return None


def search_name(tc: TuneConfig) -> str:
    return tc.train.get("name") or time.strftime("tune-%Y%m%d-%H%M%S")


def _tuner(tc: TuneConfig, name: str, store, root: str, echo: Callable[[str], None], lines,
           draws: list[dict[str, Any]]):
    import ray.tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # a trial's own actor only waits on its ray-ddp run, whose workers hold the CPUs: a
    # token share (Tune refuses a trial of no resources at all)
    base = trial_config(tc, {k: pick_candidates(*v)[0] for k, v in tc.search.items()}, storage=store.uri, name=name)
    trainable = ray.tune.with_resources(
        ray.tune.with_parameters(train_trial, tc=tc, storage=store.uri, search=name,
                                 paths=tuple(user_module_paths(base))), {"cpu": TRIAL_CPU})
    # A rerun never restores Tune's saved state (tuner.pkl and the trials' state are
    # pickle: whoever can write the search's folder would run code as the user). The
    # search is made again instead: the same seed draws the same trials in the same
    # order (``draws``, checked against those stored, handed to Tune as they are), and
    # each trial's ray-ddp run resumes its own folder from its checkpoint (a complete one
    # returns at once and reports its validations to ASHA again).
    if any(p.base_name.startswith("trial-") for p in _children(store, root)):
        echo(f"ray-ddp tune: continuing search {name}: each trial resumes its own run")
    drawn = BasicVariantGenerator(points_to_evaluate=[dict(d) for d in draws], random_state=tc.seed)
    return ray.tune.Tuner(
        trainable, param_space=sample_space(tc),
        tune_config=ray.tune.TuneConfig(metric=tc.metric, mode=tc.mode, num_samples=tc.trials,
                                        max_concurrent_trials=tc.concurrent, scheduler=build_scheduler(tc),
                                        search_alg=drawn),
        run_config=ray.tune.RunConfig(name=TUNE_DIR, storage_path=root, verbose=0,
                                      callbacks=[lines]),
    )


def finished_search(tc: TuneConfig, store, root: str) -> Optional[list[dict[str, Any]]]:
    """The trials of a search that ended (trials.parquet has every trial, none
    unfinished), best first; None if it has to run (again)."""
    table = read_table(store.fs, f"{root}/{TRIALS_FILE}")
    if table is None:
        return None
    rows = table.to_pylist()
    if len(rows) != tc.trials or any(r.get("unfinished") for r in rows):
        return None
    return rows


def _children(store, root: str) -> list:
    from pyarrow.fs import FileSelector

    return store.fs.get_file_info(FileSelector(root, allow_not_found=True))


def build_scheduler(tc: TuneConfig):
    """ASHA over epochs (``--scheduler asha``), or None (every trial runs to the end). Its
    rule: at each rung (``grace_epochs`` x 2^k epochs), a trial whose metric is worse than
    the median of those already recorded at that rung stops; the first at a rung goes on."""
    if tc.scheduler != "asha":
        return None
    import ray.tune

    return ray.tune.schedulers.ASHAScheduler(time_attr="epoch", max_t=max_epochs(tc),
                                             grace_period=tc.grace_epochs, reduction_factor=2)


def tune_trials(lines) -> list:
    """Tune's Trial objects as ``trial_lines`` got them when the search ended: their
    status tells ASHA's stops (TERMINATED early) from an interrupted search's trials
    (PENDING, PAUSED, RUNNING), which a Result of the grid does not."""
    if lines.trials is None:
        raise RuntimeError("Tune ended the search without calling on_experiment_end")
    return lines.trials


def collect_trials(tc: TuneConfig, name: str, trials: list, store, root: str) -> list[dict[str, Any]]:
    """One row per trial from Tune's record of it (``tune_trials``) and its run folder,
    best first. A trial Tune has not ended (the search was interrupted) is
    ``unfinished``, not stopped."""
    rows = []
    for trial in trials:
        index = trial_index(trial)
        folder = RunFolder(store.fs, f"{root}/{trial_name(index)}")
        summary = read_json(store.fs, folder.summary) or {}
        last = trial.last_result or {}
        ran = int(last.get("epoch") or 0)
        ended = trial.status in ("TERMINATED", "ERROR")
        epochs = int(trial.config.get("epochs") or max_epochs(tc))
        stopped = trial.status == "TERMINATED" and ran < epochs and not summary.get("early_stopped")
        if stopped and not summary:
            _mark_stopped(folder)
        rows.append({"trial": index, **{k: trial.config.get(k) for k in tc.search},
                     "val_loss": last.get("val_loss"), "val_accuracy": last.get("val_accuracy"),
                     "val_perplexity": last.get("val_perplexity"),
                     "epochs": ran, "stopped_early": stopped, "unfinished": not ended,
                     "error": error_line(trial) if trial.status == "ERROR" else None,
                     "run": store.uri_of(name, trial_name(index)),
                     "checkpoint": summary.get("best_checkpoint") or summary.get("checkpoint")
                     or _latest_checkpoint(folder)})
    # best first by the search's metric (val_loss, or the task's)
    rows.sort(key=lambda r: (r[tc.metric] is None, (r[tc.metric] or 0) * (1 if tc.mode == "min" else -1)))
    return rows


def _latest_checkpoint(folder: RunFolder) -> Optional[str]:
    latest = find_latest_checkpoint(folder).latest
    return f"{folder.path}/{latest}" if latest else None


def _mark_stopped(folder: RunFolder, settle_s: float = 5.0) -> None:
    """A trial ASHA stopped was killed mid-run: its status says so, and a rerun resumes it.
    Tune ends the actor asynchronously, and its run may write "failed" on its way down a
    moment after: a status still "running" gets ``settle_s`` to take that last write."""
    status = read_status(folder)
    deadline = time.monotonic() + settle_s
    while status is not None and status.state == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
        status = read_status(folder)
    # killed mid-run ("running"), or failing on its way down as Tune ended its actor
    if status is not None and status.state in ("running", "failed"):
        stopped = dataclasses.replace(status, state="interrupted", error="stopped early by ASHA", updated=time.time())
        write_json(folder.fs, folder.status, stopped.to_dict())


def write_results(store, root: str, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa

    write_table(store.fs, f"{root}/{TRIALS_FILE}", pa.Table.from_pylist(rows))
    done = [r for r in rows if r["val_loss"] is not None]  # rows come best first
    if done:
        best = done[0]
        write_json(store.fs, f"{root}/{BEST_FILE}", {
            "trial": best["trial"], "params": {k: best[k] for k in best if k not in _ROW_KEYS},
            "val_loss": best["val_loss"], **{k: best[k] for k in ("val_accuracy", "val_perplexity")
                                             if best.get(k) is not None},
            "checkpoint": best["checkpoint"], "run": best["run"]})


_ROW_KEYS = {"trial", "val_loss", "val_accuracy", "val_perplexity", "epochs", "stopped_early", "unfinished",
             "error", "run", "checkpoint"}
