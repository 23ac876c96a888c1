"""The training loop: the only code that runs on Ray Train workers.

``train_loop_per_worker`` is what TorchTrainer starts on every worker. Ray has already
joined the worker to the process group (NCCL or gloo) and given it its devices. The
loop rebuilds the config from the dict the driver shipped, builds the model on those
devices, loads the latest checkpoint into the bare model (before DDP wraps it, so no
``module.`` prefix is involved), trains, and reports. Every rank calls
``ray.train.report`` at exactly the same steps: report() is a barrier.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import CheckpointError, TrainState, capture_rng, checkpoint_dir_name, \
    load_checkpoint, restore_rng, snapshot_checkpoint, verify_checkpoint, weights_hash, \
    write_checkpoint
from .config import TrainConfig
from .data import DatasetSource, StreamSource, SyntheticSource, TableSource, teacher_weights
from .devices import peak_memory_mb, wrap_ddp
from .models import build_model
from .storage import resolve_storage


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the poisoned weights are never checkpointed."""


def train_loop_per_worker(loop_config: dict) -> None:
    """``loop_config``: {"config": TrainConfig as a dict, "resume_from": the checkpoint
    folder the driver checked, or None}."""
    started_at = time.time()  # reported once: where the start-up seconds went
    cfg = TrainConfig.from_dict(loop_config["config"])
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    devices = _worker_devices(cfg)
    # as many intra-op threads as the cores this worker reserved (Ray's OMP_NUM_THREADS
    # follows the CPUs it asked for, but torch may have read it before)
    torch.set_num_threads(cfg.cpus_per_worker or 1)

    # The same seed on every rank gives the same initial weights (DDP also broadcasts
    # rank 0's at wrap time); the per-rank reseed keeps dropout-like noise independent.
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, devices)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler(devices[0].type, enabled=cfg.amp == "fp16")
    state = load_latest_checkpoint(cfg, loop_config["resume_from"], model, optimizer,
                                   {"scheduler": scheduler, "scaler": scaler})
    # reported once: proves every rank loaded the same weights
    loaded_hash = weights_hash(model) if state.step else None
    if len(state.rng) == world_size:
        restore_rng(state.rng[rank])
    else:
        torch.manual_seed(cfg.seed + 7919 * (rank + 1) + state.step)

    ddp_model = wrap_ddp(model, devices)
    parts = TrainParts(model, ddp_model, torch.compile(ddp_model) if cfg.compile else ddp_model,
                       optimizer, scheduler, scaler)
    _WorkerRun(cfg, rank, world_size, devices, parts, state, loaded_hash, started_at).train()


@dataclass
class TrainParts:
    """What a step touches: the bare model (saved), its DDP wrapper (no_sync), what runs
    the forward pass (the wrapper, or its torch.compile), optimizer, LR schedule, scaler."""

    model: nn.Module
    ddp_model: nn.Module
    forward: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler

    def stateful(self) -> dict:
        return {"scheduler": self.scheduler, "scaler": self.scaler}


def load_latest_checkpoint(cfg: TrainConfig, resume_from: Optional[str], model: nn.Module,
                           optimizer: torch.optim.Optimizer, stateful: dict) -> TrainState:
    """Load the newest whole checkpoint into the bare model; a fresh TrainState if none.

    Ray's latest (it moves on after an in-run restart) comes first; if its files do not
    match its meta.json, the one the driver checked at start is the fallback.
    """
    candidates = []
    latest = ray.train.get_checkpoint()
    if latest is not None:
        candidates.append(latest)
    if resume_from is not None and (latest is None or not latest.path.endswith("/" + resume_from)):
        store = resolve_storage(cfg.storage)
        candidates.append(ray.train.Checkpoint(f"{store.run_path(cfg.name)}/{resume_from}", store.fs))
    problems = []
    for checkpoint in candidates:
        with checkpoint.as_directory() as directory:
            problem = verify_checkpoint(directory)
            if problem is None:
                return load_checkpoint(directory, model, optimizer, stateful)
        problems.append(f"{checkpoint.path.rsplit('/', 1)[-1]}: {problem}")
    if problems:
        raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(problems))
    return TrainState()


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


