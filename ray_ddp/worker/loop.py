"""The training loop: what TorchTrainer starts on every worker. Runs on workers.
"""

from __future__ import annotations

import time
from typing import Optional
import ray
import ray.train
from ray import cloudpickle
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from ray_ddp.checkpoint.format import restore_rng
from ray_ddp.checkpoint.verify import weights_hash
from ray_ddp.config.train import TrainConfig
from ray_ddp.data.plan import fit_to_world
from ray_ddp.worker.devices import peak_memory_mb
from ray_ddp.parallel.ddp import wrap_ddp
from ray_ddp.parallel.fsdp import shard_model
from ray_ddp.data.inputs import ValSet, build_inputs
from ray_ddp.models.build import build_model, load_callable
from ray_ddp.worker.report import Reporter
from ray_ddp.tasks import Task, batch_rows, build_task, forward, to_device
from ray_ddp.checkpoint.resume import load_checkpoint_to_resume
from ray_ddp.errors import NonFiniteLossError, UnusedParametersError
from ray_ddp.worker.checks import broadcast_buffers, weights_are_finite
from ray_ddp.worker.devices import _worker_devices
from ray_ddp.worker.parts import TrainParts, build_optimizer, build_scheduler
from ray_ddp.worker.preemption import DEFAULT_PREEMPTION_WAIT_S, wait_for_restart
from ray_ddp.worker.window import _BusyClock, _Window


def train_loop_per_worker(loop_config: dict) -> None:
    """``loop_config``: {"config": TrainConfig as a dict, "resume_from": the checkpoint
    folder the driver checked, or None, "newest_at_start": the newest checkpoint folder
    when the run began, "total_steps": the step the run ends at, "objects": what the
    Python API passed (model, train_data, val_data, loss; Ray ships them pickled)}."""
    started_at = time.time()  # reported once: where the start-up seconds went
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    # an elastic run gets its world size from Ray at each (re)start: the fixed global
    # batch is cut into micro-batches and accumulation steps for this one
    cfg = fit_to_world(TrainConfig.from_dict(loop_config["config"]), world_size)
    objects = cloudpickle.loads(loop_config["objects"]) if loop_config.get("objects") else {}
    devices = _worker_devices(cfg)
    # as many intra-op threads as the cores this worker reserved (Ray's OMP_NUM_THREADS
    # follows the CPUs it asked for, but torch may have read it before)
    torch.set_num_threads(cfg.cpus_per_worker or 1)

    # The same seed on every rank gives the same initial weights (DDP also broadcasts
    # rank 0's at wrap time); the per-rank reseed keeps dropout-like noise independent.
    torch.manual_seed(cfg.seed)
    fsdp = cfg.strategy == "fsdp"
    # FSDP: the whole model is built in host memory, then only this rank's shards go to the GPU
    model = build_model(cfg, [torch.device("cpu")] if fsdp else devices, objects.get("model"))
    if cfg.sync_batchnorm:  # before DDP wraps it: statistics over the global batch
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if fsdp:  # before the optimizer: it must hold the sharded parameters
        model = shard_model(model, cfg, devices[0])
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, loop_config["total_steps"])
    scaler = torch.amp.GradScaler(devices[0].type, enabled=cfg.amp == "fp16")
    state = load_checkpoint_to_resume(cfg, loop_config, model, optimizer,
                                      {"scheduler": scheduler, "scaler": scaler})
    # reported once: proves every rank loaded the same weights
    loaded_hash = weights_hash(model) if state.step else None
    if len(state.rng) == world_size:
        restore_rng(state.rng[rank], devices)
    else:
        torch.manual_seed(cfg.seed + 7919 * (rank + 1) + state.step)

    wrapped = model if fsdp else wrap_ddp(model, devices, cfg.find_unused_parameters,
                                          bucket_view=not cfg.plain_ddp, static_graph=cfg.static_graph,
                                          bucket_mb=cfg.bucket_mb)
    parts = TrainParts(model, wrapped, torch.compile(wrapped) if cfg.compile else wrapped,
                       optimizer, scheduler, scaler, devices,
                       grads_in_buckets=isinstance(wrapped, DDP) and wrapped.gradient_as_bucket_view)
    loss_fn = objects.get("loss") or (load_callable(cfg.loss, what="loss") if cfg.loss else None)
    task = build_task(cfg.task or "regression", cfg.seq_len, loss_fn)
    source, val_set = build_inputs(cfg, rank, world_size, devices[0], objects)
    run = _WorkerRun(cfg, rank, world_size, devices, parts, task, source, val_set, state, loaded_hash,
                     started_at, loop_config["total_steps"])
    try:
        run.train()
    except RuntimeError as err:
        if "find_unused_parameters=True" in str(err) and not cfg.find_unused_parameters:
            raise UnusedParametersError(
                "the model's forward did not use every parameter, and DDP needs each one's "
                "gradient for its all-reduce; pass --find-unused-parameters") from None
        raise


