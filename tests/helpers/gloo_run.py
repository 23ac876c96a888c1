"""ray_ddp's run without Ray: the driver's own planning and bookkeeping, and the real
worker loop in plain gloo process groups. For checks of ray_ddp's own code (the loss and
batch arithmetic, a resume's exactness, the non-finite checks), at a fraction of a Ray
Train run's CPU: no controller, no helper actors, no Ray worker processes.

``train_in_gloo(cfg, ...)`` does what ``ray_ddp.run`` does (its checks before Ray starts,
where to start, announce, ``fit_with_status``, write the summary), except that the
placement is ``cfg.workers`` CPU workers and ``fit_with_status`` is given ``fit_on_gloo``
instead of Ray Train's TorchTrainer:
``cfg.workers`` processes on loopback (forked from a server that has imported torch:
rank_procs.py), each running ``run_worker`` (worker/loop.py)
with a ``GlooSession`` (the harness's side of worker/session.py), and this process
handing each round of reports (one per rank) to ray_ddp's MetricsCallback, as Ray Train's
controller does. Checkpoints are written by the strategy's writer into the run folder,
before the report (Ray uploads them meanwhile). What is Ray's stays with the real-Ray
tests: placement, restarts, retention (``--keep``), preemption, Ray Data, the hang watch
(``--hang-timeout`` is 0 here), GPUs and MLflow; a config asking for one is refused.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ray_ddp.cluster.placement import plan_placement
from ray_ddp.config.workers import worker_range
from ray_ddp.driver.supervisor import fit_with_status
from ray_ddp.driver.resolve import resolve
from ray_ddp.driver.run import announce, check_run, find_start_point, open_storage, summary_of_complete_run
from ray_ddp.driver.summary import RunSummary, write_summary
from ray_ddp.checkpoint.snapshots import drop_node_snapshots
from ray_ddp.errors import TrainingError
from ray_ddp.models.build import model_stages
from ray_ddp.storage import resolve_storage
from rank_procs import rank_context, start_rank

RANK_TIMEOUT_S = 300.0  # the longest a rank may go without a report
SURVIVORS_S = 2.0  # how long the ranks left of a failed fit may take to end


def train_in_gloo(cfg, echo: Callable[[str], None] = lambda line: None, *, model: Any = None,
                  train_data: Any = None, val_data: Any = None, loss: Any = None,
                  collate: Any = None) -> RunSummary:
    """``ray_ddp.run(cfg)`` on ``cfg.workers`` gloo processes of this machine, no Ray."""
    started = time.time()
    assert not (cfg.ray_data or cfg.gpus_per_worker or cfg.mlflow), "Ray Data, GPUs and MLflow: on Ray only"
    workers = worker_range(cfg.workers)
    assert workers is not None and workers[0] == workers[1], "name the workers; an elastic run: on Ray only"
    objects = {"model": model, "train_data": train_data, "val_data": val_data, "loss": loss, "collate": collate}
    cfg, data_shape, plan = check_run(dataclasses.replace(cfg, hang_timeout=0), objects)
    store = open_storage(cfg)
    start, init_from = find_start_point(plan, store, data_shape, model, echo)
    if start.complete:
        return summary_of_complete_run(plan, store, start, started)
    placement = plan_placement(workers[1], 0, "gloo", [], stages=model_stages(cfg.model),
                               cpus_per_worker=cfg.cpus_per_worker)
    plan = resolve(cfg, data_shape, placement, store)
    announce(plan, placement, start, store, echo)
    marks = {"process": started, "run": started, "attach": time.time(), "ray": time.time(), "fit": time.time()}
    fit_with_status(plan, store, placement, start, objects, echo, init_from=init_from,
                    model_loss=data_shape is not None and data_shape.hands_labels and loss is None,
                    fit=fit_on_gloo)
    marks["fitted"] = time.time()
    drop_node_snapshots(cfg.storage, cfg.name)  # as run() does at a command's end
    return write_summary(plan, store, placement, start.resumed_from, started, marks,
                         start.scan.meta)


def fit_on_gloo(cfg, store, placement, plan, objects, tracking=None, ray_inputs=None) -> None:
    """fit_with_status's ``fit``: the planned workers as gloo processes, their
    reports handed to ray_ddp's MetricsCallback a round at a time; a rank's exception
    ends the fit as a TrainingError naming the rank, as Ray Train's does."""
    import ray.train  # the callback's checkpoint argument (no Ray is started)

    # not at the top: it imports Ray Train, which only a fit needs
    from ray_ddp.observe.callback import MetricsCallback

    assert ray_inputs is None, "Ray Data runs on Ray only"
    metrics = MetricsCallback(plan.run.folder, cfg.epochs, plan.last_step,
                              keep=cfg.keep, keep_best=cfg.keep_best, trackers=tracking)
    world = placement.workers
    ctx = rank_context()
    reports = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="gloo_run_")  # a file store: no port to race for
    init = f"file://{os.path.join(rendezvous, 'group')}"
    # not daemonic: a rank may start DataLoader processes of its own (--loader-workers)
    procs = [start_rank(ctx, _rank_main, rank, world, init, plan, reports) for rank in range(world)]
    sent: list[list] = [[] for _ in range(world)]  # each rank's (metrics, checkpoint path), in order
    handed, done, last = 0, set(), time.monotonic()
    try:
        while len(done) < world:
            try:
                kind, rank, payload = reports.get(timeout=1.0)
            except queue.Empty:
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]
                if gone:
                    raise TrainingError(f"training failed on rank {gone[0]}: its process exited "
                                        f"with {procs[gone[0]].exitcode}") from None
                if time.monotonic() - last > RANK_TIMEOUT_S:
                    raise TrainingError(f"no report in {RANK_TIMEOUT_S:.0f} s") from None
                continue
            last = time.monotonic()
            if kind == "error":
                raise TrainingError(f"training failed on rank {rank}: {payload}")
            if kind == "done":
                done.add(rank)
                continue
            sent[rank].append(payload)
            while all(len(s) > handed for s in sent):  # a round: every rank's report
                path = next((p for _, p in (s[handed] for s in sent) if p), None)
                metrics.after_report(None, [s[handed][0] for s in sent],
                                     ray.train.Checkpoint(path, store.fs) if path else None)
                handed += 1
    finally:
        # a failed fit's survivors get the seconds Ray gives them (its controller notices a
        # lost worker within 2 s, then waits for shutdown): their last word, a survivor's save
        ends = time.monotonic() + (SURVIVORS_S if len(done) < world else 30)
        for proc in procs:
            proc.join(timeout=max(0.0, ends - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(rendezvous, ignore_errors=True)


class GlooSession:
    """worker/session.py's session for a rank of the harness: its rank and the run's
    storage from the plan, a report put on the harness's queue (after this rank's
    checkpoint is written, at once) and a barrier, as Ray's report is one."""

    node_rank, node_id, node_ip = 0, "gloo", "127.0.0.1"

    def __init__(self, rank: int, world_size: int, plan, reports):
        store = resolve_storage(plan.run.config.storage)
        run_path = store.run_path(plan.run.config.name)
        self.rank, self.world_size, self.reports = rank, world_size, reports
        self.local_rank = rank  # every rank of the harness is on one node
        self.fs, self.checkpoint_path = store.fs, lambda name: f"{run_path}/{name}"

    def gpus(self) -> list[torch.device]:
        raise AssertionError("the gloo harness has no GPUs")

    def latest_checkpoint(self) -> Optional[Any]:
        return None  # no restarts within a fit here

    def preemption(self) -> None:
        return None

    def report(self, metrics: dict, checkpoint_name: Optional[str] = None, write=None) -> None:
        path = write(checkpoint_name) if write is not None else None
        self.reports.put(("report", self.rank, (metrics, path)))
        dist.barrier()

    def report_and_wait(self, metrics: dict, holds_rows: bool = False) -> None:
        self.report(metrics)  # taken by the harness's loop in order: nothing to wait for


def _rank_main(rank: int, world: int, init: str, plan, reports) -> None:
    # not at the top: the worker's modules, imported in the rank's own process
    from ray_ddp.worker.loop import run_worker

    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        run_worker(plan, GlooSession(rank, world, plan, reports))
        reports.put(("done", rank, None))
    except BaseException as err:
        traceback.print_exc()  # the whole story, on the test's stderr; the line goes to the fit
        reports.put(("error", rank, f"{type(err).__name__}: {err}"))
    finally:
        # this rank's last word reaches the fit before its peers see the group go
        # (their own error would then be a lost connection)
        reports.close()
        reports.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()
