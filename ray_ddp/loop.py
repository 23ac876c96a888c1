"""The training loop: the only code that runs on Ray Train workers.

``train_loop_per_worker`` is what TorchTrainer starts on every worker. Ray has already
joined the worker to the process group (NCCL or gloo) and given it its devices. The
loop rebuilds the config from the dict the driver shipped, builds the model on those
devices, loads the latest checkpoint into the bare model (before DDP wraps it, so no
``module.`` prefix is involved; under FSDP, into the sharded model, each rank its
shards), trains, validates, and reports. Every rank calls
``ray.train.report`` at exactly the same steps: report() is a barrier.

Three jobs are kept apart: the step (``_WorkerRun``; a ``Task`` decides the loss, the
metrics and how a batch reaches the device), the reporting to Ray (``Reporter``), and
the checkpoint writer inside the reporter (rank 0's ``CheckpointWriter`` under DDP, every
rank's ``ShardedCheckpointWriter`` under FSDP).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Optional

import ray
import ray.train
from ray import cloudpickle
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .checkpoint import CheckpointError, TrainState, load_checkpoint, restore_rng, \
    verify_checkpoint, weights_hash
from .config import TrainConfig
from .dataplan import fit_to_world
from .devices import peak_memory_mb, wrap_ddp
from .fsdp import shard_model
from .inputs import ValSet, build_inputs
from .models import build_model, load_callable
from .reporting import Reporter
from .sharded import is_sharded_checkpoint, load_sharded_checkpoint
from .storage import resolve_storage
from .tasks import Task, batch_rows, build_task, forward, to_device


class UnusedParametersError(RuntimeError):
    """DDP found parameters that the forward pass did not use."""


class NonFiniteLossError(RuntimeError):
    """The loss or the weights became NaN or infinite; poisoned weights are never checkpointed."""


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


@dataclass
class TrainParts:
    """What a step touches: the model (bare under DDP, which a checkpoint saves; sharded
    in place under FSDP), its parallel wrapper (the DDP module, or the FSDP model itself),
    what runs the forward pass (the wrapper, or its torch.compile), optimizer, LR
    schedule, scaler, and this worker's devices (whose RNG a checkpoint keeps)."""

    model: nn.Module
    wrapped: nn.Module
    forward: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    devices: list[torch.device]
    grads_in_buckets: bool = False  # DDP's gradient_as_bucket_view

    def zero_grad(self) -> None:
        """Gradients that are views into DDP's buckets are zeroed in place: set to None,
        they are reallocated every step and the bucket view saves nothing (as torch's
        docstring of gradient_as_bucket_view says)."""
        self.optimizer.zero_grad(set_to_none=not self.grads_in_buckets)

    def stateful(self) -> dict:
        return {"scheduler": self.scheduler, "scaler": self.scaler}

    def gradient_sync(self, sync: bool):
        """Whether this micro-batch's backward reduces gradients across the ranks: only
        the last of a step does; the others accumulate locally."""
        if isinstance(self.wrapped, DDP):
            return contextlib.nullcontext() if sync else self.wrapped.no_sync()
        self.wrapped.set_requires_gradient_sync(sync)  # FSDP
        return contextlib.nullcontext()


def load_checkpoint_to_resume(cfg: TrainConfig, loop_config: dict, model: nn.Module,
                              optimizer: torch.optim.Optimizer, stateful: dict) -> TrainState:
    """Load into the bare model the checkpoint the driver checked and announced
    (``resume_from``), or, after a restart within this run, the newer one Ray hands back
    (newer than any that existed when the run began); a fresh TrainState if neither.
    Every file is checked against its meta.json (size and CRC-32) before it is loaded."""
    store = resolve_storage(cfg.storage)
    candidates = []
    latest = ray.train.get_checkpoint()
    if latest is not None and _dir_name(latest.path) > (loop_config["newest_at_start"] or ""):
        candidates.append(latest)  # written by this run before a worker died
    if loop_config["resume_from"] is not None:
        path = f"{store.run_path(cfg.name)}/{loop_config['resume_from']}"
        candidates.append(ray.train.Checkpoint(path, store.fs))
    problems = []
    for checkpoint in candidates:
        with checkpoint.as_directory() as directory:
            sharded = is_sharded_checkpoint(directory)
            problem = verify_checkpoint(directory, shards_by_size=sharded)
            if problem is None:
                load = load_sharded_checkpoint if sharded else load_checkpoint
                return load(directory, model, optimizer, stateful)
        problems.append(f"{_dir_name(checkpoint.path)}: {problem}")
    if problems:
        raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(problems))
    return TrainState()


