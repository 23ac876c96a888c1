"""Every check of a run's options, in one place, run once on the driver: what the
options alone decide (``validate_config``), what the Python API's objects add
(``check_objects``), what the devices the run got add (``check_devices``), and
``ray-ddp launch``'s own options (``check_launch``). What must look at the data's paths
is data/checks.py's, and a model is checked where it is built (models/build.py: on the
meta device, before any worker starts)."""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Any

from ray_ddp.config.choices import AMP_MODES, BACKENDS, BUILTIN_MODELS, OPTIMIZERS, SCHEDULES, TASKS
from ray_ddp.config.workers import worker_range
from ray_ddp.errors import ConfigError
from ray_ddp.config.callables import load_callable
from ray_ddp.config.lora import parse_lora
from ray_ddp.config.strategy_checks import check_strategy

if TYPE_CHECKING:  # checks take a TrainConfig, which calls them: no import at run time
    from ray_ddp.config.train import TrainConfig


def validate_config(cfg: TrainConfig) -> None:
    """What the options alone decide; ConfigError on the first problem."""
    # Each check sits below under its section of TrainConfig (config/train.py's headings),
    # but they run in this order, which interleaves the sections: the order decides which
    # problem a config with several is told first, and that must not change. The checks
    # that look at the data's paths run after all of these (data/checks.py).
    _check_counts(cfg)  # of every section
    _check_accumulation(cfg)  # optimisation
    _check_ddp_and_lora(cfg)  # model and data
    _check_preemptions_and_intervals(cfg)  # checkpoints, metrics, failures
    _check_wait_for_resources(cfg)  # placement
    _check_reading(cfg)  # model and data
    _check_hang_watch_and_restarts(cfg)  # checkpoints, metrics, failures
    _check_lr(cfg)  # optimisation
    _check_gpus_and_backend(cfg)  # placement
    _check_amp(cfg)  # optimisation
    _check_cpu_run(cfg)  # placement
    _check_schedule_and_optimizer(cfg)  # optimisation
    _check_model_and_data(cfg)  # model and data
    _check_name(cfg)  # checkpoints, metrics, failures


# ------------------------------------------------------------------ every section's counts
# The counts that must be positive, in the order they are checked (the first bad one is
# the one reported); they come from every section, so they are checked together, first.
_COUNTS = ("epochs", "batch_size", "keep", "checkpoint_every", "report_every", "width", "depth",
           "grad_accum", "heads", "seq_len", "vocab_size", "eval_every")
_COUNTS_IF_GIVEN = ("cpus_per_worker", "num_classes", "global_batch", "early_stop", "steps_per_epoch",
                    "input_dim", "output_dim", "max_steps", "checkpoint_every_steps", "eval_every_steps",
                    "fsdp_shard_size")


def _check_counts(cfg: TrainConfig) -> None:
    """Every count positive: the optional ones when given, and a fixed --workers N."""
    for name in _COUNTS:
        _require_positive(name, getattr(cfg, name))
    for name in _COUNTS_IF_GIVEN:
        if getattr(cfg, name) is not None:
            _require_positive(name, getattr(cfg, name))
    if isinstance(cfg.workers, int):
        _require_positive("workers", cfg.workers)
    if (cfg.snapshot_every_steps or 0) < 0:
        raise ConfigError(f"--snapshot-every-steps must be 0 (off) or positive, got {cfg.snapshot_every_steps}")


def _require_positive(name: str, value: int) -> None:
    """Refuse a count below 1, naming its flag."""
    if value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