def build_source(cfg: TrainConfig, rank: int, world_size: int, device: torch.device):
    """Where this rank's rows come from: synthetic, a parquet table (in memory, or streamed
    row group by row group), or a user Dataset."""
    if cfg.dataset is not None:
        from .datasets import load_user_dataset

        return DatasetSource(load_user_dataset(cfg.dataset), cfg.seed, rank, world_size,
                             cfg.batch_size, cfg.grad_accum)
    if cfg.data != "synthetic":
        from .datasets import inspect_table, list_row_groups, load_table, row_group_reader

        table = inspect_table(cfg.data, cfg.features, cfg.target)
        if cfg.stream:
            return StreamSource(list_row_groups(table), row_group_reader(table), cfg.seed, rank,
                                world_size, cfg.batch_size, cfg.grad_accum)
        x, y = load_table(table)
        return TableSource(x, y, cfg.seed, rank, world_size, cfg.batch_size, cfg.grad_accum)
    teacher = teacher_weights(cfg.seed, cfg.input_dim, cfg.output_dim).to(device)
    return SyntheticSource(teacher, cfg.seed, rank, world_size, cfg.batch_size, cfg.grad_accum)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer):
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to 0 at the end."""
    total = cfg.epochs * cfg.steps_per_epoch

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def should_save(cfg: TrainConfig, epoch_done: int) -> bool:
    """Checkpoint every ``checkpoint_every`` epochs, and always after the last one."""
    return epoch_done % cfg.checkpoint_every == 0 or epoch_done == cfg.epochs


def _lower_thread_priority() -> None:
    """Raise this thread's nice value (Linux sets it per thread); anywhere else, or if
    refused, leave it as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _worker_devices(cfg: TrainConfig) -> list[torch.device]:
    """This worker's devices, from Ray; a two-stage model on one device uses it twice."""
    devices = list(ray.train.torch.get_devices()) if cfg.gpus_per_worker else [torch.device("cpu")]
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])  # collectives of this process use this GPU
    if cfg.model == "toy-mp" and len(devices) == 1:
        devices = devices * 2
    return devices


