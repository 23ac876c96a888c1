"""TrainConfig: every option of a run, its default and its help text (used by the CLI
and the docs' flag table), and how YAML and dicts become one. Runs on the driver and,
rebuilt from the plain dict the driver ships, on workers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional
from ray_ddp.config.checks import validate_config
from ray_ddp.config.choices import BACKENDS, STRATEGIES, TASKS, AMP_MODES, OPTIMIZERS, SCHEDULES
from ray_ddp.config.reading import coerce_value, read_yaml_mapping
from ray_ddp.config.workers import parse_workers
from ray_ddp.errors import ConfigError


def _opt(help: str, **cli: Any) -> Any:
    """A config field: its default, its help (shared by CLI and docs) and CLI extras."""
    default = cli.pop("default")
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; the single source of defaults and help. What
    the user asked for: frozen, never rewritten once checked (what the data and the
    cluster decide is the RunPlan's: ray_ddp/plan.py)."""

    # --- model and data ---
    model: str = _opt(
        "model: toy, toy-mp (two stages over a device pair), mlp, gpt (a small decoder-only "
        "transformer, for --task lm), hf:DIR (a Hugging Face save_pretrained folder, local or "
        "on the run's storage: the architecture its config.json names, with its weights; "
        "offline; needs ray_ddp[hf]), or package.module:callable returning an nn.Module",
        default="toy",
    )
    init_from: Optional[str] = _opt(
        "start a new run from these weights (new optimizer, step 0): a state_dict file (.pt, "
        ".bin, .safetensors), a ray-ddp model.pt, another run's checkpoint folder, or a Hugging "
        "Face save_pretrained folder; a rerun of the same --name resumes its own checkpoint "
        "instead", default=None)
    init_strict: bool = _opt("with --init-from: every key of the model must be in the weights "
                             "and every weight must fit (false: load the keys that match, e.g. "
                             "for a new head)", default=True, takes_value=True)
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
                     "(local path or URI), loaded into each worker's memory (or read in pieces: --stream), "
                     "or a Hugging Face datasets save_to_disk folder of one split (dict rows, memory-mapped)",
                     default="synthetic")
    features: Optional[str] = _opt("input columns of --data, COL[,COL...] (or one fixed-size list "
                                   "column); default: f0, f1, ... as `ray-ddp data synth` writes",
                                   default=None)
    target: Optional[str] = _opt("target columns of --data, COL[,COL...]; default: t0, t1, ... "
                                 "(--task lm: none, the targets are the inputs shifted by one token)",
                                 default=None)
    ray_data: bool = _opt("read --data (and --val-data) parquet through Ray Data (ray.data.read_parquet, "
                          "split over the workers by Ray Train: docs/data.md#ray-data) instead of "
                          "loading it into each worker's memory", default=False)
    stream: bool = _opt("read --data one row group at a time instead of loading it into each "
                        "worker's memory (for data larger than memory): row groups in a seeded "
                        "order, rows shuffled within them, a contiguous part per rank", default=False)
    dataset: Optional[str] = _opt("a user's map-style torch Dataset of (input, target) pairs: "
                                  "package.module:callable; sharded like --data's rows",
                                  default=None)
    loader_workers: Optional[int] = _opt(
        "DataLoader worker processes per training worker for a Dataset (--dataset, train_data=, "
        "val_data=): items read and collated ahead of the step, into pinned memory on GPU, the "
        "rows still exactly the rank's (0: read in the training thread); default: the "
        "worker's CPUs less one, at most 8 (so 0 with one CPU per worker)", default=None)
    val_data: Optional[str] = _opt("validation data: a parquet file / folder (or text, with --task "
                                   "lm, or a datasets save_to_disk folder), read like --data", default=None)
    val_fraction: float = _opt("hold out this fraction of --data / --dataset rows for validation "
                               "(a split fixed by --seed, never trained on)", default=0.0)
    eval_every: int = _opt("epochs between validations (the last epoch is always evaluated)", default=1)
    eval_every_steps: Optional[int] = _opt("also validate every this many global steps, mid-epoch "
                                           "too (a validation counts toward --early-stop wherever "
                                           "it falls)", default=None)
    early_stop: Optional[int] = _opt("stop after this many validations in a row without a lower "
                                     "val_loss (needs validation data); the run then counts as "
                                     "complete", default=None)
    input_dim: Optional[int] = _opt("features per synthetic sample; default: 10 (with --data: taken "
                                    "from the columns)", default=None)
    output_dim: Optional[int] = _opt("targets per synthetic sample; default: 5 (with --data: taken "
                                     "from the columns)", default=None)
    width: int = _opt("hidden width of the mlp model", default=256)
    depth: int = _opt("hidden layers of the mlp model; transformer blocks of gpt", default=2)
    heads: int = _opt("attention heads of the gpt model", default=4)
    seq_len: int = _opt("tokens per training sequence (--task lm)", default=64)
    vocab_size: int = _opt("vocabulary of the gpt model (text data is bytes: 256); default: "
                           "from the data", default=256)
    activation_checkpointing: bool = _opt(
        "recompute activations in backward instead of keeping them (less memory, more "
        "compute): the gpt's blocks through torch.utils.checkpoint (use_reentrant=False), a "
        "Hugging Face model through gradient_checkpointing_enable", default=False)
    lora: Optional[str] = _opt(
        "train LoRA adapters (peft) instead of the whole model: r=8,alpha=16,targets=q_proj,v_proj "
        "(dropout=0.05 too; targets: the end of the adapted layers' module paths, default: "
        "peft's for a known Hugging Face architecture); the rest is frozen; needs peft",
        default=None)
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
        "gradients), fsdp (PyTorch FSDP2: all three sharded across the ranks, so memory per "
        "rank falls as the world grows; checkpoints are sharded, one file per rank) or hsdp "
        "(FSDP2 within a shard group, by default a node's ranks, the groups replicas whose "
        "gradients are all-reduced: less traffic between nodes; fsdp's checkpoints)",
        default="ddp", choices=STRATEGIES)
    fsdp_wrap: Optional[str] = _opt(
        "with --strategy fsdp, the module classes sharded as one unit each, CLASS[,CLASS...] "
        "(package.module.Class, or a class name found in the model); default: each block of "
        "gpt, else every direct child of the model holding parameters", default=None)
    fsdp_shard_size: Optional[int] = _opt(
        "with --strategy hsdp, how many ranks share one copy of the model, each holding 1/N of "
        "it (consecutive ranks; it must divide the world size); default: the ranks of a node",
        default=None)
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
    max_steps: Optional[int] = _opt(
        "end the run at this global step if --epochs has not ended it before, with a checkpoint; "
        "the schedule (--warmup-steps, cosine) and the validations still follow --epochs, so a "
        "rerun with a larger --max-steps continues the run bit-identically", default=None)
    steps_per_epoch: Optional[int] = _opt("optimizer steps per epoch of synthetic data; default: 20 "
                                          "(with --data or --dataset: as many as one pass over the "
                                          "rows takes)", default=None)
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
    checkpoint_every_steps: Optional[int] = _opt(
        "also checkpoint every this many global steps, mid-epoch too: a lost worker then redoes "
        "at most this many steps, not the epoch so far", default=None)
    checkpoint_every_minutes: Optional[float] = _opt(
        "also checkpoint once this many minutes have passed since the last checkpoint, mid-epoch "
        "too: decided at a metrics window's end (--report-every) on rank 0's clock, and taken by "
        "every rank together", default=None)
    snapshot_every_steps: Optional[int] = _opt(
        "copy the training state into the node's shared memory every this many global steps (one copy "
        "per node under DDP, each rank's own shards under fsdp/hsdp; two kept), where it outlives the "
        "workers; a rank whose peer dies also saves the state of the last whole step there (DDP): a "
        "restarted worker group resumes from the newest on any node, sent over the group to nodes without "
        "it, and redoes at most the step under way (DDP) or the steps since the snapshot; 0: off, "
        "survivors' saves too; default: at metrics windows' ends, as often as keeps their cost within 1 "
        "percent of the training time (rank 0 times each one)", default=None)
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
    hang_timeout: float = _opt(
        "seconds without any rank finishing a step (validation batches count as progress; a "
        "checkpoint, FSDP's gathers and a profile's export get --wait-timeout) "
        "before the run is declared hung: every rank's stacks go "
        "to <run>/hangs/<step>/, one line names the ranks not waiting in a collective, and the "
        "worker group is ended and restarted from the latest checkpoint, counted against "
        "--max-failures (0: no watchdog)", default=600.0)
    wait_timeout: Optional[float] = _opt(
        "seconds the hang watch gives the run's own long waits before a rank in one counts as "
        "hung: a worker group's first step (start-up, a checkpoint's load, a first compile) "
        "and a checkpoint's snapshot and upload, FSDP's gathers, a profile's export; the "
        "process group's own timeout follows it (default: 10x --hang-timeout, and at least "
        "30 min for the first step)", default=None)
    profile: Optional[str] = _opt(
        "record a torch.profiler trace of steps START-END (e.g. 10-15; the run's global step "
        "numbers, 1 is the first) on every rank, as Chrome/Perfetto JSON under <run>/profile/ "
        "(TensorBoard's profiler plugin reads the same files)", default=None)
    mlflow: Optional[str] = _opt(
        "also track the run in MLflow at this tracking URI (http://HOST:PORT, or a sqlite:/// "
        "store): the resolved config as params, every metrics window and validation by step, "
        "the events, the summary and the final model.pt as an artifact (local storage); the "
        "MLflow run is named after the run and found by the run folder's own id, so a resume "
        "continues it; needs ray_ddp[mlflow]",
        default=None)
    mlflow_experiment: str = _opt("the MLflow experiment of --mlflow runs", default="ray_ddp")
    mlflow_parent_run: Optional[str] = _opt(
        "with --mlflow: the id of an MLflow run to nest this run's under (`ray-ddp tune` nests "
        "each trial under its search's run)", default=None)
    wandb: Optional[str] = _opt(
        "also track the run in Weights & Biases, in this project: the resolved config, every "
        "metrics window by step (each rank's step time and throughput too), the summary and "
        "the events; the W&B run's id is the run folder's own, so a resume continues it "
        "(WANDB_MODE=offline writes <run>/wandb/ for `wandb sync`); needs ray_ddp[wandb]", default=None)
    wandb_entity: Optional[str] = _opt("with --wandb: the W&B entity (team or user); W&B's default if unset",
                                       default=None)
    wandb_group: Optional[str] = _opt("with --wandb: the W&B group of the run (`ray-ddp tune` groups each "
                                      "search's trials by its name)", default=None)
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
            kwargs[name] = coerce_value(known[name], value, key)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str, overrides: Optional[dict[str, Any]] = None) -> "TrainConfig":
        """Read a YAML mapping of config keys; ``overrides`` (the flags given) win."""
        return cls.from_dict({**read_yaml_mapping(path), **(overrides or {})})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---------------------------------------------------------------- validating
    def validate(self) -> "TrainConfig":
        """The checked config: what the options alone decide (config/checks.py; what
        looks at the data's paths is data/checks.py's, run by the driver after this),
        ConfigError on the first problem; a copy with ``workers`` parsed (N, or
        "MIN-MAX" for an elastic run)."""
        checked = dataclasses.replace(self, workers=parse_workers(self.workers) if self.workers is not None else None)
        validate_config(checked)
        return checked

