"""TrainConfig: every setting of a run, its default, its help text and its checks.

Runs on the driver (parsed from YAML and flags, validated once) and on each worker
(rebuilt from the plain dict that TrainerConfig ships through Ray; never re-validated
against the cluster there). Each field's help text lives here only: the CLI builds its
flags from it and the README's flag table is generated from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

BUILTIN_MODELS = ("toy", "toy-mp", "mlp", "gpt")
TASKS = ("regression", "classification", "lm")
OPTIMIZERS = ("sgd", "adamw")
AMP_MODES = ("off", "bf16", "fp16")
SCHEDULES = ("constant", "cosine")
BACKENDS = ("nccl", "gloo")
STRATEGIES = ("ddp", "fsdp")


class ConfigError(ValueError):
    """A user mistake: the message is one line saying what is wrong and what to do."""


def _opt(help: str, **cli: Any) -> Any:
    """A config field: its default, its help (shared by CLI and docs) and CLI extras."""
    default = cli.pop("default")
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class TrainConfig:
    """Everything one training run needs; the single source of defaults and help."""

    # --- model and data ---
    model: str = _opt(
        "model: toy, toy-mp (two stages over a device pair), mlp, gpt (a small decoder-only "
        "transformer, for --task lm), or package.module:callable returning an nn.Module",
        default="toy",
    )
    task: Optional[str] = _opt(
        "what to learn: regression (mean squared error), classification (cross-entropy over "
        "integer labels; windows also report accuracy) or lm (next-token cross-entropy; "
        "perplexity); default: classification when --target is one integer column, lm with "
        "--model gpt or text data, else regression", default=None, choices=TASKS)
    num_classes: Optional[int] = _opt("classes of a classification task; default: the largest "
                                      "label in the data + 1", default=None)
    loss: Optional[str] = _opt("your own loss: package.module:callable, fn(output, target) -> "
                               "scalar, the mean over the batch's rows", default=None)
    collate: Optional[str] = _opt("your own collate function for --dataset: package.module:callable, "
                                  "fn(list of items) -> (inputs, targets)", default=None)
    data: str = _opt("training data: synthetic, or a parquet file / folder of parquet files "
                     "(local path or URI), loaded into each worker's memory (or read in pieces: --stream)",
                     default="synthetic")
    features: Optional[str] = _opt("input columns of --data, COL[,COL...] (or one fixed-size list "
                                   "column); default: f0, f1, ... as `ray-ddp data synth` writes",
                                   default=None)
    target: Optional[str] = _opt("target columns of --data, COL[,COL...]; default: t0, t1, ... "
                                 "(--task lm: none, the targets are the inputs shifted by one token)",
                                 default=None)
    stream: bool = _opt("read --data one row group at a time instead of loading it into each "
                        "worker's memory (for data larger than memory): row groups in a seeded "
                        "order, rows shuffled within them, a contiguous part per rank", default=False)
    dataset: Optional[str] = _opt("a user's map-style torch Dataset of (input, target) pairs: "
                                  "package.module:callable; sharded like --data's rows",
                                  default=None)
    val_data: Optional[str] = _opt("validation data: a parquet file / folder (or text, with --task "
                                   "lm), read like --data", default=None)
    val_fraction: float = _opt("hold out this fraction of --data / --dataset rows for validation "
                               "(a split fixed by --seed, never trained on)", default=0.0)
    eval_every: int = _opt("epochs between validations (the last epoch is always evaluated)", default=1)
    input_dim: int = _opt("features per synthetic sample (with --data: taken from the columns)",
                          default=10)
    output_dim: int = _opt("targets per synthetic sample (with --data: taken from the columns)",
                           default=5)
    width: int = _opt("hidden width of the mlp model", default=256)
    depth: int = _opt("hidden layers of the mlp model; transformer blocks of gpt", default=2)
    heads: int = _opt("attention heads of the gpt model", default=4)
    seq_len: int = _opt("tokens per training sequence (--task lm)", default=64)
    vocab_size: int = _opt("vocabulary of the gpt model (text data is bytes: 256); default: "
                           "from the data", default=256)
    sync_batchnorm: bool = _opt("BatchNorm statistics over the global batch "
                                "(nn.SyncBatchNorm) instead of each rank's own", default=False)
    find_unused_parameters: bool = _opt("let DDP handle a forward that skips some parameters "
                                        "(slower; only for models that need it)", default=False)
    plain_ddp: bool = _opt(
        "wrap the model in DDP with its defaults, as a plain torchrun script does; without it "
        "gradients live in DDP's communication buckets (gradient_as_bucket_view: one copy "
        "less per step, and one gradient-sized buffer less)", default=False)
    static_graph: bool = _opt(
        "tell DDP the model runs the same graph every step (static_graph: no control flow that "
        "changes which parameters a step uses); only for models that keep to that, and without "
        "gradient accumulation", default=False)
    bucket_mb: Optional[float] = _opt(
        "size of DDP's gradient all-reduce buckets in MiB (bucket_cap_mb); default: DDP's 25",
        default=None)
    strategy: str = _opt(
        "data parallelism: ddp (every rank holds the whole model, optimizer state and "
        "gradients) or fsdp (PyTorch FSDP2: all three sharded across the ranks, so memory per "
        "rank falls as the world grows; checkpoints are sharded, one file per rank)",
        default="ddp", choices=STRATEGIES)
    fsdp_wrap: Optional[str] = _opt(
        "with --strategy fsdp, the module classes sharded as one unit each, CLASS[,CLASS...] "
        "(package.module.Class, or a class name found in the model); default: each block of "
        "gpt, else every direct child of the model holding parameters", default=None)
    skip_final_model: bool = _opt(
        "with --strategy fsdp, do not gather the whole model into the last checkpoint's "
        "model.pt (rank 0 would hold all of it in host memory; `ray-ddp export` makes one "
        "later)", default=False)
    # --- placement ---
    workers: Optional[str] = _opt(
        "training workers (world size): N, or MIN-MAX for an elastic run that starts once MIN "
        "fit, grows toward MAX as nodes join and goes on with fewer when nodes leave (each "
        "change a restart from the latest checkpoint; the global batch stays fixed); default: "
        "GPUs / gpus-per-worker on a GPU cluster, else 2",
        default=None, parse=lambda value: parse_workers(value),
    )
    gpus_per_worker: Optional[int] = _opt(
        "GPUs each worker owns: 0 (CPU), 1, or 2 (a pair for a two-stage model); "
        "default: 1 when the cluster has GPUs, else 0",
        default=None,
        choices=(0, 1, 2),
    )
    cpus_per_worker: Optional[int] = _opt(
        "CPU cores each worker reserves in Ray and gives torch's threads; default: on a CPU run "
        "on a Ray that ray-ddp starts, the machine's cores / workers, else 1", default=None)
    backend: Optional[str] = _opt(
        "process-group backend; default: nccl on GPU, gloo on CPU",
        default=None,
        choices=BACKENDS,
    )
    address: Optional[str] = _opt(
        "Ray cluster to attach to (auto or HOST:PORT); default: RAY_ADDRESS, else start a local Ray",
        default=None,
    )
    wait_for_resources: float = _opt(
        "seconds to wait for an autoscaler to add the nodes the job needs before giving up",
        default=900.0,
    )
    # --- optimisation ---
    epochs: int = _opt("total epochs (a resumed run trains up to this many)", default=3)
    steps_per_epoch: int = _opt("optimizer steps per epoch (with --data or --dataset: as many as "
                                "one pass over the rows takes)", default=20)
    batch_size: int = _opt("samples per micro-batch on EACH worker (what fits in its memory)",
                           default=32)
    global_batch: Optional[int] = _opt(
        "samples per optimizer step over all workers, fixed for the whole run whatever the world "
        "size: each worker's micro-batches (at most --batch-size) and accumulation steps are "
        "worked out for the world size it runs in; default: workers (MAX of a range) x "
        "batch-size x grad-accum", default=None)
    lr: float = _opt("learning rate", default=0.05)
    optimizer: str = _opt("optimizer: sgd (momentum 0.9) or adamw", default="sgd", choices=OPTIMIZERS)
    seed: int = _opt("seed for weights and data (same seed, same run)", default=0)
    grad_accum: int = _opt("micro-batches per optimizer step (DDP syncs gradients on the last "
                           "only); global batch = workers x batch-size x grad-accum (with "
                           "--global-batch: worked out from it)", default=1)
    amp: str = _opt("mixed precision: off, bf16 (GPU or CPU), fp16 (GPU, with a gradient scaler)",
                    default="off", choices=AMP_MODES)
    clip_grad: float = _opt("clip the gradient norm to this (0: no clipping)", default=0.0)
    warmup_steps: int = _opt("steps of linear learning-rate warm-up from 0", default=0)
    schedule: str = _opt("learning rate after warm-up: constant, or cosine decay to 0 at the "
                         "last step", default="constant", choices=SCHEDULES)
    compile: bool = _opt("torch.compile the model (slower start, faster steps on GPU)", default=False)
    # --- checkpoints, metrics, failures ---
    storage: str = _opt(
        "where runs live: a local path or a pyarrow URI (s3://, gs://, file://)",
        default="~/ray_ddp_runs",
    )
    name: Optional[str] = _opt(
        "run name, a folder under --storage; the same name resumes; default: ray_ddp-<time>",
        default=None,
    )
    keep: int = _opt("newest checkpoints to keep", default=2)
    keep_best: bool = _opt("also keep the checkpoint with the lowest validation loss", default=False)
    checkpoint_every: int = _opt("epochs between checkpoints (the last epoch always saves)", default=1)
    report_every: int = _opt("steps per metrics row: each rank's loss and timing are summed over this "
                             "many steps (every epoch end closes a row too)", default=10)
    report_interval: float = _opt(
        "least seconds between sends of metrics rows to Ray Train, which takes one report per "
        "worker per poll (every second under ray-ddp); sooner ones would stall training (0: send "
        "every row; checkpoints always send)", default=3.0)
    max_failures: Optional[int] = _opt(
        "worker-group restarts from the latest checkpoint before giving up (-1: no limit); "
        "node preemptions, and a node that dies after its preemption notice, are not counted "
        "here; default: 0 for --workers N, while an elastic --workers MIN-MAX run restarts "
        "after every lost worker or node and stops only when it fails 3 times in a row after "
        "the same checkpoint (a bug, not a lost node)", default=None)
    max_preemptions: int = _opt(
        "restarts after spot-node preemptions before giving up (-1: no limit); when a node is "
        "drained for preemption the workers save a checkpoint at the next report and wait for "
        "the restart", default=-1)
    tensorboard: bool = _opt("also write the metrics as TensorBoard event files in <run>/tensorboard/ "
                             "(local storage)", default=False)
    # --- output ---
    json: bool = _opt("print the run summary as one JSON object on the last stdout line", default=False)
    quiet: bool = _opt("print no progress lines", default=False)
    verbose: bool = _opt("show Ray's own logs", default=False)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Build from a plain dict (YAML or Ray's train_loop_config); keys may use - or _."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise ConfigError(
                    f"unknown config key '{key}'; known keys: {', '.join(sorted(known))}"
                )
            kwargs[name] = _coerce(known[name], value, key)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str, overrides: Optional[dict[str, Any]] = None) -> "TrainConfig":
        """Read a YAML mapping of config keys; ``overrides`` (the flags given) win."""
        import yaml

        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}; pass an existing YAML file to --config")
        try:
            with open(path) as f:
                values = yaml.safe_load(f)
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"config file {path} is not valid YAML{at}; fix the syntax") from None
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys to values")
        return cls.from_dict({**values, **(overrides or {})})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---------------------------------------------------------------- validating
    def validate(self) -> "TrainConfig":
        """Check what can be checked without a cluster; raise ConfigError on the first problem."""
        for name in ("epochs", "steps_per_epoch", "batch_size", "keep", "checkpoint_every",
                     "report_every", "input_dim", "output_dim", "width", "depth", "grad_accum",
                     "heads", "seq_len", "vocab_size", "eval_every"):
            _require_positive(name, getattr(self, name))
        for name in ("cpus_per_worker", "num_classes", "global_batch"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        self.workers = parse_workers(self.workers) if self.workers is not None else None
        if isinstance(self.workers, int):
            _require_positive("workers", self.workers)
        if self.global_batch is not None and self.grad_accum != 1:
            raise ConfigError("--global-batch decides the accumulation steps (global batch / "
                              "(workers x batch-size)); drop --grad-accum")
        if self.bucket_mb is not None and not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ConfigError(f"--bucket-mb must be a positive number of MiB, got {self.bucket_mb}")
        elastic = worker_range(self.workers)
        if self.static_graph and elastic and elastic[0] < elastic[1]:
            raise ConfigError(f"--static-graph cannot run elastic (--workers {self.workers}): below "
                              f"{elastic[1]} workers the fixed global batch "
                              "needs gradient accumulation, which DDP's static graph cannot do; give a "
                              "fixed --workers or drop --static-graph")
        if self.static_graph and (self.grad_accum > 1 or self.global_batch is not None):
            raise ConfigError("--static-graph cannot accumulate gradients (DDP's static graph must "
                              "all-reduce on its first micro-batch): drop --grad-accum/--global-batch "
                              "or --static-graph")
        if self.max_preemptions < -1:
            raise ConfigError("--max-preemptions must be -1 (no limit), 0 or more")
        if not math.isfinite(self.report_interval) or self.report_interval < 0:
            raise ConfigError(f"--report-interval must be 0 or more seconds, got {self.report_interval}")
        if not math.isfinite(self.wait_for_resources) or self.wait_for_resources < 0:
            raise ConfigError(f"--wait-for-resources must be 0 or more seconds, got {self.wait_for_resources}")
        if self.max_failures is not None and self.max_failures < -1:
            raise ConfigError("--max-failures must be -1 (retry forever), 0 or more")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ConfigError(f"--lr must be a positive finite number, got {self.lr}")
        if self.gpus_per_worker not in (None, 0, 1, 2):
            raise ConfigError(f"--gpus-per-worker must be 0, 1 or 2, got {self.gpus_per_worker}")
        if self.backend not in (None, *BACKENDS):
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend}")
        if self.backend == "nccl" and self.gpus_per_worker == 0:
            raise ConfigError("--backend nccl needs GPUs; use --backend gloo with --gpus-per-worker 0")
        if self.amp not in AMP_MODES:
            raise ConfigError(f"--amp must be one of {', '.join(AMP_MODES)}, got {self.amp}")
        if self.amp == "fp16" and self.gpus_per_worker == 0:
            raise ConfigError("--amp fp16 needs GPUs; on CPU use --amp bf16")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule}")
        if not math.isfinite(self.clip_grad) or self.clip_grad < 0:
            raise ConfigError(f"--clip-grad must be 0 (off) or a positive number, got {self.clip_grad}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer}")
        if self.model not in BUILTIN_MODELS and ":" not in self.model:
            raise ConfigError(
                f"unknown model '{self.model}'; use one of {', '.join(BUILTIN_MODELS)} "
                "or package.module:callable"
            )
        if self.dataset is not None and self.data != "synthetic":
            raise ConfigError("give --data or --dataset, not both")
        if self.stream and self.data == "synthetic":
            raise ConfigError("--stream reads parquet: give --data PATH (synthetic data is never in memory)")
        if self.task not in (None, *TASKS):
            raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {self.task}")
        if not (0.0 <= self.val_fraction < 1.0):
            raise ConfigError(f"--val-fraction must be at least 0 and below 1, got {self.val_fraction}")
        if self.val_fraction and self.val_data is not None:
            raise ConfigError("give --val-data or --val-fraction, not both")
        if self.val_fraction and self.stream:
            raise ConfigError("--val-fraction splits rows held in memory; with --stream give --val-data")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy}")
        if self.strategy == "fsdp":
            _check_fsdp(self)
        elif self.fsdp_wrap is not None:
            raise ConfigError("--fsdp-wrap is for --strategy fsdp; add --strategy fsdp or drop it")
        if self.model == "gpt" and self.width % self.heads:
            raise ConfigError(f"--width {self.width} must be a multiple of --heads {self.heads}")
        for flag, spec in (("--loss", self.loss), ("--collate", self.collate)):
            if spec is not None and ":" not in spec:
                raise ConfigError(f"{flag} '{spec}' must look like package.module:callable")
        if self.dataset is not None and ":" not in self.dataset:
            raise ConfigError(f"--dataset '{self.dataset}' must look like package.module:callable")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ConfigError(
                f"--name '{self.name}' must be a plain folder name (letters, digits, '.', '_', '-'; "
                "no path separators or '..')"
            )
        if self.name is not None and ".." in self.name:
            raise ConfigError(f"--name '{self.name}' must not contain '..'")
        return self


def _check_fsdp(cfg: TrainConfig) -> None:
    """What FSDP cannot combine with, each refused in one line."""
    if cfg.model == "toy-mp":
        raise ConfigError("toy-mp splits the model over a GPU pair by hand; FSDP shards every layer "
                          "across the ranks instead: use --model toy (or mlp) with --strategy fsdp")
    if cfg.gpus_per_worker == 2:
        raise ConfigError("--strategy fsdp gives each worker one GPU (it shards the model across the "
                          "workers instead); use --gpus-per-worker 1")
    if cfg.amp == "fp16":
        raise ConfigError("--strategy fsdp trains in bf16 (FSDP2's mixed precision), not fp16 with "
                          "a gradient scaler; use --amp bf16")
    if cfg.find_unused_parameters:
        raise ConfigError("--find-unused-parameters is a DDP setting; FSDP handles a forward that "
                          "skips parameters itself: drop the flag")
    for flag, value in (("--plain-ddp", cfg.plain_ddp), ("--static-graph", cfg.static_graph),
                        ("--bucket-mb", cfg.bucket_mb)):
        if value:
            raise ConfigError(f"{flag} is a DDP setting; drop it with --strategy fsdp")
    if cfg.fsdp_wrap is not None and not [c for c in cfg.fsdp_wrap.split(",") if c.strip()]:
        raise ConfigError("--fsdp-wrap needs at least one class name, e.g. torch.nn.TransformerEncoderLayer")


def parse_workers(value: Any) -> Any:
    """``--workers``: N (an int) or an elastic range MIN-MAX (kept as the string "MIN-MAX";
    MIN == MAX is the fixed N)."""
    if isinstance(value, bool):
        raise ConfigError(f"--workers must be N or MIN-MAX, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    match = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if match:
        low, high = int(match[1]), int(match[2])
        if low < 1 or high < low:
            raise ConfigError(f"--workers {text}: an elastic range needs 1 <= MIN <= MAX, e.g. 2-8")
        return low if low == high else f"{low}-{high}"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    raise ConfigError(f"--workers must be a number N or a range MIN-MAX (e.g. 2-8), got {text!r}")


def worker_range(workers: Any) -> Optional[tuple[int, int]]:
    """(MIN, MAX) of ``--workers`` (N gives (N, N)); None when not given."""
    if workers is None:
        return None
    value = parse_workers(workers)
    if isinstance(value, int):
        return value, value
    low, high = value.split("-")
    return int(low), int(high)


def _require_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def _coerce(f: dataclasses.Field, value: Any, key: str) -> Any:
    """Turn a YAML/JSON value into the field's type, or say which key is wrong."""
    kind = str(f.type)
    if value is None:
        if "Optional" in kind:
            return None
        raise ConfigError(f"config key '{key}' needs a value")
    if "parse" in f.metadata:
        return f.metadata["parse"](value)
    try:
        if "bool" in kind:
            if isinstance(value, bool):
                return value
            raise ValueError
        if "int" in kind:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if "float" in kind:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        want = kind.replace("Optional[", "").rstrip("]")
        raise ConfigError(f"config key '{key}' must be {want}, got {value!r}") from None


def config_fields() -> list[dataclasses.Field]:
    """The fields in declaration order, for the CLI and the README table."""
    return list(dataclasses.fields(TrainConfig))


def render_flag_table() -> str:
    """The README's flag table, generated from the help texts above."""
    rows = ["| flag / YAML key | default | what it does |", "|---|---|---|"]
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.default is None or f.default is False else f"`{f.default}`"
        rows.append(f"| `{flag}` / `{f.name}` | {default} | {f.metadata['help']} |")
    return "\n".join(rows)