# ------------------------------------------------------------------ model and data
def _check_ddp_and_lora(cfg: TrainConfig) -> None:
    """DDP's bucket size and static graph (which cannot accumulate), and --lora's spec."""
    if cfg.bucket_mb is not None and not (math.isfinite(cfg.bucket_mb) and cfg.bucket_mb > 0):
        raise ConfigError(f"--bucket-mb must be a positive number of MiB, got {cfg.bucket_mb}")
    elastic = worker_range(cfg.workers)
    if cfg.static_graph and elastic and elastic[0] < elastic[1]:
        raise ConfigError(f"--static-graph cannot run elastic (--workers {cfg.workers}): below "
                          f"{elastic[1]} workers the fixed global batch "
                          "needs gradient accumulation, which DDP's static graph cannot do; give a "
                          "fixed --workers or drop --static-graph")
    if cfg.static_graph and (cfg.grad_accum > 1 or cfg.global_batch is not None):
        raise ConfigError("--static-graph cannot accumulate gradients (DDP's static graph must "
                          "all-reduce on its first micro-batch): drop --grad-accum/--global-batch "
                          "or --static-graph")
    if cfg.lora is not None:
        parse_lora(cfg.lora)  # the spec alone: whether it fits the model, on the meta device


def _check_reading(cfg: TrainConfig) -> None:
    """How the data is read: through Ray Data, or by DataLoader workers."""
    if cfg.ray_data:
        _check_ray_data(cfg)
    if cfg.loader_workers is not None and cfg.loader_workers < 0:
        raise ConfigError(f"--loader-workers must be 0 (read in the training thread) or more, "
                          f"got {cfg.loader_workers}")


def _check_model_and_data(cfg: TrainConfig) -> None:
    """The model, the task, where the data comes from and its validation split, the
    strategy, and the user's callables named as package.module:callable."""
    if cfg.model not in BUILTIN_MODELS and ":" not in cfg.model:
        raise ConfigError(
            f"unknown model '{cfg.model}'; use one of {', '.join(BUILTIN_MODELS)} "
            ", hf:DIR or package.module:callable"
        )
    if cfg.dataset is not None and cfg.data != "synthetic":
        raise ConfigError("give --data or --dataset, not both")
    if cfg.stream and cfg.data == "synthetic":
        raise ConfigError("--stream reads parquet: give --data PATH (synthetic data is never in memory)")
    if cfg.task not in (None, *TASKS):
        raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {cfg.task}")
    if not (0.0 <= cfg.val_fraction < 1.0):
        raise ConfigError(f"--val-fraction must be at least 0 and below 1, got {cfg.val_fraction}")
    if cfg.val_fraction and cfg.val_data is not None:
        raise ConfigError("give --val-data or --val-fraction, not both")
    if cfg.val_fraction and cfg.stream:
        raise ConfigError("--val-fraction splits rows held in memory; with --stream give --val-data")
    if cfg.model.startswith("hf:") and not cfg.model[3:].strip():
        raise ConfigError("--model hf:DIR needs the folder: hf:/path/to/saved_model")
    check_strategy(cfg)
    if cfg.model == "gpt" and cfg.width % cfg.heads:
        raise ConfigError(f"--width {cfg.width} must be a multiple of --heads {cfg.heads}")
    for flag, spec in (("--loss", cfg.loss), ("--collate", cfg.collate)):
        if spec is not None and ":" not in spec:
            raise ConfigError(f"{flag} '{spec}' must look like package.module:callable")
    if cfg.dataset is not None and ":" not in cfg.dataset:
        raise ConfigError(f"--dataset '{cfg.dataset}' must look like package.module:callable")


def _check_ray_data(cfg: TrainConfig) -> None:
    """--ray-data reads parquet: not synthetic rows, nor a --stream or --dataset (whether its
    paths hold parquet, not text or another file, looks at them: data/checks.py)."""
    for path, flag in ((cfg.data, "--data"), (cfg.val_data, "--val-data")):
        if path == "synthetic":
            raise not_parquet(flag, path)
    for given, flag in ((cfg.stream, "--stream"), (cfg.dataset, "--dataset")):
        if given:
            raise ConfigError(f"--ray-data and {flag} are two ways of reading data; pick one")
    if cfg.val_fraction:
        raise ConfigError("--val-fraction splits rows held in memory; with --ray-data give --val-data")


def not_parquet(flag: str, path: str) -> ConfigError:
    """The one line for a --ray-data path that is not parquet."""
    return ConfigError(f"--ray-data reads parquet through Ray Data; {flag} {path} is not a "
                       "parquet file or folder (drop --ray-data, or give parquet)")