def _dir_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total: int):
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to 0 at step
    ``total``, the run's last (which the driver works out: a resume on another world size
    has other steps per epoch from there on)."""

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


def should_evaluate(cfg: TrainConfig, epoch_done: int, val_set: Optional[ValSet]) -> bool:
    """Validate every ``eval_every`` epochs, and always after the last one."""
    return val_set is not None and (epoch_done % cfg.eval_every == 0 or epoch_done == cfg.epochs)


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
    """What this rank did since its previous report: the task's sums (loss over units,
    units, correct predictions), kept on the device so a step never waits for them."""

    sums: dict[str, torch.Tensor]
    busy: _BusyClock
    steps: int = 0
    samples: int = 0
    started: float = 0.0
    # set (on the device, no sync) once any micro-batch's loss was NaN or infinite
    loss_bad: Optional[torch.Tensor] = None


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


# When a drain names no deadline, Ray restarts the run this long after the notice
# (ray.train.v2 DEFAULT_PREEMPTION_DEADLINE_S).
DEFAULT_PREEMPTION_WAIT_S = 120.0
# How long past the deadline a rank waits for the restart before it trains on (the drain
# was called off, or the node outlived its deadline).
RESTART_WAIT_S = 60.0


def wait_for_restart(deadline: float) -> None:
    """After a preemption checkpoint: train no further (those steps would be lost with the
    node) and let Ray restart the run from that checkpoint, which it does at the deadline
    (counting it against --max-preemptions)."""
    while time.time() < deadline + RESTART_WAIT_S:
        time.sleep(0.5)


def is_final_save(cfg: TrainConfig, epoch: int, epoch_end: bool) -> bool:
    """Whether a checkpoint also writes the whole model (FSDP: gathered from every rank):
    only at the last epoch's end, never on a preemption checkpoint within the last epoch,
    whose deadline is running."""
    return epoch_end and epoch + 1 == cfg.epochs and not cfg.skip_final_model


def broadcast_buffers(model: nn.Module, collective_device: torch.device) -> None:
    """Give every rank rank 0's buffers (BatchNorm's running statistics). Each rank's
    forward updates its own from its own rows, so they drift apart within a step; DDP
    broadcasts rank 0's at each forward, and this does the same before validation and a
    checkpoint, so every rank validates with, and hashes, the buffers rank 0 saves."""
    if dist.get_world_size() == 1:
        return
    for buffer in model.buffers():
        if hasattr(buffer, "to_local"):
            continue  # a DTensor: FSDP keeps it consistent itself
        if buffer.device == collective_device:
            dist.broadcast(buffer, src=0)
        else:  # gloo on CPU for buffers on a GPU (a two-stage model on gloo, never NCCL)
            staged = buffer.to(collective_device)
            dist.broadcast(staged, src=0)
            buffer.copy_(staged)


def weights_are_finite(model: nn.Module) -> bool:
    """Whether every floating tensor of the state (weights, BatchNorm statistics) is finite:
    checked before a checkpoint, since the loss is computed before the update that may
    have made them infinite."""
    # FSDP: this rank's shard (agree() ORs the ranks)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
    floats = [t.detach() for t in local if t.is_floating_point()]
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in floats:
        # a sum is finite when every term is (a NaN or inf carries into it): one read of
        # the weights, no mask as big as them (0.02 s for 50M parameters here, not 0.3)
        wide = torch.float64 if t.dtype == torch.float64 else torch.float32
        per_device.setdefault(t.device, []).append(t.sum(dtype=wide).isfinite())
    if all(bool(torch.stack(flags).all()) for flags in per_device.values()):  # a sync per device
        return True
    # a non-finite sum: an inf or NaN, or finite values whose sum overflowed; look closer
    return all(bool(torch.isfinite(t).all()) for t in floats)
