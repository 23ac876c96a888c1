"""The ``ray-ddp`` command line: argument parsing only, then a call into the driver.

Runs on the driver. ``train`` flags are generated from TrainConfig's fields (one help
text per field); flags given on the command line win over keys of ``--config``. User
mistakes print one line and exit 2; a failed training run prints one line and exits 1.

"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence
from ray_ddp.errors import ConfigError
from ray_ddp.config.train import TrainConfig
from ray_ddp.config.flags import config_fields
from ray_ddp.driver.demos import DEMOS
from ray_ddp.errors import StorageError


EXIT_TRAINING_FAILED = 1


EXIT_USER_ERROR = 2


EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line, not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ray-ddp", description="PyTorch DDP training on a Ray cluster.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train a model with DDP on Ray Train workers")
    train.add_argument("--config", metavar="FILE.yaml",
                       help="YAML file of config keys (the flags' names); flags given here win")
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if "bool" in kind:
            train.add_argument(flag, action="store_true", default=None, help=f.metadata["help"])
            continue
        caster = int if "int" in kind else float if "float" in kind else str
        train.add_argument(flag, type=caster, default=None, choices=f.metadata.get("choices"),
                           metavar=None if f.metadata.get("choices") else f.name.upper(),
                           help=f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})"))

    demo = sub.add_parser("demo", help="run one of the PyTorch DDP tutorial's demos")
    demo.add_argument("which", choices=DEMOS, help="which demo")
    demo.add_argument("--workers", type=int, default=None, help="training workers (default: 2 on CPU)")
    demo.add_argument("--storage", default=TrainConfig.storage,
                      help=f"where the demo's runs live (default: {TrainConfig.storage})")

    launch = sub.add_parser("launch", help="run a torchrun-style script in N processes placed by Ray")
    launch.add_argument("--workers", type=int, default=2, help="processes (world size) (default: 2)")
    launch.add_argument("--gpus-per-worker", type=int, default=0, choices=(0, 1, 2),
                        help="GPUs each process owns (default: 0)")
    launch.add_argument("--address", default=None,
                        help="Ray cluster to attach to (auto or HOST:PORT); default: RAY_ADDRESS, "
                             "else start a local Ray")
    launch.add_argument("--max-failures", type=int, default=0,
                        help="restart all processes this many times when one fails (default: 0)")
    launch.add_argument("--wait-for-resources", type=float, default=TrainConfig.wait_for_resources,
                        help="seconds to wait for the cluster to hold every process "
                             f"(default: {TrainConfig.wait_for_resources:g})")
    launch.add_argument("script", help="the script; it reads RANK, WORLD_SIZE, LOCAL_RANK, "
                                       "MASTER_ADDR, MASTER_PORT")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")

    data = sub.add_parser("data", help="data set tools")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    synth = data_sub.add_parser("synth", help="write a parquet set a model can learn: regression or "
                                              "classification by a fixed random teacher network, "
                                              "or token sequences of a fixed Markov chain (lm)")
    synth.add_argument("--task", choices=("regression", "classification", "lm"), default="regression",
                       help="what the set is for (default: regression)")
    synth.add_argument("--classes", type=int, default=10,
                       help="classes of a classification set: label column t0 (default: 10)")
    synth.add_argument("--seq-len", type=int, default=64,
                       help="an lm set's sequences hold seq-len + 1 tokens (default: 64)")
    synth.add_argument("--vocab-size", type=int, default=256, help="an lm set's tokens (default: 256)")
    synth.add_argument("--rows", type=int, required=True, help="rows to write")
    synth.add_argument("--features", type=int, default=10, help="feature columns f0.. (default: 10)")
    synth.add_argument("--targets", type=int, default=5, help="target columns t0.. (default: 5)")
    synth.add_argument("--out", required=True,
                       help="a folder (or a .parquet file with --files 1); local path or URI")
    synth.add_argument("--files", type=int, default=1, help="parquet files to split into (default: 1)")
    synth.add_argument("--seed", type=int, default=0, help="seed of the teacher and rows (default: 0)")
    synth.add_argument("--row-group-rows", type=int, default=8192,
                       help="rows per parquet row group, the unit --stream reads (default: 8192)")

    runs = sub.add_parser("runs", help="list the runs under a storage folder")
    runs.add_argument("--storage", default=TrainConfig.storage,
                      help=f"where the runs live (default: {TrainConfig.storage})")
    runs.add_argument("--json", action="store_true", help="print the list as one JSON array")

    report = sub.add_parser("report", help="plot a run's metrics (PNG) and name its slowest rank")
    report.add_argument("run", help="the run's name (its folder under --storage)")
    report.add_argument("--storage", default=TrainConfig.storage,
                        help=f"where the run lives (default: {TrainConfig.storage})")
    report.add_argument("--out", metavar="DIR", default=None,
                        help="where the PNGs and report.txt go (default: <storage>/<run>/report/)")

    export = sub.add_parser("export", help="write a checkpoint's model as one plain state_dict file "
                                           "(consolidating an FSDP checkpoint's shards)")
    export.add_argument("run", help="the run's name (its folder under --storage)")
    export.add_argument("--storage", default=TrainConfig.storage,
                        help=f"where the run lives (default: {TrainConfig.storage})")
    export.add_argument("--step", type=int, default=None,
                        help="the checkpoint's global step (default: the newest whole checkpoint)")
    export.add_argument("--out", metavar="FILE", default=None,
                        help="the file to write (default: <run>-step-<N>.pt in the current folder)")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Flags that were given, over the YAML file's keys, over the defaults."""
    given = {f.name: getattr(args, f.name) for f in config_fields()
             if getattr(args, f.name) is not None}
    if args.config:
        return TrainConfig.from_yaml(args.config, overrides=given)
    return TrainConfig.from_dict(given)


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Like `python -m`, let --model mypkg.mod:fn import from the current folder.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "data":
            return _data_synth(args)
        if args.command == "launch":
            return _launch(args)
        if args.command == "runs":
            return _runs(args)
        if args.command == "report":
            return _report(args)
        if args.command == "export":
            return _export(args)
        return _demo(args)
    except ConfigError as err:
        print(f"ray-ddp {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except StorageError as err:
        print(f"ray-ddp {args.command}: storage error: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    except KeyboardInterrupt:
        print("ray-ddp: interrupted; run the same command again to resume from the latest "
              "checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED


def _train(args: argparse.Namespace) -> int:
    from ray_ddp.errors import TrainingError
    from ray_ddp.driver.run import run

    cfg = config_from_args(args)
    try:
        summary = run(cfg)
    except TrainingError as err:
        print(f"ray-ddp train: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    if not cfg.quiet and not summary.already_complete:
        print(f"done: {summary.epochs_completed}/{summary.epochs} epochs, final loss "
              f"{_fmt(summary.final_loss)}, {_fmt(summary.samples_per_s, ',.0f')} samples/s in "
              f"training windows, {_fmt(summary.wall_samples_per_s, ',.0f')} samples/s over the "
              f"wall time{_describe_validation(summary)}; checkpoint {summary.checkpoint}; "
              f"metrics {summary.metrics}")
    if cfg.json:
        print(json.dumps(summary.to_dict()))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ray_ddp.driver.demos import DemoFailed, run_demo
    from ray_ddp.errors import TrainingError

    try:
        result = run_demo(args.which, workers=args.workers, storage=args.storage)
    except (TrainingError, DemoFailed) as err:
        print(f"ray-ddp demo {args.which}: FAILED: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    print(f"demo {args.which}: OK: {result.detail}")
    return 0


def _data_synth(args: argparse.Namespace) -> int:
    from ray_ddp.data.synth_files import write_synthetic

    paths = write_synthetic(args.out, args.rows, args.features, args.targets, args.files, args.seed,
                            args.row_group_rows, task=args.task, classes=args.classes,
                            seq_len=args.seq_len, vocab_size=args.vocab_size)
    what = {"regression": f"{args.features} features, {args.targets} targets",
            "classification": f"{args.features} features, a label of {args.classes} classes",
            "lm": f"sequences of {args.seq_len + 1} tokens of {args.vocab_size}"}[args.task]
    print(f"wrote {args.rows} rows ({what}) to {len(paths)} parquet file(s) under {args.out}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from ray_ddp.launch.launch import launch

    if not os.path.isfile(args.script):
        raise ConfigError(f"script not found: {args.script}")
    if args.max_failures < 0:
        raise ConfigError(f"--max-failures must be 0 or more, got {args.max_failures}")
    if not args.wait_for_resources >= 0:
        raise ConfigError(f"--wait-for-resources must be 0 or more seconds, got {args.wait_for_resources}")
    return launch([os.path.abspath(args.script), *args.script_args], args.workers,
                  args.gpus_per_worker, args.address, args.max_failures, args.wait_for_resources)


def _runs(args: argparse.Namespace) -> int:
    from ray_ddp.observe.runs import format_runs, list_runs, runs_as_dicts

    listings = list_runs(args.storage)
    if args.json:
        print(json.dumps(runs_as_dicts(listings)))
    elif not listings:
        print(f"no runs under {args.storage}")
    else:
        print(format_runs(listings))
    return 0


def _report(args: argparse.Namespace) -> int:
    from ray_ddp.observe.report import write_report

    summary = write_report(args.storage, args.run, args.out)
    print(summary.text())
    for path in summary.files:
        print(f"wrote {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from ray_ddp.checkpoint.export import export_model

    print(export_model(args.run, args.storage, args.step, args.out).text())
    return 0


def _describe_validation(summary) -> str:
    if summary.val_loss is None:
        return ""
    text = f"; validation loss {summary.val_loss:.4f} (best {summary.best_val_loss:.4f})"
    if summary.val_accuracy is not None:
        text += f", accuracy {summary.val_accuracy:.4f}"
    if summary.val_perplexity is not None:
        text += f", perplexity {summary.val_perplexity:.2f}"
    if summary.best_checkpoint:
        text += f"; best checkpoint {summary.best_checkpoint}"
    return text


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)