# ------------------------------------------------------------------ placement
def _check_wait_for_resources(cfg: TrainConfig) -> None:
    """How long to wait for an autoscaler: 0 or more seconds."""
    if not math.isfinite(cfg.wait_for_resources) or cfg.wait_for_resources < 0:
        raise ConfigError(f"--wait-for-resources must be 0 or more seconds, got {cfg.wait_for_resources}")


def _check_gpus_and_backend(cfg: TrainConfig) -> None:
    """GPUs per worker, and a process-group backend that fits them."""
    if cfg.gpus_per_worker not in (None, 0, 1, 2):
        raise ConfigError(f"--gpus-per-worker must be 0, 1 or 2, got {cfg.gpus_per_worker}")
    if cfg.backend not in (None, *BACKENDS):
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend}")
    if cfg.backend == "nccl" and cfg.gpus_per_worker == 0:
        raise ConfigError("--backend nccl needs GPUs; use --backend gloo with --gpus-per-worker 0")


def _check_cpu_run(cfg: TrainConfig) -> None:
    """A run that asked for the CPU: what needs a GPU is refused now, not on the cluster."""
    if cfg.gpus_per_worker == 0:
        check_devices(cfg, use_gpu=False)


# ------------------------------------------------------------------ optimisation
def _check_accumulation(cfg: TrainConfig) -> None:
    """--global-batch works out the accumulation steps, so --grad-accum goes with it."""
    if cfg.global_batch is not None and cfg.grad_accum != 1:
        raise ConfigError("--global-batch decides the accumulation steps (global batch / "
                          "(workers x batch-size)); drop --grad-accum")


def _check_lr(cfg: TrainConfig) -> None:
    """The learning rate: positive and finite."""
    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise ConfigError(f"--lr must be a positive finite number, got {cfg.lr}")


def _check_amp(cfg: TrainConfig) -> None:
    """The mixed-precision mode: one of AMP_MODES."""
    if cfg.amp not in AMP_MODES:
        raise ConfigError(f"--amp must be one of {', '.join(AMP_MODES)}, got {cfg.amp}")


def _check_schedule_and_optimizer(cfg: TrainConfig) -> None:
    """The schedule, the clipping, the warm-up and the optimizer."""
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule}")
    if not math.isfinite(cfg.clip_grad) or cfg.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be 0 (off) or a positive number, got {cfg.clip_grad}")
    if cfg.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be 0 or more, got {cfg.warmup_steps}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer}")


# ------------------------------------------------------------------ checkpoints, metrics, failures
def _check_preemptions_and_intervals(cfg: TrainConfig) -> None:
    """The preemption limit, the checkpoint interval in minutes and the report interval."""
    if cfg.max_preemptions < -1:
        raise ConfigError("--max-preemptions must be -1 (no limit), 0 or more")
    minutes = cfg.checkpoint_every_minutes
    if minutes is not None and not (math.isfinite(minutes) and minutes > 0):
        raise ConfigError(f"--checkpoint-every-minutes must be a positive number of minutes, got {minutes}")
    if not math.isfinite(cfg.report_interval) or cfg.report_interval < 0:
        raise ConfigError(f"--report-interval must be 0 or more seconds, got {cfg.report_interval}")


def _check_hang_watch_and_restarts(cfg: TrainConfig) -> None:
    """The hang watch's timeouts (a long wait gets at least a step's time), the profiled
    steps and the restart limit."""
    if not math.isfinite(cfg.hang_timeout) or cfg.hang_timeout < 0:
        raise ConfigError(f"--hang-timeout must be 0 (off) or more seconds, got {cfg.hang_timeout}")
    if cfg.wait_timeout is not None:
        if not cfg.hang_timeout:
            raise ConfigError("--wait-timeout is the hang watch's, which --hang-timeout 0 turns off; "
                              "pass a --hang-timeout too, or drop --wait-timeout")
        if not math.isfinite(cfg.wait_timeout) or cfg.wait_timeout < cfg.hang_timeout:
            raise ConfigError(f"--wait-timeout must be at least --hang-timeout ({cfg.hang_timeout:g} s): a "
                              f"long wait is given more time than a step, never less; got {cfg.wait_timeout}")
    if cfg.profile is not None:
        parse_profile_steps(cfg.profile)
    if cfg.max_failures is not None and cfg.max_failures < -1:
        raise ConfigError("--max-failures must be -1 (retry forever), 0 or more")


