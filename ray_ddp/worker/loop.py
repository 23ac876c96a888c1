"""The training loop: what TorchTrainer starts on every worker. Runs on workers.

Ray has already joined the worker to the process group (NCCL or gloo) and given it its
devices. ``train_loop_per_worker`` reads the driver's WorkerPlan, builds the parts
(``worker/parts.py``: the model set up by the strategy, the checkpoint loaded) and runs
``WorkerRun.train``, which reads like nanoGPT's loop: each step is ``train_step``; after
it, each component decides whether it is time: the metrics window (every
``--report-every`` steps and at an epoch's end), validation (with ``--early-stop``, also
whether the run ends after this epoch), the checkpoint, a node's preemption. Every rank
reports at exactly the same steps: Ray's report is a barrier. The loop never branches on
DDP versus FSDP: it calls the strategy; and it meets Ray only through its session
(``worker/session.py``), so ``run_worker`` also runs in the tests' plain gloo groups.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ray_ddp.checkpoint.format import restore_rng
from ray_ddp.checkpoint.resume import check_ranks_resumed_alike
from ray_ddp.checkpoint.verify import weights_hash
from ray_ddp.data.inputs import build_inputs
from ray_ddp.config.callables import load_callable
from ray_ddp.parallel.build import build_strategy
from ray_ddp.plan import BatchCut, WorkerPlan
from ray_ddp.tasks.builtin import Task
from ray_ddp.tasks.batches import takes_keyword
from ray_ddp.tasks.build import build_task
from ray_ddp.worker.checks import raise_if_not_finite, weights_are_finite
from ray_ddp.worker.collectives import shorten_collective_timeout
from ray_ddp.worker.devices import peak_memory_mb, worker_devices
from ray_ddp.worker.flops import flops_per_token, peak_flops
from ray_ddp.worker.heartbeat import Heartbeat, group_id
from ray_ddp.worker.parts import TrainParts, build_parts
from ray_ddp.worker.preemption import PreemptionState, wait_for_restart
from ray_ddp.worker.profile import ProfileState
from ray_ddp.worker.report import Reporter
from ray_ddp.worker.snapshotting import Snapshotter, node_snapshots
from ray_ddp.worker.step import seed_step, train_step, unused_parameters_error
from ray_ddp.worker.validate import Validator
from ray_ddp.worker.window import WindowState, window_row


def train_loop_per_worker(plan: WorkerPlan) -> None:
    """What TorchTrainer runs on each worker: the run, in Ray Train's session."""
    started_at = time.time()  # reported once: where the start-up seconds went
    # here, not at the top: the session imports Ray Train, which a loop run in the tests'
    # plain gloo groups (with a session of their own) never needs
    from ray_ddp.worker.session import RayTrainSession

    run_worker(plan, RayTrainSession(), started_at)