class _WorkerRun:
    """One worker's training run: epochs of steps, closed into metrics windows."""

    def __init__(self, cfg, rank, world_size, devices, parts: TrainParts, task: Task, source,
                 val_set: Optional[ValSet], state, loaded_hash, started_at: float, total_steps: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.node_rank = ray.train.get_context().get_node_rank()
        self.node_id = ray.get_runtime_context().get_node_id()
        # extra columns of this run's first report only; None once it is sent
        self.first_report: Optional[dict] = {"loaded_hash": loaded_hash, "started_at": started_at}
        self.parts, self.state = parts, state
        self.model, self.optimizer = parts.model, parts.optimizer
        self.in_device, self.out_device = devices[0], devices[-1]
        self.task, self.source, self.val_set = task, source, val_set
        # FSDP's mixed precision casts the parameters itself: no autocast on top of it
        self.amp_dtype = None if cfg.strategy == "fsdp" else \
            {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.window = self._new_window()
        self.total_steps = total_steps
        self.preemptions_seen: set[tuple[str, ...]] = set()
        nccl = dist.get_backend() == "nccl"
        self.reporter = Reporter(rank, world_size, cfg.report_interval,
                                 self.in_device if nccl else torch.device("cpu"),
                                 sharded=cfg.strategy == "fsdp")

    def train(self) -> None:
        for epoch in range(self.state.epoch, self.cfg.epochs):
            self._run_epoch(epoch)

    def _run_epoch(self, epoch: int) -> None:
        cfg = self.cfg
        for i in range(self.state.epoch_step, cfg.steps_per_epoch):  # >0 only on mid-epoch resume
            self._run_step(epoch, i)
            if self.first_report is not None and "first_step_at" not in self.first_report:
                if self.in_device.type == "cuda":
                    torch.cuda.synchronize(self.in_device)  # once: the step really ended
                self.first_report["first_step_at"] = time.time()
            last_of_epoch = i == cfg.steps_per_epoch - 1
            if last_of_epoch:
                self.state.epoch, self.state.epoch_step = epoch + 1, 0
                broadcast_buffers(self.model, self.reporter.collective_device)
                evaluated = self._evaluate(epoch) if should_evaluate(cfg, epoch + 1, self.val_set) else None
                self._close_window(epoch, save=should_save(cfg, epoch + 1), epoch_end=True,
                                   evaluated=evaluated)
            elif (i + 1) % cfg.report_every == 0:
                self._close_window(epoch, save=False, epoch_end=False)

    def _autocast(self):
        return torch.autocast(self.in_device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def _run_step(self, epoch: int, i: int) -> None:
        """One optimizer step over ``grad_accum`` micro-batches of this rank's rows."""
        cfg, p, w = self.cfg, self.parts, self.window
        p.zero_grad()
        for micro in range(cfg.grad_accum):
            started = w.busy.start()
            x, y, share = self.source.micro_batch(epoch, i, micro)
            x, y = to_device(x, self.in_device), to_device(y, self.out_device)
            last = micro == cfg.grad_accum - 1
            # DDP all-reduces gradients during backward: only once per step, on the last
            # micro-batch; the others accumulate locally under no_sync().
            with p.gradient_sync(last):
                with self._autocast():
                    out = forward(p.forward, x)
                sums = self.task.sums(out, y)
                # summed loss / this rank's share of the step's units: DDP's mean over
                # ranks is then the exact mean over the global batch, however it is split
                loss = sums["loss"] / (share * self.task.units_per_row)
                w.busy.stop(started)
                p.scaler.scale(loss).backward()
            for key, value in sums.items():
                w.sums[key] = w.sums.get(key, 0) + (value.detach() if torch.is_tensor(value) else value)
            w.loss_bad |= ~torch.isfinite(sums["loss"].detach())
            w.samples += batch_rows(y)
        if cfg.clip_grad > 0:
            p.scaler.unscale_(p.optimizer)
            torch.nn.utils.clip_grad_norm_(p.model.parameters(), cfg.clip_grad)
        p.scaler.step(p.optimizer)
        p.scaler.update()
        p.scheduler.step()
        self.state.step += 1
        self.state.epoch_step += 1
        w.steps += 1

    def _evaluate(self, epoch: int) -> dict:
        """Validation: every rank evaluates its contiguous part of the validation rows
        under eval() and no_grad(), and one all-reduce of the task's sums gives the exact
        figures over every row, counted once. Its time is left out of the training
        windows (the next window starts after it)."""
        started = time.perf_counter()
        model, task = self.parts.model, self.task
        modes = [(m, m.training) for m in model.modules()]  # a frozen BatchNorm stays frozen
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            # FSDP's forward gathers parameters from every rank: all ranks run as many
            for x, y in self.val_set.batches(self.rank, self.world_size, self.cfg.batch_size,
                                             equal_counts=self.cfg.strategy == "fsdp"):
                x, y = to_device(x, self.in_device), to_device(y, self.out_device)
                with self._autocast():
                    out = forward(model, x)
                for key, value in task.sums(out, y).items():
                    totals[key] = totals.get(key, 0) + (value.double() if torch.is_tensor(value) else value)
        for module, training in modes:
            module.train(training)
        keys = ("loss", "units", "correct")
        flat = torch.tensor([float(totals.get(k, 0.0)) for k in keys], dtype=torch.float64,
                            device=self.reporter.collective_device)
        dist.all_reduce(flat)
        summed = dict(zip(keys, flat.tolist()))
        result = {f"val_{k}": v for k, v in task.metrics(summed).items()}
        result.update(val_samples=int(round(summed["units"] / task.units_per_row)),
                      val_time_s=time.perf_counter() - started)
        self.window.started += result["val_time_s"]
        return result

    def _close_window(self, epoch: int, save: bool, epoch_end: bool, evaluated: Optional[dict] = None) -> None:
        """End this rank's metrics window (one metrics.parquet row), stop every rank
        together if any saw a non-finite loss (or, before a checkpoint, weights), and
        send the rows not yet sent when a checkpoint or a send is due. When a node of
        the run is being preempted, save a checkpoint here, whatever the step, and wait
        for Ray to restart the run without that node."""
        w = self.window
        # windows run from close to close, so the cost of sending (a barrier, a
        # checkpoint) shows in the throughput of the window after it
        now = time.perf_counter()
        due, check, bad_loss, bad_weights = self.reporter.agree(
            bool(w.loss_bad.item()), save and not weights_are_finite(self.model))
        self._stop_if_not_finite(epoch, bad_loss, bad_weights)
        notice = self._preemption_notice() if check else None  # the same on every rank
        if notice is not None and not save:
            flag = torch.tensor([float(not weights_are_finite(self.model))],
                                device=self.reporter.collective_device)
            dist.all_reduce(flag)  # never checkpoint poisoned weights, even now
            save = not flag.item()
        elapsed = now - w.started
        samples = w.samples
        totals = {k: float(v) for k, v in w.sums.items()}  # one device sync per window, not per step
        metrics = {
            "epoch": epoch + 1,
            "step": self.state.step,
            "rank": self.rank,
            "node_rank": self.node_rank,
            "node_id": self.node_id,
            "world_size": self.world_size,
            **self.task.metrics(totals),
            "samples": samples,
            "step_time_s": elapsed,
            "busy_s": w.busy.read(),
            "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
            "time": time.time(),
            "lr": self.optimizer.param_groups[0]["lr"],
            "units": totals.get("units", 0.0),
            **peak_memory_mb(self.in_device),
        }
        if epoch_end:
            metrics["weights_hash"] = weights_hash(self.model)
        if evaluated is not None:
            metrics.update(evaluated)
        if notice is not None:
            metrics.update(notice)
        if self.first_report is not None:
            metrics.update((k, v) for k, v in self.first_report.items() if v is not None)
            self.first_report = None
        self.reporter.add(metrics)
        if save:
            self.reporter.send_with_checkpoint(self.parts, self.state, self.cfg.to_dict(),
                                               final=is_final_save(self.cfg, epoch, epoch_end))
        elif due:
            self.reporter.send()
        if notice is not None and self.state.step < self.total_steps:
            wait_for_restart(notice["preemption_deadline"])
        self.window = self._new_window(started=time.perf_counter() if notice else now)

    def _stop_if_not_finite(self, epoch: int, bad_loss: list[int], bad_weights: list[int]) -> None:
        if bad_loss or bad_weights:
            what = "loss" if bad_loss else "weights"
            ranks = bad_loss or bad_weights
            on = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"
            raise NonFiniteLossError(
                f"{what} became non-finite (NaN or inf) on {on} in epoch {epoch + 1} by "
                f"step {self.state.step}; no checkpoint holds them; lower --lr, set --clip-grad, "
                "or check the data")

    def _preemption_notice(self) -> Optional[dict]:
        """A new preemption of a node of this run, as metrics columns (the preempted
        nodes and the deadline, in seconds since the epoch), or None. Asked of Ray on
        every rank at once (a barrier); each preemption is answered once."""
        info = ray.train.get_preemption_info()
        if info is None or tuple(info.preempted_node_ids) in self.preemptions_seen:
            return None
        self.preemptions_seen.add(tuple(info.preempted_node_ids))
        deadline = info.deadline_ms / 1000 if info.deadline_ms else time.time() + DEFAULT_PREEMPTION_WAIT_S
        return {"preempted_node": ",".join(info.preempted_node_ids), "preemption_deadline": deadline}

    def _new_window(self, started: Optional[float] = None) -> _Window:
        return _Window(sums={}, busy=_BusyClock(self.in_device),
                       started=time.perf_counter() if started is None else started,
                       loss_bad=torch.zeros((), dtype=torch.bool, device=self.out_device))


def should_save(cfg: TrainConfig, epoch_done: int) -> bool:
    """Checkpoint every ``checkpoint_every`` epochs, and always after the last one."""
    return epoch_done % cfg.checkpoint_every == 0 or epoch_done == cfg.epochs


def should_evaluate(cfg: TrainConfig, epoch_done: int, val_set: Optional[ValSet]) -> bool:
    """Validate every ``eval_every`` epochs, and always after the last one."""
    return val_set is not None and (epoch_done % cfg.eval_every == 0 or epoch_done == cfg.epochs)


def is_final_save(cfg: TrainConfig, epoch: int, epoch_end: bool) -> bool:
    """Whether a checkpoint also writes the whole model (FSDP: gathered from every rank):
    only at the last epoch's end, never on a preemption checkpoint within the last epoch,
    whose deadline is running."""
    return epoch_end and epoch + 1 == cfg.epochs and not cfg.skip_final_model