def parse_profile_steps(spec: str) -> tuple[int, int]:
    """``--profile START-END`` as (START, END): global steps, 1 the first, END included."""
    start, sep, end = str(spec).partition("-")
    try:
        first, last = int(start), int(end)
    except ValueError:
        first = last = 0
    if not sep or first < 1 or last < first:
        raise ConfigError(f"--profile takes START-END, two step numbers with 1 <= START <= END "
                          f"(e.g. 10-15), got {spec!r}")
    return first, last


def _check_name(cfg: TrainConfig) -> None:
    """The run's name: one plain folder under --storage."""
    if cfg.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.name):
        raise ConfigError(
            f"--name '{cfg.name}' must be a plain folder name (letters, digits, '.', '_', '-'; "
            "no path separators or '..')"
        )
    if cfg.name is not None and ".." in cfg.name:
        raise ConfigError(f"--name '{cfg.name}' must not contain '..'")


# ------------------------------------------------------------------ other checks
def check_devices(cfg: TrainConfig, use_gpu: bool) -> None:
    """What needs GPUs, refused for a run on CPU (asked for, or what the cluster gave)."""
    if use_gpu:
        return
    if cfg.amp == "fp16":
        raise ConfigError("--amp fp16 needs GPUs and this run is on CPU; use --amp bf16")
    if cfg.sync_batchnorm:
        raise ConfigError("--sync-batchnorm needs GPUs (PyTorch's SyncBatchNorm runs on CUDA "
                          "only); drop it on CPU")


def check_objects(cfg: TrainConfig, objects: dict[str, Any]) -> None:
    """What the Python API's objects (model=, train_data=, val_data=, loss=) add to the
    checks, and the user's loss and collate functions imported (workers import them too:
    fail here, in one line)."""
    import torch

    model, train_data, loss = objects.get("model"), objects.get("train_data"), objects.get("loss")
    collate = objects.get("collate")
    if collate is not None and not callable(collate):
        raise ConfigError(f"collate= must be a callable fn(list of items) -> batch, not {type(collate).__name__}")
    if collate is not None and cfg.collate is not None:
        raise ConfigError("give collate= or --collate, not both")
    if model is not None and not (isinstance(model, torch.nn.Module) or callable(model)):
        raise ConfigError(f"model= must be an nn.Module or a callable returning one, not {type(model).__name__}")
    if (cfg.collate is not None or collate is not None) and cfg.dataset is None and train_data is None:
        raise ConfigError("--collate is for --dataset or train_data= (parquet and text rows are "
                          "batched by ray-ddp)")
    if loss is not None and not callable(loss):
        raise ConfigError(f"loss= must be a callable fn(output, target), not {type(loss).__name__}")
    has_validation = cfg.val_data or cfg.val_fraction or objects.get("val_data") is not None
    if cfg.keep_best and not has_validation:
        raise ConfigError("--keep-best keeps the checkpoint with the lowest validation loss: "
                          "give --val-data, --val-fraction or val_data=")
    if cfg.early_stop is not None and not has_validation:
        raise ConfigError("--early-stop counts validations without a lower val_loss: give "
                          "--val-data, --val-fraction or val_data=")
    for spec, what in ((cfg.loss, "loss"), (cfg.collate, "collate")):
        if spec is not None:
            load_callable(spec, what=what)


def check_launch(script: str, max_failures: int, wait_for_resources: float) -> None:
    """``ray-ddp launch``'s own options."""
    if not os.path.isfile(script):
        raise ConfigError(f"script not found: {script}")
    if max_failures < 0:
        raise ConfigError(f"--max-failures must be 0 or more, got {max_failures}")
    if not wait_for_resources >= 0:
        raise ConfigError(f"--wait-for-resources must be 0 or more seconds, got {wait_for_resources}")