def run_worker(plan: WorkerPlan, session, started_at: Optional[float] = None) -> None:
    """One worker's whole run, from the plan: the parts built, the checkpoint loaded, the
    epochs trained. ``session``: this rank, its reports and checkpoints (worker/session.py)."""
    started_at = started_at or time.time()
    with collection_paused():
        rank, world_size = session.rank, session.world_size
        cfg = plan.run.config  # the user's options; what the data and cluster decided: plan.run
        # an elastic run gets its world size from Ray at each (re)start: the fixed global
        # batch is cut into micro-batches and accumulation steps for this one
        cut = plan.run.batch.cut(world_size)
        objects = plan.load_objects()
        devices = worker_devices(plan.run, session)
        # as many intra-op threads as the cores this worker reserved (Ray's OMP_NUM_THREADS
        # follows the CPUs it asked for, but torch may have read it before)
        torch.set_num_threads(plan.run.cpus_per_worker or 1)
        parts, state = build_parts(plan, build_strategy(cfg, session.node_id), devices, objects.get("model"),
                                   session.latest_checkpoint(), session.node_id)
        loaded_hash = check_ranks_resumed_alike(state.step, lambda: weights_hash(parts.model))
        setup_memory = {f"setup_{k}": v for k, v in peak_memory_mb(devices[0]).items()}  # before any step
        if len(state.rng) == world_size:
            restore_rng(state.rng[rank], devices)
        else:  # a new run, or another world size: independent dropout-like noise per rank
            torch.manual_seed(cfg.seed + 7919 * (rank + 1) + state.step)
        loss_fn = objects.get("loss") or (load_callable(cfg.loss, what="loss") if cfg.loss else None)
        # batches with labels: the model's own loss, if its forward takes them; else the task's
        task = build_task(plan.run.task, cfg.seq_len, loss_fn, model=parts.model,
                          model_loss=plan.model_loss and takes_keyword(parts.model, "labels"))
        source, val_set = build_inputs(plan.run, cut, rank, devices[0], objects, plan.ray_data)
        collective = devices[0] if dist.get_backend() == "nccl" else torch.device("cpu")
        group = group_id(collective) if plan.hang_watch is not None else None  # the same on every rank
        heartbeat = Heartbeat(plan.hang_watch, rank, session.node_id, session.node_ip,
                              min(5.0, max(0.5, cfg.hang_timeout / 10)), state.step, group)
        run = WorkerRun(plan, cut, session, parts, task, source, val_set, state,
                        {"loaded_hash": loaded_hash, "started_at": started_at, "resumed_at": state.step,
                         "resumed_from": state.loaded_from, "resumed_from_node": state.loaded_from_node,
                         **setup_memory},
                        heartbeat)
    try:
        run.train()
    except RuntimeError as err:
        told = unused_parameters_error(err, cfg.find_unused_parameters)
        if told is not None:
            raise told from None
        raise
    finally:
        heartbeat.close()
        source.close()  # loader processes stop now, not when the worker's process ends


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a worker sets up. Set-up allocates
    objects by the hundred thousand (DDP's constructor imports torch._dynamo), and each
    full collection they trigger scans everything torch and Ray already hold: paused, the
    same set-up takes less CPU (benchmarks/worker_setup.py). Collection resumes for the
    training, and its first pass frees whatever cycles set-up left."""
    if not gc.isenabled():  # the user's choice (or a caller's pause): left as it is
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class WorkerRun:
    """One worker's training run: epochs of steps, closed into metrics windows."""

    def __init__(self, plan: WorkerPlan, cut: BatchCut, session, parts: TrainParts, task: Task, source,
                 val_set, state, first_report: dict, heartbeat: Heartbeat):
        cfg = plan.run.config
        rank = session.rank
        self.cfg, self.cut, self.rank, self.world_size, self.session = cfg, cut, rank, cut.world, session
        self.parts, self.task, self.source, self.state = parts, task, source, state
        self.last_step = plan.last_step  # --max-steps, where it comes before the epochs' end
        self.steps_per_epoch = plan.run.steps_per_epoch  # the data's (or the flag's): the plan's
        # what each checkpoint says the run is: the user's intent and the plan, apart
        self.run_record = {"config": plan.run.config.to_dict(), "plan": plan.run.planned(),
                           "started_from": plan.started_from}
        self.node_rank, self.node_id = session.node_rank, session.node_id
        self.first_report: Optional[dict] = first_report  # extra columns of the first row only
        device = parts.devices[0]
        collective = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.reporter = Reporter(session, cfg.report_interval, collective,
                                 parts.strategy.checkpoint_writer(session, rank),
                                 save_every_s=cfg.checkpoint_every_minutes * 60 if cfg.checkpoint_every_minutes else None)
        self.heartbeat = heartbeat
        self.profile = ProfileState(cfg.profile, rank, plan.run.folder, device)
        self.validator = Validator(cfg, val_set, task, parts, rank, cut.world, collective,
                                   on_batch=heartbeat.tick, folder=plan.run.folder)
        self.validator.resume_early_stop(state.step, state.rows)  # --early-stop's count survives a resume
        self.preemptions = PreemptionState()
        self.window = WindowState.start(device, parts.devices[-1])
        self.flops = (flops_per_token(parts.model), peak_flops(parts.devices))  # for mfu, once
        snapshots = node_snapshots(cfg, parts.strategy, session, plan.snapshot_scope)
        self.snapshots = Snapshotter(snapshots, parts, state, self.run_record, rank, cut.world, self.reporter)
        self.snapshot_agreed = False  # the default cadence's: agreed at this step's window end
        self.reporter.snapshots_by_cost = snapshots is not None and snapshots.every is None
        # resumed from a snapshot: the rows it held go out first; a node's snapshot of another
        # world size (an elastic restart) sends them whole at once. (A checkpoint in storage
        # of another world size carries none: its rows went out with its report, unless Ray
        # never took that report, a rarer loss left as it is.)
        carried = state.rows if len(state.rows) == cut.world or state.loaded_from_node is not None else []
        self.carried_windows = self.reporter.carry(carried) if carried else []

    def train(self) -> None:
        try:
            self._train()
        except Exception as err:  # a peer lost: the state after the last whole step, saved on the node
            self.snapshots.save_as_survivor(err)
            raise

    def _train(self) -> None:
        cfg, state = self.cfg, self.state
        if state.loaded_from_node is not None:  # a node's snapshot: the restart's line says so now
            self.reporter.say_started({"rank": self.rank, "resumed_at": state.step, "resumed_from": state.loaded_from,
                                       "resumed_from_node": state.loaded_from_node,
                                       **({"carried": self.carried_windows} if self.carried_windows else {})})
        self.snapshots.mark_whole()
        for epoch in range(state.epoch, cfg.epochs):
            if self.ended:  # --early-stop or --max-steps, after that step's report (or resumed there)
                break
            for i in range(state.epoch_step, self.steps_per_epoch):  # >0 only on mid-epoch resume
                self.profile.before_step(state.step + 1)
                seed_step(cfg.seed, self.rank, state.step + 1, self.parts.devices)
                train_step(self.parts, self.task, self.source, self.window, epoch, i, self.cut.grad_accum,
                           cfg.clip_grad, self.reporter.collective_device)
                self.snapshots.mark_changing()
                state.step += 1
                state.epoch_step += 1
                self.heartbeat.tick(state.step)
                with self.heartbeat.meant_wait():  # at the range's end: the trace's export
                    self.profile.after_step(state.step)
                self._note_first_step()
                if i == self.steps_per_epoch - 1:
                    self._end_epoch(epoch)
                else:
                    self._within_epoch(epoch, i)
                if self.ended:
                    break
                self.snapshots.mark_whole()
                agreed, self.snapshot_agreed = self.snapshot_agreed, False
                self.snapshots.take(agreed, self.heartbeat)
        with self.heartbeat.meant_wait():
            self.profile.finish()  # a range past the run's last step ends with it

    @property
    def ended(self) -> bool:
        """--early-stop's count reached, or the run's last step (--max-steps) taken."""
        return self.validator.stopped or self.state.step >= self.last_step

    def _end_epoch(self, epoch: int) -> None:
        self.state.epoch, self.state.epoch_step = epoch + 1, 0
        self.parts.strategy.sync_buffers(self.parts.model, self.reporter.collective_device)
        step, last = self.state.step, self.state.step >= self.last_step
        evaluated = self._validate(epoch + 1) if self.validator.should_validate(epoch + 1, step) else None
        # the run's end (its last epoch, its --max-steps, an early stop) always checkpoints
        save = should_save(self.cfg, epoch + 1, step) or last or self.validator.stopped
        self._close_window(epoch, save=save, epoch_end=True, evaluated=evaluated)

    def _within_epoch(self, epoch: int, i: int) -> None:
        """A step inside an epoch: its window closes every --report-every steps, and where a
        validation or a checkpoint falls by steps, or the run ends here (--max-steps)."""
        step, last = self.state.step, self.state.step >= self.last_step
        validate = self.validator.should_validate(0, step)
        if validate or last:  # every rank validates and hashes rank 0's buffers, as at an epoch's end
            self.parts.strategy.sync_buffers(self.parts.model, self.reporter.collective_device)
        evaluated = self._validate(epoch) if validate else None
        save = should_save(self.cfg, 0, step) or last or self.validator.stopped
        if save or evaluated is not None or (i + 1) % self.cfg.report_every == 0:
            self._close_window(epoch, save=save, epoch_end=False, evaluated=evaluated)

    def _validate(self, epoch_done: int) -> dict:
        evaluated = self.validator.validate(epoch_done)
        self.window.started += evaluated["val_time_s"]  # left out of the training window
        return evaluated

    def _note_first_step(self) -> None:
        if self.first_report is not None and "first_step_at" not in self.first_report:
            if self.parts.devices[0].type == "cuda":
                torch.cuda.synchronize(self.parts.devices[0])  # once: the step really ended
            self.first_report["first_step_at"] = time.time()
            # every rank has joined and taken a step: from here a collective waits no longer
            # than the hang watch would (the start-up's 30 min covered the slowest start)
            shorten_collective_timeout(self.cfg.hang_timeout, self.cfg.wait_timeout)

    def _close_window(self, epoch: int, save: bool, epoch_end: bool, evaluated: Optional[dict] = None) -> None:
        """End this rank's metrics window (one metrics.parquet row), stop every rank
        together if any saw a non-finite loss (or, before a checkpoint, weights), and
        send the rows not yet sent when a checkpoint or a send is due. When a node of
        the run is being preempted, save a checkpoint here, whatever the step, and wait
        for Ray to restart the run without that node."""
        now = time.perf_counter()
        model = self.parts.model
        poisoned = False
        if save:  # the checkpoint's first part: never save non-finite weights (a full pass over them)
            with self.heartbeat.meant_wait():
                poisoned = not weights_are_finite(model)
        agreed = self.reporter.agree(bool(self.window.loss_bad.item()), poisoned)
        self.snapshot_agreed = agreed.snapshot
        raise_if_not_finite(epoch, self.state.step, agreed.bad_loss, agreed.bad_weights)
        # the same on every rank
        notice = self.preemptions.new_notice(self.session) if agreed.check_preemption else None
        if (notice is not None or agreed.save) and not save:
            with self.heartbeat.meant_wait():
                save = self._all_weights_finite()  # never checkpoint poisoned weights, even now
        row = window_row(self.window, self.task, now, epoch=epoch, step=self.state.step, rank=self.rank,
                         world_size=self.world_size, node_rank=self.node_rank, node_id=self.node_id,
                         lr=self.parts.optimizer.param_groups[0]["lr"], device=self.parts.devices[0],
                         flops=self.flops)
        last = self.state.step >= self.last_step
        if epoch_end or last:
            with self.heartbeat.meant_wait():  # FSDP: gathers every parameter
                row["weights_hash"] = weights_hash(model)
        row.update(evaluated or {})
        row.update(notice or {})
        if self.first_report is not None:
            row.update((k, v) for k, v in self.first_report.items() if v is not None)
            self.first_report = None
        self.reporter.add(row)
        if save:  # the snapshot, the previous upload's end, the final gather: however long
            with self.heartbeat.meant_wait():
                self.reporter.send_with_checkpoint(self.parts, self.state, self.run_record,
                                                   final=is_final_save(self.cfg, epoch, epoch_end,
                                                                       self.validator.stopped, last))
        elif agreed.send:
            self.reporter.send()
        else:  # held until a report: on every rank, for a snapshot to keep
            self.snapshots.share_rows()
        self.heartbeat.tick()
        if notice is not None and not last and not self.validator.stopped:
            with self.heartbeat.pause():
                wait_for_restart(notice["preemption_deadline"])
        # the next window starts now, after the report and any checkpoint: a window's time
        # is its steps' (samples_per_s is the rate of training steps; the summary's
        # train_samples_per_s counts everything)
        self.window = WindowState.start(self.parts.devices[0], self.parts.devices[-1])

    def _all_weights_finite(self) -> bool:
        flag = torch.tensor([float(not weights_are_finite(self.parts.model))],
                            device=self.reporter.collective_device)
        dist.all_reduce(flag)
        return not flag.item()


def should_save(cfg, epoch_done: int, step: int) -> bool:
    """Checkpoint every ``checkpoint_every`` epochs and after the last one (at an epoch's
    end: ``epoch_done`` > 0), and every ``checkpoint_every_steps`` global steps."""
    by_epoch = epoch_done > 0 and (epoch_done % cfg.checkpoint_every == 0 or epoch_done == cfg.epochs)
    return by_epoch or bool(cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0)


def is_final_save(cfg, epoch: int, epoch_end: bool, early_stopped: bool = False, last_step: bool = False) -> bool:
    """Whether a checkpoint also writes the whole model (FSDP: gathered from every rank):
    only at the run's end (the last epoch's, the step --early-stop or --max-steps ends it
    at), never on a preemption or cadence checkpoint before it."""
    ends = last_step or early_stopped or (epoch_end and epoch + 1 == cfg.epochs)
    return ends and not cfg.skip_final_model