class _BusyClock:
    """Seconds this rank spends on its own work (data and forward pass), outside the
    gradient all-reduce in backward, where every rank waits for the slowest: in DDP the
    wall time per step is the same on every rank, so this is what shows a straggler.
    CUDA events time GPU work without a sync per step (one sync when read)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.pending: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((started, end))
        else:
            self.seconds += time.perf_counter() - started

    def read(self) -> float:
        if self.pending:
            self.pending[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.pending) / 1000.0
            self.pending.clear()
        return self.seconds


@dataclass
class _Window:
    """What this rank did since its previous report."""

    loss_sum: torch.Tensor
    busy: _BusyClock
    steps: int = 0
    samples: int = 0
    started: float = 0.0


class _WorkerRun:
    """One worker's training run: epochs of steps, reports, and rank 0's checkpoints."""

    def __init__(self, cfg, rank, world_size, devices, parts: TrainParts, state, loaded_hash,
                 started_at: float):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.node_rank = ray.train.get_context().get_node_rank()
        self.node_id = ray.get_runtime_context().get_node_id()
        # extra columns of this run's first report only; None once it is sent
        self.first_report: Optional[dict] = {"loaded_hash": loaded_hash, "started_at": started_at}
        self.parts, self.state = parts, state
        self.model, self.optimizer = parts.model, parts.optimizer
        self.in_device, self.out_device = devices[0], devices[-1]
        self.source = build_source(cfg, rank, world_size, devices[0])
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.window = self._new_window()
        self.unsent: list[dict] = []  # closed windows not yet sent to Ray
        self.last_sent = time.perf_counter()
        # rank 0's checkpoint writer: set while no write is in flight; its host copy is reused
        self.written = threading.Event()
        self.written.set()
        self.snapshot = None

    def train(self) -> None:
        for epoch in range(self.state.epoch, self.cfg.epochs):
            self._run_epoch(epoch)

    def _run_epoch(self, epoch: int) -> None:
        cfg = self.cfg
        first = self.state.step - epoch * cfg.steps_per_epoch  # >0 only on mid-epoch resume
        for i in range(first, cfg.steps_per_epoch):
            self._run_step(epoch, i)
            if self.first_report is not None and "first_step_at" not in self.first_report:
                if self.in_device.type == "cuda":
                    torch.cuda.synchronize(self.in_device)  # once: the step really ended
                self.first_report["first_step_at"] = time.time()
            last_of_epoch = i == cfg.steps_per_epoch - 1
            if last_of_epoch:
                self.state.epoch = epoch + 1
                self._close_window(epoch, save=should_save(cfg, epoch + 1), epoch_end=True)
            elif (i + 1) % cfg.report_every == 0:
                self._close_window(epoch, save=False, epoch_end=False)

    def _run_step(self, epoch: int, i: int) -> None:
        """One optimizer step over ``grad_accum`` micro-batches of this rank's rows."""
        cfg, p, w = self.cfg, self.parts, self.window
        p.optimizer.zero_grad(set_to_none=True)
        for micro in range(cfg.grad_accum):
            started = w.busy.start()
            x, y, share = self.source.micro_batch(epoch, i, micro)
            x = x.to(self.in_device, non_blocking=True)
            y = y.to(self.out_device, non_blocking=True)
            last = micro == cfg.grad_accum - 1
            # DDP all-reduces gradients during backward: only once per step, on the last
            # micro-batch; the others accumulate locally under no_sync().
            with contextlib.nullcontext() if last else p.ddp_model.no_sync():
                with torch.autocast(self.in_device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                    out = p.forward(x)
                # summed squared error / this rank's share of the step's rows: DDP's mean
                # over ranks is then the exact MSE over the global batch, however it is split
                loss = (out.float() - y).pow(2).sum() / (y.shape[1] * share)
                w.busy.stop(started)
                p.scaler.scale(loss).backward()
            w.loss_sum += loss.detach()
            w.samples += len(x)
        if cfg.clip_grad > 0:
            p.scaler.unscale_(p.optimizer)
            torch.nn.utils.clip_grad_norm_(p.model.parameters(), cfg.clip_grad)
        p.scaler.step(p.optimizer)
        p.scaler.update()
        p.scheduler.step()
        self.state.step += 1
        w.steps += 1

    def _close_window(self, epoch: int, save: bool, epoch_end: bool) -> None:
        """End this rank's metrics window (one metrics.parquet row) and send the rows
        not yet sent to Ray when a checkpoint is due, or when ``report_interval`` has
        passed: Ray Train V2's controller takes one report per worker each time it
        polls (every 2 s by default) and a report made sooner blocks training until
        then, so sending every window would stall a fast loop."""
        w = self.window
        loss = (w.loss_sum / w.steps).item()  # one device sync per window, not per step
        # windows run from close to close, so the cost of sending (a barrier, a
        # checkpoint) shows in the throughput of the window after it
        now = time.perf_counter()
        elapsed = now - w.started
        samples = w.samples
        metrics = {
            "epoch": epoch + 1,
            "step": self.state.step,
            "rank": self.rank,
            "node_rank": self.node_rank,
            "node_id": self.node_id,
            "world_size": self.world_size,
            "loss": loss,
            "samples": samples,
            "step_time_s": elapsed,
            "busy_s": w.busy.read(),
            "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
            "time": time.time(),
            "lr": self.optimizer.param_groups[0]["lr"],
            **peak_memory_mb(self.in_device),
        }
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"loss became {loss} on rank {self.rank} in epoch {epoch + 1} by step "
                f"{self.state.step}; lower --lr or check the data"
            )
        if epoch_end:
            metrics["weights_hash"] = weights_hash(self.model)
        if self.first_report is not None:
            metrics.update((k, v) for k, v in self.first_report.items() if v is not None)
            self.first_report = None
        self.unsent.append(metrics)
        if save:
            self._send_with_checkpoint()
        elif self._send_due():
            self._send()
        self.window = self._new_window(started=now)

    def _send_due(self) -> bool:
        """Whether ``report_interval`` has passed, on rank 0's clock: every rank must take
        the same decision (a report is a barrier), so rank 0's is broadcast."""
        if self.cfg.report_interval <= 0:
            return True
        # a send waits behind a checkpoint still being written (Ray keeps reports in
        # order), so none is due until the write is done
        due = time.perf_counter() - self.last_sent >= self.cfg.report_interval and self.written.is_set()
        flag = torch.tensor([int(due)], device=self.in_device if dist.get_backend() == "nccl" else "cpu")
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _payload(self) -> dict:
        """The newest row at the top (Ray keeps it with a checkpoint), older unsent rows
        under ``earlier``; MetricsCallback unpacks them in order."""
        *earlier, latest = self.unsent
        self.unsent, self.last_sent = [], time.perf_counter()
        return {**latest, "earlier": earlier} if earlier else latest

    def _send(self) -> None:
        ray.train.report(self._payload(), checkpoint=None)

    def _send_with_checkpoint(self) -> None:
        """Rank 0 saves a checkpoint; every rank reports. Training waits only for a copy
        of the state in host memory (into the previous copy's memory, once that is
        written): Ray's upload thread (ASYNC) then writes the files straight into run
        storage, at low CPU priority, while training goes on. Ray needs a local folder to
        hand that thread (an empty one here, which it deletes). Ray keeps reports in
        order, so checkpoints land in order and each is whole before it counts."""
        rng = [None] * self.world_size
        dist.all_gather_object(rng, capture_rng())  # every rank's RNG goes into the file
        self.state.rng = rng
        name = checkpoint_dir_name(self.state.step)
        if self.rank != 0:
            ray.train.report(self._payload(), checkpoint=None, checkpoint_dir_name=name)
            return
        self.written.wait()  # the only wait: the previous checkpoint still being written
        self.written.clear()
        snapshot = self.snapshot = snapshot_checkpoint(
            self.model, self.optimizer, self.state, self.cfg.to_dict(), self.rank,
            self.parts.stateful(), reuse=self.snapshot)
        storage = ray.train.get_context().get_storage()

        def write_to_storage(_local: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
            try:
                _lower_thread_priority()  # the training thread comes first for the CPU
                path = storage.build_checkpoint_path_from_name(dir_name)
                write_checkpoint(path, snapshot, storage.storage_filesystem)
                return ray.train.Checkpoint(path, storage.storage_filesystem)
            finally:
                self.written.set()

        ray.train.report(
            self._payload(),
            checkpoint=ray.train.Checkpoint.from_directory(tempfile.mkdtemp(prefix="ray_ddp_ckpt_")),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=write_to_storage,
        )

    def _new_window(self, started: Optional[float] = None) -> _Window:
        return _Window(loss_sum=torch.zeros((), device=self.out_device), busy=_BusyClock(self.in_device),
                       started=time.perf_counter() if started is None else started)
